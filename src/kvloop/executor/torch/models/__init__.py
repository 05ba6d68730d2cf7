"""Model architectures kvloop can run, and their configuration parsed from ``config.json``.

A registry maps the Hugging Face architecture name (``config.json``'s ``architectures[0]``)
to the class that implements it; every Llama-family name maps to one implementation (Qwen3's
per-head query and key norms are weights the checkpoint has or not).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.executor.torch.models.llama import LlamaForCausalLM
from kvloop.executor.torch.models.moe import MoESpec

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}
"""Architecture name -> implementation class."""

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""``model_type`` -> architecture, for configs saved without ``architectures``."""

_ROPE_TYPES = ("default", "linear", "llama3")


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The implementation of ``architecture``; ``ValueError`` naming it if unsupported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {architecture!r}; kvloop supports: {supported}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """What kvloop needs to know about a model, parsed from its Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """Non-default RoPE parameters (``rope_type`` "linear" or "llama3" and their fields)."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Window of the layers that use sliding-window attention (None: all full attention)."""
    eos_token_ids: tuple[int, ...] = ()
    """EOS ids of config.json and generation_config.json, config's first."""
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    """The checkpoint's dtype as saved ("bfloat16", ...), if recorded."""
    moe: MoESpec | None = None
    """The mixture-of-experts layout (Mixtral, Qwen3-MoE), or None for a dense model."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The raw config.json, for anything not parsed above."""

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the first one), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(
        cls, cfg: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Parse a ``config.json`` dict (transformers 4 or 5 layout)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), "")
        if not arch:
            raise ValueError("config.json names no architecture (no 'architectures')")
        get_model_class(arch)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; kvloop supports silu")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling = _parse_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(arch, cfg),
            eos_token_ids=_eos_ids(cfg, generation_config or {}),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            moe=MoESpec.from_config(arch, cfg, int(cfg["num_hidden_layers"])),
            extra=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) of a folder."""
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_dict(cfg, gen)


def _parse_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling params or None) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; kvloop supports: {', '.join(_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1) != 1:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
        )
    return theta, params


def _sliding_window(arch: str, cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return None
        types = cfg.get("layer_types")
        if types is not None and "sliding_attention" not in types:
            return None
        if types is None and int(cfg.get("max_window_layers", 0)) >= int(cfg["num_hidden_layers"]):
            return None
    return int(window)


def _eos_ids(cfg: Mapping[str, Any], gen: Mapping[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        for value in source if isinstance(source, list) else [source]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "ModelConfig", "get_model_class"]
