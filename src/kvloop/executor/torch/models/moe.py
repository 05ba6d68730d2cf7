"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts; each expert is a SwiGLU MLP of its own; the token's output is the experts'
outputs weighted by the router's probabilities.

As transformers computes it: router logits -> softmax in float32 over all experts -> the
top ``k`` -> renormalised to sum to one where the model says so (Mixtral always,
Qwen3-MoE with ``norm_topk_prob``) -> cast to the activations' dtype. Tokens are grouped
by expert, so each expert multiplies all of its tokens in one product (the experts a step
does not touch are not read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvloop.executor.torch.linear import Linear


@dataclass(frozen=True)
class MoESpec:
    """How a model's config lays out its experts (``from_config``)."""

    num_experts: int
    top_k: int
    normalize: bool
    """Renormalise the top-k probabilities to sum to one."""
    layers: frozenset[int]
    """The layers whose MLP is a mixture of experts (the others are dense)."""
    prefix: str
    """The MoE block's name in a layer (``block_sparse_moe`` or ``mlp``)."""
    names: tuple[str, str, str]
    """An expert's gate, up and down matrices' names."""

    @staticmethod
    def from_config(arch: str, cfg: Mapping[str, Any], num_layers: int) -> MoESpec | None:
        """The experts of a Mixtral or Qwen3-MoE ``config.json`` (None for dense models)."""
        if arch == "MixtralForCausalLM":
            return MoESpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                           True, frozenset(range(num_layers)), "block_sparse_moe",
                           ("w1", "w3", "w2"))
        if arch == "Qwen3MoeForCausalLM":
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            layers = frozenset(i for i in range(num_layers)
                               if i not in dense and (i + 1) % step == 0)
            # NOTE: transformers 5 saves ``num_experts`` as ``num_local_experts``.
            experts = cfg.get("num_experts") or cfg["num_local_experts"]
            return MoESpec(int(experts), int(cfg["num_experts_per_tok"]),
                           bool(cfg.get("norm_topk_prob", False)), layers, "mlp",
                           ("gate_proj", "up_proj", "down_proj"))
        return None


class MoE:
    """One layer's experts: ``router`` [E, hidden] and per expert a fused gate/up and a
    down matrix (:mod:`kvloop.executor.torch.linear` layouts)."""

    def __init__(self, router: Tensor, experts: list[tuple[Linear, Linear]], top_k: int,
                 normalize: bool) -> None:
        self.router = router
        self.experts = experts
        self.top_k = top_k
        self.normalize = normalize

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor a step may read: the router, then each expert's matrices."""
        return [self.router, *(t for gate_up, down in self.experts
                               for t in (*gate_up.tensors, *down.tensors))]

    def __call__(self, h: Tensor) -> Tensor:
        """The mixture's output [T, hidden] for the normed inputs ``h`` [T, hidden]."""
        probs = F.linear(h, self.router).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            gate_up, down = self.experts[e]
            gate, up = gate_up(h[rows]).chunk(2, dim=-1)
            y = down(F.silu(gate).mul_(up))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    @staticmethod
    def load(spec: MoESpec, layer: str, get: Callable[..., Tensor],
             linear: Callable[[list[str], bool], Linear]) -> MoE:
        """Layer ``layer``'s (``model.layers.i.``) experts, matrices built by ``linear``."""
        p = f"{layer}{spec.prefix}."
        gate, up, down = spec.names
        experts = [(linear([f"{p}experts.{e}.{gate}.weight", f"{p}experts.{e}.{up}.weight"],
                           False), linear([f"{p}experts.{e}.{down}.weight"], False))
                   for e in range(spec.num_experts)]
        return MoE(get(f"{p}gate.weight"), experts, spec.top_k, spec.normalize)
