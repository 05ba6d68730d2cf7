"""Load a local Hugging Face model folder: config.json plus one or sharded *.safetensors.

Sharded checkpoints are found through ``model.safetensors.index.json`` (or, without an
index, by listing every ``*.safetensors`` file). Tensors are read one at a time, cast to the
requested dtype and placed on the device, so peak host memory stays near one tensor. On CPU
the converted model is saved ready to run (``ready_weights``) and read from there at later
starts, and the weights a decode step streams then move, in the order it reads them, onto
transparent huge pages (``huge_pages``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from kvloop.executor.torch import ready_weights
from kvloop.executor.torch.huge_pages import HugePageMove
from kvloop.executor.torch.models import ModelConfig, get_model_class
from kvloop.executor.torch.models.llama import LlamaForCausalLM
from kvloop.executor.torch.native import cpu_flags

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``: CUDA if available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this torch build has no CUDA or sees no GPU "
                         f"(torch {torch.__version__}); use device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (AVX-512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def auto_dtype_note(device: torch.device, dtype: torch.dtype) -> str:
    """Why ``dtype="auto"`` gave ``dtype`` on ``device``, for status lines."""
    if device.type == "cuda":
        return "auto: CUDA"
    if dtype != torch.bfloat16:
        return "auto: no native bfloat16 on this CPU"
    flags = cpu_flags()
    native = "AMX" if "amx_bf16" in flags else "AVX-512-BF16" if "avx512_bf16" in flags else ""
    return f"auto: {native}" if native else "auto: for int4"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device,
                  quantization: str | None = None) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, on CPUs with native bfloat16 (AVX-512-BF16, AMX) and
    with a ``quantization`` (int4's kernel takes bfloat16 activations), else float32; or one
    of float32/bfloat16/float16.

    NOTE: on CPUs without native bfloat16, torch emulates it and fp16 is slower still, so
    float32 is the fast exact-enough choice there."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype == "auto":
        native = device.type == "cuda" or cpu_has_native_bf16() or quantization is not None
        return torch.bfloat16 if native else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        choices = ", ".join(["auto", *DTYPES])
        raise ValueError(f"dtype must be one of {choices}; got {dtype!r}") from None


class SafetensorsCheckpoint:
    """Name -> tensor access over one or several safetensors files of a folder."""

    def __init__(self, path: Path) -> None:
        index_path = path / "model.safetensors.index.json"
        if index_path.exists():
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            self.where = {name: path / file for name, file in weight_map.items()}
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {path}")
            self.where = {}
            for file in files:
                with safe_open(path / file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        self.where[name] = path / file
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise FileNotFoundError(f"shards listed in the index are missing: {missing}")
        self._open: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> Tensor:
        file = self.where.get(name)
        if file is None:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(file, framework="pt")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._open.clear()


def load_model(
    path: str | Path, *, dtype: torch.dtype, device: torch.device,
    quantization: str | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Parse the folder's config and build its model on ``device`` in ``dtype`` (layer
    matrices quantised when ``quantization`` is given). On CPU: from its ready-to-run
    weights where an earlier start saved them (``ready_weights``; else converted, and saved
    in the background), and the streamed weights copied onto huge pages in the background
    where the OS offers them (``model.weights_move``, applied between two forwards)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
    config = ModelConfig.from_pretrained(path)
    cls = get_model_class(config.architecture)
    ready = ready_weights.ready_path(path, dtype, quantization) if device.type == "cpu" else None
    model = ready_weights.load(cls, config, ready) if ready is not None else None
    if model is None:
        model = _convert(path, config, cls, dtype=dtype, device=device,
                         quantization=quantization)
        if ready is not None:
            model.saving_ready = ready_weights.save_in_background(model, ready) is not None
    else:
        model.loaded_ready = True
    move = HugePageMove(model.streamed_tensors())  # NOTE: CPU tensors only; others stay
    if move.nbytes:
        model.weights_move = move
        model.start_weights_move()
    return config, model


def _convert(path: Path, config: ModelConfig, cls: type[LlamaForCausalLM], *,
             dtype: torch.dtype, device: torch.device, quantization: str | None,
             ) -> LlamaForCausalLM:
    """The model built from the folder's checkpoint (cast, packed, quantised)."""
    ckpt = SafetensorsCheckpoint(path)

    def get(name: str, exact: bool = False) -> Tensor:
        # NOTE: matrices to quantise load in float32 (``exact``), so that a quantised
        # checkpoint's grid (dequantised into float32 at conversion) is found again exactly.
        return ckpt.get(name).to(device=device, dtype=torch.float32 if exact else dtype)

    try:
        return cls.load_weights(config, get, ckpt.has, quantization)
    finally:
        ckpt.close()
