"""All-reduce time for tensor parallelism, from measured tables by message size and workers.

Pure stdlib. Three kinds of measurement, all by message size and worker count:

* ``data/network.json``: median NCCL all-reduce times condensed from Vidur's public profiles
  (``benchmarks/fit_cost_model.py`` writes it): one table per interconnect (``nvlink3``:
  A100 DGX, ``nvlink4``: H100 DGX, ``pcie4`` and ``pcie5``: GPUs talking over PCIe, measured
  on NVLink-pair machines where a 4-GPU ring crosses PCIe). Measured through
  ``torch.distributed`` outside CUDA graphs, so their small messages carry a launch.
* ``data/custom_allreduce.json``: vLLM's own custom peer-to-peer all-reduce over NVLink,
  for messages up to 8 MiB (published H100 figures at 2, 4 and 8 GPUs, measured outside
  CUDA graphs, their input copied into the peers' buffer).
* ``data/fused_allreduce.json``: FlashInfer's one-shot all-reduce fused with the residual
  add and RMSNorm, which vLLM runs inside its CUDA graphs on Hopper (``nvlink4``) with one
  data-parallel rank, for messages up to a limit per GPU count (published in-graph H100
  figures at 2 GPUs). A one-shot all-reduce has each GPU read every peer's message, so at n
  GPUs its bandwidth-bound part is (n−1) times that at 2.

A step pays the fastest path that takes the message, as vLLM picks one.

Times between measured sizes are interpolated log-log; sizes outside a table extrapolate
linearly in bytes from its last two points (bandwidth-bound) or keep its first time
(latency-bound). A worker count with no table is scaled from the nearest one by the ring
all-reduce's traffic factor 2(n−1)/n. An interconnect with no measurement of its own
(``DERIVED``) takes another's tables with the bandwidth-bound part (time above the table's
first, latency-bound entry) scaled by the ratio of their link bandwidths.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class AllReduceTable:
    """Measured all-reduce times of one interconnect and worker count."""

    interconnect: str
    num_workers: int
    sizes: tuple[int, ...]
    """Message sizes in bytes, ascending."""
    times_s: tuple[float, ...]
    """Median seconds of one all-reduce of each size."""

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.times_s):
            raise ValueError(f"{self.interconnect}: an all-reduce table needs >= 2 (size, time)")
        if list(self.sizes) != sorted(set(self.sizes)) or min(self.sizes) <= 0:
            raise ValueError(f"{self.interconnect}: sizes must be positive and ascending")
        if min(self.times_s) <= 0 or not all(map(math.isfinite, self.times_s)):
            raise ValueError(f"{self.interconnect}: times must be positive")

    def time(self, size: float) -> float:
        """Seconds to all-reduce ``size`` bytes."""
        sizes, times = self.sizes, self.times_s
        if size <= sizes[0]:
            return times[0]
        if size >= sizes[-1]:
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            return times[-1] + max(slope, 0.0) * (size - sizes[-1])
        i = bisect.bisect_right(sizes, size)
        if times[i - 1] == times[i] or size == sizes[i - 1]:
            return times[i - 1]
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        y0, y1 = math.log(times[i - 1]), math.log(times[i])
        return math.exp(y0 + (y1 - y0) * (math.log(size) - x0) / (x1 - x0))


def _ring(n: int) -> float:
    return 2 * (n - 1) / n


DERIVED: dict[str, tuple[str, float]] = {
    # NVLink 3 (A100): 600 GB/s per GPU, both directions; NVLink 4 (H100) 900 GB/s.
    "nvlink3": ("nvlink4", 900 / 600),
    # NVLink 5 (B200): 1.8 TB/s per GPU, both directions.
    "nvlink5": ("nvlink4", 900 / 1800),
}
"""Interconnect -> (the one whose tables stand in, scale of their bandwidth-bound part),
for the tables an interconnect lacks (nvlink3 has NCCL tables of its own, no custom ones)."""


def _scaled(table: AllReduceTable, size: float, scale: float) -> float:
    """``table`` at ``size``, its bandwidth-bound part (above the first, latency-bound
    entry) times ``scale``."""
    base = table.time(size)
    if scale == 1.0:
        return base
    floor = table.times_s[0]
    return floor + max(base - floor, 0.0) * scale


def _ring_scaled(table: AllReduceTable, size: float, workers: int, bw_scale: float) -> float:
    """``table`` at ``size`` for ``workers``: its bandwidth-bound part scaled by the ring
    factor of ``workers`` against the table's and by ``bw_scale``."""
    return _scaled(table, size, bw_scale * _ring(workers) / _ring(table.num_workers))


@dataclass(frozen=True)
class AllReduceModel:
    """All-reduce time of one interconnect at a worker count: the NCCL table, or the custom
    or the fused all-reduce's where it takes the message and is faster (the module
    docstring)."""

    table: AllReduceTable
    num_workers: int
    custom: AllReduceTable | None = None
    """The custom all-reduce's table (None: NCCL only)."""
    custom_max_bytes: int = 0
    """Largest message the custom all-reduce takes."""
    bw_scale: float = 1.0
    """Scale of the NCCL table's bandwidth-bound part (a derived interconnect)."""
    custom_bw_scale: float = 1.0
    """Scale of the custom table's bandwidth-bound part."""
    fused: AllReduceTable | None = None
    """The fused in-graph all-reduce's table (None: not on this interconnect, or off)."""
    fused_max_bytes: int = 0
    """Largest message the fused all-reduce takes at this worker count."""

    def time(self, size: float) -> float:
        """Seconds to all-reduce ``size`` bytes."""
        n = self.num_workers
        t = _ring_scaled(self.table, size, n, self.bw_scale)
        if self.custom is not None and size <= self.custom_max_bytes:
            t = min(t, _ring_scaled(self.custom, size, n, self.custom_bw_scale))
        if self.fused is not None and size <= self.fused_max_bytes:
            # NOTE: one-shot: each GPU reads the n−1 peers' messages
            t = min(t, _scaled(self.fused, size, (n - 1) / (self.fused.num_workers - 1)))
        return t


@cache
def _data(name: str) -> dict[str, Any]:
    path = resources.files("kvloop.executor.simulated").joinpath(f"data/{name}")
    return json.loads(path.read_text(encoding="utf-8"))


def interconnects() -> list[str]:
    """Names of the interconnects the simulator knows (measured or derived)."""
    return sorted({*_data("network.json")["interconnects"], *DERIVED})


def _nearest(name: str, by_n: dict[str, Any], num_workers: int) -> AllReduceTable:
    """The table of ``by_n`` nearest ``num_workers``, made monotone: a larger message never
    costs less (a measured dip, e.g. 4 KiB below 512 B, is noise)."""
    tables = {int(n): rows for n, rows in by_n.items()}
    n = min(tables, key=lambda k: (abs(k - num_workers), -k))
    times, last = [], 0.0
    for _, t in tables[n]:
        last = max(last, float(t))
        times.append(last)
    return AllReduceTable(name, n, tuple(int(s) for s, _ in tables[n]), tuple(times))


def allreduce_model(interconnect: str, num_workers: int, *, fused: bool = True) -> AllReduceModel:
    """The model of ``interconnect`` at ``num_workers`` from the shipped tables nearest in
    worker count (see the module docstring); ``fused=False`` leaves the fused all-reduce out
    (vLLM does not fuse with several data-parallel ranks; an all-to-all is not an
    all-reduce). ValueError for an unknown interconnect."""
    nccl = _data("network.json")["interconnects"]
    custom = _data("custom_allreduce.json")
    base, scale = DERIVED.get(interconnect, (interconnect, 1.0))
    own_nccl = interconnect in nccl
    if not own_nccl and base not in nccl:
        raise ValueError(
            f"unknown interconnect '{interconnect}': one of {', '.join(interconnects())}")
    table = _nearest(interconnect, nccl[interconnect if own_nccl else base]["tables"],
                     num_workers)
    own_custom = interconnect in custom["interconnects"]
    custom_name = interconnect if own_custom else base
    small = None
    if custom_name in custom["interconnects"]:
        small = _nearest(custom_name, custom["interconnects"][custom_name], num_workers)
    fused_data = _data("fused_allreduce.json")
    fused_max = int(fused_data["max_bytes"].get(str(num_workers), 0))
    in_graph = None
    if fused and fused_max and interconnect in fused_data["interconnects"]:
        by_n = fused_data["interconnects"][interconnect]
        in_graph = _nearest(interconnect, by_n, min(int(k) for k in by_n))
    return AllReduceModel(table, num_workers, small, int(custom["max_bytes"]),
                          bw_scale=1.0 if own_nccl else scale,
                          custom_bw_scale=1.0 if own_custom else scale,
                          fused=in_graph, fused_max_bytes=fused_max if in_graph else 0)
