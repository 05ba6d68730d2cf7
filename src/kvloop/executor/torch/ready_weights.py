"""Ready-to-run weights: a CPU model's tensors as its kernels read them (packed, quantised,
laid out), saved once per machine, model, dtype and quantization, and memory-mapped at
later starts instead of converted again.

The first start converts the checkpoint as usual (:func:`~kvloop.executor.torch.loader.
load_model`) and then saves the result in the background (:func:`save_in_background`: a
thread at the lowest CPU priority, which the process waits for at exit; a temporary file
renamed into place, so an interrupted save leaves nothing half-written). Later starts read
it with :func:`load`: safetensors maps the file, so no tensor is read or converted until a
step (or the huge-page copy) touches it.

The file is named by :func:`~kvloop.executor.torch.identity.machine_model_key`: the model's
files, this CPU and its features, the torch and kvloop versions and the executor's sources
(a changed layout or kernel is a new file), the dtype, the quantization, and which of
kvloop's kernels build and which layouts they are chosen for here. Layouts that cannot be
written (oneDNN's opaque packed matrices, which float32 uses on CPUs where oneDNN is faster
than kvloop's kernel) are not cached: those models convert at every start. At most
:data:`KEEP` files are kept, the least recently used removed first.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvloop.executor.torch import linear as linear_layouts
from kvloop.executor.torch import native
from kvloop.executor.torch.models import ModelConfig
from kvloop.executor.torch.models.llama import DecoderLayer, LlamaForCausalLM
from kvloop.paths import cache_dir
from kvloop.priority import lowest_priority

logger = logging.getLogger(__name__)

KEEP = 4
"""Ready files kept in :func:`ready_dir` (the least recently used go first)."""
LAYOUTS = {cls.__name__: cls for cls in (
    linear_layouts.DenseLinear, linear_layouts.Bf16Linear, linear_layouts.F32Linear,
    linear_layouts.Int4Linear, linear_layouts.Int8Linear)}
"""The matrix layouts that can be saved: plain tensors and scalars in their attributes."""
_MATRICES = ("qkv", "o", "gate_up", "down")
_OPTIONAL_NORMS = ("q_norm", "k_norm")
_FORMAT = "kvloop-ready-weights-2"


def ready_dir() -> Path:
    """Where ready-to-run weights are kept."""
    return cache_dir() / "ready_weights"


def ready_path(model_path: Path, dtype: torch.dtype, quantization: str | None) -> Path:
    """The ready file of this model folder, dtype and quantization on this machine."""
    from kvloop.executor.torch.identity import machine_model_key

    mod = native.kernels()
    # NOTE: which layouts ``make_linear`` picks: the kernels' build and its choices here.
    layouts = [mod.__name__ if mod is not None else None, native.f32_preferred(),
               native.bf16_supported()]
    key = machine_model_key(model_path, dtype=dtype, quantization=quantization,
                            layouts=layouts, format=_FORMAT)
    return ready_dir() / f"{key}.safetensors"


def _state(model: LlamaForCausalLM) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """The model's tensors by name and how to rebuild it (JSON-ready), or None where a
    matrix's layout cannot be written (:data:`LAYOUTS`) or a tensor is not a plain CPU one.

    NOTE: tensors are detached views: a huge-page move (``Tensor.set_`` on the model's
    tensors) meanwhile leaves them, and the memory they read, as they are. A tensor sharing
    another's memory (a tied LM head) is written once and named as that one's alias."""
    tensors: dict[str, Tensor] = {}
    seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}

    def put(name: str, t: Tensor) -> Any:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            raise TypeError(name)
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen:
            return {"alias": seen[key]}
        seen[key] = name
        tensors[name] = t.detach()
        return {"tensor": name}

    def matrix(name: str, lin: Any) -> dict[str, Any]:
        if type(lin).__name__ not in LAYOUTS or type(lin) is not LAYOUTS[type(lin).__name__]:
            raise TypeError(name)
        fields: dict[str, Any] = {}
        for attr, value in vars(lin).items():
            if isinstance(value, Tensor):
                fields[attr] = put(f"{name}.{attr}", value)
            elif value is None or isinstance(value, (bool, int, float, str)):
                fields[attr] = {"value": value}
            else:
                raise TypeError(f"{name}.{attr}")
        return {"layout": type(lin).__name__, "fields": fields}

    try:
        plan: dict[str, Any] = {"embed": put("embed", model.embed),
                                "norm": put("norm", model.norm), "layers": []}
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            plan["layers"].append({
                "input_norm": put(p + "input_norm", layer.input_norm),
                "post_norm": put(p + "post_norm", layer.post_norm),
                **{n: {"value": None} if getattr(layer, n) is None else
                   put(p + n, getattr(layer, n)) for n in _OPTIONAL_NORMS},
                **{m: matrix(p + m, getattr(layer, m)) for m in _MATRICES}})
        plan["lm_head"] = matrix("lm_head", model.lm_head)
    except TypeError as exc:
        logger.debug("weights not cached: %s cannot be written", exc)
        return None
    return tensors, plan


def cacheable(model: LlamaForCausalLM) -> bool:
    """Whether :func:`save_in_background` can write this model."""
    return _state(model) is not None


def save(model: LlamaForCausalLM, target: Path) -> bool:
    """Write the model's ready weights to ``target`` (atomically); False where its layouts
    cannot be written or the cache cannot be (logged)."""
    state = _state(model)
    if state is None:
        return False
    tensors, plan = state
    # NOTE: safetensors writes contiguous tensors; packed layouts already are.
    tensors = {k: t if t.is_contiguous() else t.contiguous() for k, t in tensors.items()}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": _FORMAT, "plan": json.dumps(plan)})
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        _prune(target.parent)
    except OSError as exc:
        logger.warning("ready-to-run weights not saved (%s): the next start converts again",
                       exc)
        return False
    return True


def save_in_background(model: LlamaForCausalLM, target: Path) -> threading.Thread | None:
    """:func:`save` on a thread at the lowest CPU priority (not a daemon: the process waits
    for it at exit, so a short command still leaves the file); None where nothing can be
    written."""
    if not cacheable(model):
        return None

    def run() -> None:
        lowest_priority()
        save(model, target)

    thread = threading.Thread(target=run, name="kvloop-save-ready-weights")
    thread.start()
    return thread


def load(cls: type[LlamaForCausalLM], config: ModelConfig, source: Path
         ) -> LlamaForCausalLM | None:
    """The model from its ready file ``source`` (memory-mapped), or None where there is none
    or it cannot be read (logged; the caller converts the checkpoint instead)."""
    if not source.exists():
        return None
    try:
        with safe_open(source, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT:
                return None
            plan = json.loads(meta["plan"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        model = _build(cls, config, tensors, plan)
    except Exception as exc:  # NOTE: any unreadable file: convert again, and overwrite it
        logger.warning("ready-to-run weights in %s unreadable (%s): converting again",
                       source, exc)
        return None
    os.utime(source)  # NOTE: recently used (:func:`_prune`)
    return model


def _build(cls: type[LlamaForCausalLM], config: ModelConfig, tensors: dict[str, Tensor],
           plan: dict[str, Any]) -> LlamaForCausalLM:
    def get(ref: dict[str, Any]) -> Any:
        if "value" in ref:
            return ref["value"]
        return tensors[ref["tensor"] if "tensor" in ref else ref["alias"]]

    def matrix(spec: dict[str, Any]) -> Any:
        lin = LAYOUTS[spec["layout"]].__new__(LAYOUTS[spec["layout"]])
        for attr, ref in spec["fields"].items():
            setattr(lin, attr, get(ref))
        return lin

    if len(plan["layers"]) != config.num_layers:
        raise ValueError(f"{len(plan['layers'])} layers, the config has {config.num_layers}")
    layers = [DecoderLayer(input_norm=get(spec["input_norm"]), post_norm=get(spec["post_norm"]),
                           **{n: get(spec[n]) for n in _OPTIONAL_NORMS},
                           **{m: matrix(spec[m]) for m in _MATRICES})
              for spec in plan["layers"]]
    return cls(config, get(plan["embed"]), layers, get(plan["norm"]), matrix(plan["lm_head"]))


def _prune(folder: Path) -> None:
    """Keep the :data:`KEEP` most recently used ready files; remove temporary files of
    interrupted saves older than an hour."""
    import time

    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime,
                   reverse=True)
    for old in files[KEEP:]:
        old.unlink(missing_ok=True)
    for tmp in folder.glob(".tmp-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            tmp.unlink(missing_ok=True)
