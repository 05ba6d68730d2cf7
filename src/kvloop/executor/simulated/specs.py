"""Model and hardware specs for the simulator: shapes, byte counts, presets, KV-pool sizing.

Pure stdlib. Every size is per GPU (one tensor-parallel rank) unless its name says otherwise.
Tensor parallelism follows Megatron/vLLM: attention heads, MLP columns and the vocabulary are
split across ranks; KV heads are split too, but replicated when ``tp`` exceeds their number.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvloop.executor.simulated.efficiency import DeviceEfficiency, fitted_efficiency
from kvloop.executor.simulated.network import allreduce_model

GiB = 1 << 30
MiB = 1 << 20

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
}


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a mixture-of-experts decoder (Mixtral, Qwen2/Qwen3-MoE,
    DeepSeek-V2/V3's MLPs): each MoE layer's MLP is ``num_experts`` SwiGLU experts of width
    ``expert_intermediate_size``, of which a router picks ``experts_per_token`` for each
    token, plus shared experts every token runs through."""

    num_experts: int
    """Routed experts per MoE layer (HF ``num_local_experts``, ``num_experts``,
    ``n_routed_experts``)."""
    experts_per_token: int
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    expert_intermediate_size: int
    """SwiGLU width of one routed expert (HF ``moe_intermediate_size``; Mixtral's
    ``intermediate_size``)."""
    shared_intermediate_size: int = 0
    """SwiGLU width of the shared experts together (Qwen2-MoE's
    ``shared_expert_intermediate_size``, DeepSeek's ``n_shared_experts`` x
    ``moe_intermediate_size``); 0: none."""
    first_dense_layers: int = 0
    """Leading layers whose MLP is dense (``intermediate_size`` wide), as DeepSeek's
    ``first_k_dense_replace``."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoESpec.{name} must be a positive int, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError("MoESpec.experts_per_token must not exceed num_experts")
        for name in ("shared_intermediate_size", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MoESpec.{name} must be an int >= 0, got {value!r}")

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts that ``tokens`` tokens are routed to, each token to
        ``experts_per_token`` of them uniformly: ``E·(1 − (1 − k/E)^T)``. This is how many
        experts' weights a step reads."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens) if tokens > 0 else 0.0


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Llama-style decoder (GQA attention, SwiGLU MLP, RMSNorm), dense or with
    mixture-of-experts MLPs (``moe``).

    Biases (Qwen2's q/k/v bias) are ignored: they are < 0.01% of the parameters.
    """

    name: str
    """Preset name or the model folder name."""
    num_layers: int
    """Decoder layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Residual stream width."""
    num_heads: int
    """Query heads (HF ``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads (GQA); equals ``num_heads`` for plain multi-head attention."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """SwiGLU MLP width (each of gate, up and down has hidden × intermediate weights)."""
    vocab_size: int
    """Rows of the embedding table and of the LM head."""
    dtype_bytes: int = 2
    """Bytes per weight and per KV-cache element (2 for bf16/fp16)."""
    tie_word_embeddings: bool = False
    """True when the LM head reuses the embedding table (no separate weights)."""
    max_position_embeddings: int = 131072
    """Longest context the model supports: the default ``max_model_len``."""
    moe: MoESpec | None = None
    """The experts of a mixture-of-experts model (None: dense; ``intermediate_size`` is
    then every layer's MLP width, else the dense layers' only)."""

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads ({self.num_heads}) must be a multiple "
                f"of num_kv_heads ({self.num_kv_heads})"
            )

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless ``tp`` is a positive int dividing ``num_heads``."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            raise ValueError(f"tensor parallel size must be a positive int, got {tp!r}")
        if self.num_heads % tp:
            raise ValueError(
                f"{self.name} has {self.num_heads} attention heads, which "
                f"tensor parallel size {tp} does not divide"
            )

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads each rank holds; replicated (>= 1 per rank) when tp > num_kv_heads."""
        self.check_tp(tp)
        return max(1, math.ceil(self.num_kv_heads / tp))

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return 0 if self.moe is None else self.num_layers - self.moe.first_dense_layers

    def linear_params(self, tp: int = 1, ep: int = 1) -> int:
        """Per-rank weights of every decoder layer's projections (q, k, v, o; gate, up and
        down of the dense MLPs, of every expert and of the shared experts; the routers),
        lm_head excluded. Experts are split across ranks as vLLM's tensor parallelism
        splits them (each rank holds a slice of every expert) or, with expert parallelism
        over ``ep`` ranks, whole: each rank holds ``num_experts / ep`` of them."""
        self.check_tp(tp)
        h = self.hidden_size
        q_o = 2 * h * (self.num_heads // tp) * self.head_dim
        k_v = 2 * h * self.kv_heads_per_rank(tp) * self.head_dim
        dense_mlp = 3 * h * math.ceil(self.intermediate_size / tp)
        moe_layers = self.num_moe_layers
        params = self.num_layers * (q_o + k_v) + (self.num_layers - moe_layers) * dense_mlp
        if self.moe is not None:
            m = self.moe
            if ep > 1:
                experts = math.ceil(m.num_experts / ep) * 3 * h * m.expert_intermediate_size
            else:
                experts = m.num_experts * 3 * h * math.ceil(m.expert_intermediate_size / tp)
            shared = 3 * h * math.ceil(m.shared_intermediate_size / tp)
            params += moe_layers * (experts + shared + h * m.num_experts)
        return params

    def vocab_params(self, tp: int = 1) -> int:
        """Per-rank weights of one vocabulary matrix (embedding or LM head), vocab-parallel."""
        self.check_tp(tp)
        return math.ceil(self.vocab_size / tp) * self.hidden_size

    def _params(self, tp: int, ep: int = 1) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size  # NOTE: replicated on every rank.
        heads = 1 if self.tie_word_embeddings else 2
        return self.linear_params(tp, ep) + heads * self.vocab_params(tp) + norms

    @property
    def num_params(self) -> int:
        """Total parameters: embedding, attention q/k/v/o, SwiGLU MLP, norms, and the LM
        head unless tied."""
        return self._params(1)

    def weight_bytes(self, tp: int = 1, ep: int = 1) -> int:
        """Weight bytes resident on each GPU (embeddings split across ranks too; experts
        spread over ``ep`` ranks with expert parallelism)."""
        return self._params(tp, ep) * self.dtype_bytes

    def streamed_weight_bytes(self, tp: int = 1) -> int:
        """Weight bytes one forward pass reads from memory on each GPU: everything but an
        untied input embedding table, of which only the looked-up rows are touched."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return (self.linear_params(tp) + self.vocab_params(tp) + norms) * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV-cache bytes one token takes on each GPU (K and V, every layer)."""
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def kv_block_bytes(self, block_size: int, tp: int = 1) -> int:
        """Bytes of one KV block of ``block_size`` tokens on each GPU."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return block_size * self.kv_bytes_per_token(tp)

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], name: str, *, source: str | None = None
    ) -> ModelSpec:
        """Build a spec from a Hugging Face ``config.json`` dict (``text_config`` of a
        multimodal config is used when the top level has no layers). ``source`` names the
        file in error messages (default: ``name``)."""
        where = source or name
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}

        def need(key: str) -> int:
            if cfg.get(key) is None:
                arch = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type")
                kind = f" ({arch})" if arch else ""
                raise ValueError(f"{where}: Hugging Face config{kind} has no '{key}': the "
                                 "simulator reads decoder-only transformers described with "
                                 "Llama's field names (Llama, Qwen, Mistral, Mixtral, "
                                 "DeepSeek and the like)")
            return int(cfg[key])

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        layers = need("num_hidden_layers")
        return cls(
            name=name,
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            dtype_bytes=_DTYPE_BYTES.get(dtype.removeprefix("torch."), 2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            moe=moe_from_hf_config(cfg, layers, where),
        )


def moe_from_hf_config(cfg: dict[str, Any], num_layers: int, where: str) -> MoESpec | None:
    """The experts of a Hugging Face config, in any of its spellings (None for a dense
    model): Mixtral (``num_local_experts``; experts ``intermediate_size`` wide), Qwen2-MoE
    and Qwen3-MoE (``num_experts``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``, ``mlp_only_layers``), DeepSeek-V2/V3
    (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get(
        "n_routed_experts")
    if not experts:
        return None
    top_k = cfg.get("num_experts_per_tok")
    if not top_k:
        raise ValueError(f"{where}: a mixture-of-experts config needs 'num_experts_per_tok'")
    width = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * width
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("mlp_only_layers"):  # NOTE: Qwen's dense layers; counted as leading ones
        dense = len(cfg["mlp_only_layers"])
    try:
        return MoESpec(int(experts), int(top_k), width, shared, min(dense, num_layers))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU: peak rates from the vendor datasheet, and how its kernels reach them."""

    name: str
    """Preset name, or the name in a JSON spec."""
    peak_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s with FP32 accumulate (no 2:4 sparsity)."""
    mem_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    mem_bytes: int
    """Device memory as the driver reports it (nvidia-smi total), bytes."""
    host_link_bandwidth: float
    """Host<->device bytes/s in one direction (PCIe or C2C), used for KV swap."""
    interconnect: str
    """All-reduce table for tensor parallelism (:mod:`.network`): ``nvlink3``,
    ``nvlink4``, ``pcie4`` or ``pcie5``."""
    profile: str | DeviceEfficiency = "derived"
    """Kernel efficiencies: a shipped fit (``a100``, ``a40``, ``h100``), ``derived`` (the
    fits averaged, for GPUs without a public profile), or explicit values."""

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mem_bandwidth", "mem_bytes", "host_link_bandwidth"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{self.name}: {field} must be a positive number, got {value!r}")
        if not isinstance(self.interconnect, str) or not self.interconnect:
            raise ValueError(f"{self.name}: interconnect must name a table")

    def efficiency(self) -> DeviceEfficiency:
        """The device's kernel efficiencies (see ``profile``)."""
        if isinstance(self.profile, DeviceEfficiency):
            return self.profile
        return fitted_efficiency(self.profile)

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte at which a kernel turns from memory- to compute-bound."""
        return self.peak_flops / self.mem_bandwidth


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Values from each model's config.json on the Hugging Face Hub.
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelSpec(
        "qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, max_position_embeddings=32768
    ),
    "smollm2-135m": ModelSpec(
        "smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


_PCIE4, _PCIE5 = 32e9, 64e9  # x16 line rate per direction (datasheets give both summed)
_C2C = 450e9  # NVLink-C2C per direction (GH200: 900 GB/s summed)

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # mem_bytes: the nvidia-smi "Total" of each card, as printed in many public logs.
    # Efficiency: Vidur's profiled GPUs use their own fits, H200 and GH200 (the H100's chip)
    # the H100's; the others are derived.
    "a100-80gb": HardwareSpec(  # A100 datasheet (SXM4 80GB): 312 TF bf16, 2,039 GB/s.
        "a100-80gb", 312e12, 2039e9, 81920 * MiB, _PCIE4, "nvlink3", "a100"
    ),
    "a40": HardwareSpec(  # A40 datasheet: 149.7 TF fp16/bf16 dense, 696 GB/s GDDR6.
        "a40", 149.7e12, 696e9, 46068 * MiB, _PCIE4, "pcie4", "a40"
    ),
    "h100": HardwareSpec(  # H100 datasheet (SXM5): 989 TF bf16 dense, 3.35 TB/s HBM3.
        "h100", 989.4e12, 3.35e12, 81559 * MiB, _PCIE5, "nvlink4", "h100"
    ),
    "h200": HardwareSpec(  # H200 datasheet (SXM): the H100 GPU (989 TF bf16 dense) with
        # 141 GB HBM3e at 4.8 TB/s: the H100's fit, as gh200.
        "h200", 989.4e12, 4.8e12, 143771 * MiB, _PCIE5, "nvlink4", "h100"
    ),
    "b200": HardwareSpec(  # HGX B200: 2.25 PF bf16 dense (4.5 sparse); HBM3e on a 7,680-bit
        # bus at 3,996 MHz = 7.67 TB/s as the driver reports it (the datasheet's 8 TB/s
        # assumes 8,192 bits); nvidia-smi total 183,359 MiB; NVLink 5, PCIe Gen5 to the host.
        "b200", 2.25e15, 7.67e12, 183359 * MiB, _PCIE5, "nvlink5"
    ),
    "l4": HardwareSpec(  # L4 datasheet: 242 TF bf16 with sparsity (121 dense), 300 GB/s.
        "l4", 121e12, 300e9, 23034 * MiB, _PCIE4, "pcie4"
    ),
    "l40s": HardwareSpec(  # L40S datasheet: 362 TF bf16 dense (733 sparse), 864 GB/s GDDR6,
        # 48 GB with ECC (the nvidia-smi total of the 48 GB Ada/Ampere cards), PCIe Gen4.
        "l40s", 362.05e12, 864e9, 46068 * MiB, _PCIE4, "pcie4"
    ),
    "rtx-4090": HardwareSpec(  # Ada whitepaper: 165.2 TF bf16 (FP32 accumulate), 1,008 GB/s.
        # No P2P on GeForce: NCCL stages all-reduce through host memory, slower than the
        # pcie4 table (measured with P2P) says.
        "rtx-4090", 165.2e12, 1008e9, 24564 * MiB, _PCIE4, "pcie4"
    ),
    "rtx-pro-6000": HardwareSpec(
        # RTX PRO 6000 Blackwell Workstation Edition: 188 SMs at ~2.6 GHz boost, 503.8 TF
        # bf16/fp16 dense with FP32 accumulate (4 PF FP4 sparse / 8), 96 GB GDDR7 on a
        # 512-bit bus at 28 Gbps = 1,792 GB/s; PCIe Gen5 x16, no NVLink. nvidia-smi total
        # 97,887 MiB.
        "rtx-pro-6000", 503.8e12, 1792e9, 97887 * MiB, _PCIE5, "pcie5"
    ),
    "gh200": HardwareSpec(  # GH200 datasheet: the H100 GPU (989 TF bf16 dense) with 96 GB
        # HBM3 at 4 TB/s, joined to the Grace CPU by NVLink-C2C, 900 GB/s both ways summed
        # (450 GB/s per direction). 96 GiB assumed for the usable total (no public log
        # at hand).
        "gh200", 989.4e12, 4.0e12, 96 * 1024 * MiB, _C2C, "nvlink4", "h100"
    ),
}

_SPEC_KEYS = {
    "name", "peak_flops", "mem_bandwidth", "mem_bytes", "host_link_bandwidth",
    "interconnect", "profile",
}


def hardware_spec_from_dict(d: Any, where: str) -> HardwareSpec:
    """A :class:`HardwareSpec` from a JSON object (``profile`` a shipped name or an object
    with every :class:`DeviceEfficiency` field); ValueError naming ``where``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = sorted(set(d) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    missing = sorted(_SPEC_KEYS - {"profile"} - set(d))
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    kw = dict(d)
    if isinstance(kw.get("profile"), dict):
        kw["profile"] = DeviceEfficiency.from_dict(kw["profile"], f"{where}: profile")
    elif "profile" in kw:
        fitted_efficiency(kw["profile"])  # an unknown name fails here, not mid-simulation
    try:
        spec = HardwareSpec(**kw)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None
    allreduce_model(spec.interconnect, 2)  # validates the name
    return spec


def read_json(path: str | Path, what: str) -> Any:
    """The parsed JSON file at ``path``; a missing or unreadable file is one ValueError
    naming it and ``what`` it should have been."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON {what} ({exc})") from None


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, or a spec read from a HF ``config.json`` (or a folder holding one)."""
    if name_or_path.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path.lower()]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model '{name_or_path}': choose a preset "
            f"({', '.join(MODEL_PRESETS)}) or give a path to a Hugging Face "
            "config.json"
        )
    cfg = read_json(path, "config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    spec = ModelSpec.from_hf_config(cfg, path.resolve().parent.name, source=str(path))
    return replace(spec, name=readable_model_name(spec, path, cfg))


_CONVERTED_FOLDER = re.compile(r"[0-9a-f]{32}-v\d+")
"""A kvloop GGUF conversion's folder: a hash of the file's bytes (``kvloop.engine.
model_source.converted_path``), which means nothing to a reader."""


def readable_model_name(spec: ModelSpec, config_path: Path, cfg: dict[str, Any]) -> str:
    """What to call the model of ``config_path``: its folder's name, or for a kvloop GGUF
    conversion (a folder named by a hash) its kind and size, e.g. ``llama 135M (converted
    GGUF bad8a3c4)``."""
    if config_path.name != "config.json":  # NOTE: a config file named after its model
        return config_path.stem
    folder = config_path.resolve().parent.name
    if not _CONVERTED_FOLDER.fullmatch(folder):
        return folder
    params = spec.num_params
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return f"{cfg.get('model_type') or 'model'} {size} (converted GGUF {folder[:8]})"


def get_hardware_spec(name_or_path: str) -> HardwareSpec:
    """A hardware preset by name (case-insensitive), or a JSON spec file (the fields of
    :class:`HardwareSpec`)."""
    if name_or_path.lower() in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[name_or_path.lower()]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown hardware '{name_or_path}': choose one of {', '.join(HARDWARE_PRESETS)} "
            "or give a path to a JSON hardware spec"
        )
    return hardware_spec_from_dict(read_json(path, "hardware spec"), str(path))


def default_activation_reserve_bytes(
    model: ModelSpec, tp: int = 1, max_num_batched_tokens: int = 8192
) -> int:
    """Memory kept out of the KV pool for activations and workspaces, per GPU.

    Mirrors what vLLM's profiling run finds: a fixed 1 GiB of non-torch memory (CUDA
    graphs pool, cuBLAS workspace, NCCL buffers) plus the peak live activations of one
    ``max_num_batched_tokens`` forward (gate+up output, SwiGLU output, qkv, ~4 hidden-wide
    buffers) and fp32 logits for 256 sequences. Llama-3.1-8B at tp=1: ~2.1 GiB.
    """
    per_token = (
        3 * math.ceil(model.intermediate_size / tp)
        + 4 * model.hidden_size
        + (model.num_heads // tp + 2 * model.kv_heads_per_rank(tp)) * model.head_dim
    )
    logits = 256 * math.ceil(model.vocab_size / tp) * 4
    return GiB + max_num_batched_tokens * per_token * model.dtype_bytes + logits


def num_gpu_blocks(
    model: ModelSpec,
    hw: HardwareSpec,
    *,
    block_size: int,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int | None = None,
    ep: int = 1,
) -> int:
    """KV blocks that fit on each GPU: (memory × utilization − weights − reserve) // block.

    ``activation_reserve_bytes`` defaults to :func:`default_activation_reserve_bytes`;
    ``ep``: the expert-parallel group (experts spread over it). Raises ValueError when
    nothing is left for the KV cache.
    """
    model.check_tp(tp)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = int(hw.mem_bytes * gpu_memory_utilization)
    weights = model.weight_bytes(tp, ep)
    if weights >= budget:
        raise ValueError(
            f"{model.name} weights ({weights / 1e9:.0f} GB per GPU at tp={tp}) "
            f"do not fit in {hw.name} memory × {gpu_memory_utilization:g}; "
            "raise --tensor-parallel-size"
        )
    if activation_reserve_bytes is None:
        activation_reserve_bytes = default_activation_reserve_bytes(model, tp)
    block_bytes = model.kv_block_bytes(block_size, tp)
    free = budget - weights - activation_reserve_bytes
    blocks = max(0, free) // block_bytes
    if blocks <= 0:
        raise ValueError(
            f"no room for a KV cache: {hw.name} memory × {gpu_memory_utilization:g} is "
            f"{budget / 1e9:.1f} GB per GPU; {model.name} weights take {weights / 1e9:.1f} GB "
            f"and activations/workspace {activation_reserve_bytes / 1e9:.1f} GB, leaving less "
            f"than one {block_size}-token block ({block_bytes} bytes); raise "
            "--gpu-memory-utilization or --tensor-parallel-size"
        )
    return blocks


def num_cpu_blocks(model: ModelSpec, *, block_size: int, tp: int = 1, swap_space_gib: float) -> int:
    """KV blocks in the host swap tier: ``swap_space_gib`` GiB per GPU (vLLM --swap-space)."""
    if swap_space_gib < 0:
        raise ValueError(f"swap_space_gib must be >= 0, got {swap_space_gib}")
    return int(swap_space_gib * GiB) // model.kv_block_bytes(block_size, tp)
