"""A calibration file: what ``kvloop profile`` measured on one device, for one model.

Pure stdlib (the measuring lives in ``kvloop.executor.torch.profiler``). ``kvloop simulate
--calibration FILE`` costs steps with it instead of a GPU preset: for the profiled model
its measured tables (per-token and per-request work at each measured count, interpolated
between them), for any other model the device curves fitted to the same measurements.

The JSON holds ``kvloop_calibration`` (the format version), where and when it was measured,
the model's shapes, the device as a hardware spec whose peaks are the best rates measured
on it (so every fitted fraction is <= 1) with its fitted efficiencies, the engine overhead,
the tables, the KV-cache geometry, and the raw measurements for reference.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvloop.executor.simulated.cost_model import CostModel
from kvloop.executor.simulated.efficiency import EngineOverhead
from kvloop.executor.simulated.specs import (
    HardwareSpec,
    ModelSpec,
    hardware_spec_from_dict,
    read_json,
)
from kvloop.executor.simulated.tables import StepTables

FORMAT_VERSION = 1


@dataclass
class Measurements:
    """Raw timings in seconds of ``kvloop profile`` (see ``kvloop.executor.torch.profiler``)."""

    device: str
    """The torch device measured."""
    device_name: str
    """The processor or GPU by name."""
    dtype: str
    """Weight and KV dtype."""
    bandwidth: float
    """Best bytes/s of a large streaming copy (read + write counted)."""
    token_work: list[tuple[int, float]] = field(default_factory=list)
    """(T, s): per-token work at T tokens."""
    gemms: list[tuple[int, float, float, float]] = field(default_factory=list)
    """(T, flops, bytes, s) of one projection GEMM at T tokens (per-layer average)."""
    seq_work: list[tuple[int, float]] = field(default_factory=list)
    """(S, s): final norm + LM head + sampling."""
    decode_attention: list[tuple[int, int, float]] = field(default_factory=list)
    """(requests, Σ contexts, s) of decode attention over all layers."""
    prefill_attention: list[tuple[int, int, float]] = field(default_factory=list)
    """(c, p, s) of one prefill chunk's attention over all layers."""
    runner_steps: list[dict[str, Any]] = field(default_factory=list)
    """{"decodes", "decode_context", "chunks", "s"} of whole runner steps."""
    engine_loop: list[tuple[int, float]] = field(default_factory=list)
    """(S, s): one engine step over a null executor with S decodes."""


@dataclass(frozen=True)
class Calibration:
    """One device and model as ``kvloop profile`` measured them."""

    device: str
    """The torch device measured (``cpu``, ``cuda:0``)."""
    device_name: str
    """The processor or GPU by name, with threads for a CPU."""
    dtype: str
    """Weight and KV dtype of the profiled runner."""
    created: str
    """When it was measured (ISO 8601)."""
    model: ModelSpec
    """Shapes of the profiled model."""
    hardware: HardwareSpec
    """The device: best measured rates as peaks, fitted efficiencies as its profile."""
    overhead: EngineOverhead
    """The engine's per-step cost beyond the model: runner bookkeeping and the loop."""
    tables: StepTables
    """Measured per-token and per-request work of the profiled model."""
    block_size: int
    """KV block size of the profiled runner."""
    num_gpu_blocks: int
    """KV blocks the profiled runner would have with its default memory budget."""
    measurements: dict[str, Any] = field(default_factory=dict)
    """Raw timings (kept for reference and plots; not read by the simulator)."""

    def matches(self, model: ModelSpec) -> bool:
        """True when ``model`` has the profiled model's shapes (its tables apply)."""
        keys = [f.name for f in fields(ModelSpec) if f.name not in ("name",
                                                                    "max_position_embeddings")]
        return all(getattr(model, k) == getattr(self.model, k) for k in keys)

    def cost_model(
        self, model: ModelSpec | None = None, tp: int = 1, overhead: EngineOverhead | None = None
    ) -> CostModel:
        """A cost model for ``model`` (default: the profiled one) on the profiled device:
        the measured tables when they apply, else the fitted curves; the measured engine
        overhead unless another is given."""
        model = model if model is not None else self.model
        tables = self.tables if self.matches(model) and tp == 1 else None
        return CostModel(model, self.hardware, tp=tp,
                         overhead=overhead if overhead is not None else self.overhead,
                         tables=tables)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"kvloop_calibration": FORMAT_VERSION, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: Any, where: str = "calibration") -> Calibration:
        """Validate and build; any problem is one ValueError naming ``where``."""
        if not isinstance(d, dict) or "kvloop_calibration" not in d:
            raise ValueError(
                f"{where}: not a kvloop calibration file (format {FORMAT_VERSION}); make one "
                "with `kvloop profile`"
            )
        if d["kvloop_calibration"] != FORMAT_VERSION:
            raise ValueError(
                f"{where}: calibration format {d['kvloop_calibration']!r}; this kvloop reads "
                f"format {FORMAT_VERSION}: profile again with `kvloop profile`"
            )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"kvloop_calibration"})
        missing = sorted(names - {"measurements"} - set(d))
        if unknown or missing:
            what = "unknown" if unknown else "missing"
            raise ValueError(f"{where}: {what} key(s) {', '.join(unknown or missing)}")
        try:
            tables = d["tables"]
            if not isinstance(tables, dict):
                raise ValueError("'tables' must be an object")
            model = d["model"]
            if not isinstance(model, dict):
                raise ValueError("'model' must be an object")
            overhead = d["overhead"]
            if not isinstance(overhead, dict):
                raise ValueError("'overhead' must be an object")
            cal = cls(
                device=str(d["device"]),
                device_name=str(d["device_name"]),
                dtype=str(d["dtype"]),
                created=str(d["created"]),
                model=ModelSpec(**model),
                hardware=hardware_spec_from_dict(d["hardware"], "hardware"),
                overhead=EngineOverhead(**overhead),
                tables=StepTables(**{k: tuple(v) for k, v in tables.items()}),
                block_size=_count(d, "block_size"),
                num_gpu_blocks=_count(d, "num_gpu_blocks"),
                measurements=dict(d.get("measurements") or {}),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        if cal.block_size < 1 or cal.num_gpu_blocks < 1:
            raise ValueError(f"{where}: block_size and num_gpu_blocks must be >= 1")
        return cal

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_dict(read_json(path, "calibration"), str(path))


def _count(d: dict[str, Any], key: str) -> int:
    """``d[key]`` as a whole number; a ValueError naming ``key`` otherwise."""
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"'{key}' must be a whole number, got {value!r}")
    return int(value)
