"""All-reduce time for tensor parallelism, from measured tables by message size and workers.

Pure stdlib. ``data/network.json`` holds median all-reduce times condensed from Vidur's
public NCCL profiles (``benchmarks/fit_cost_model.py`` writes it): one table per
interconnect (``nvlink3``: A100 DGX, ``nvlink4``: H100 DGX, ``pcie4`` and ``pcie5``: GPUs
talking over PCIe, measured on NVLink-pair machines where a 4-GPU ring crosses PCIe) and
worker count. Times between measured sizes are interpolated log-log; sizes outside the
table extrapolate linearly in bytes from its last two points (bandwidth-bound) or keep its
first time (latency-bound). A worker count with no table is scaled from the nearest one by
the ring all-reduce's traffic factor 2(n−1)/n.
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
        if times[i - 1] == times[i]:
            return times[i]
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        y0, y1 = math.log(times[i - 1]), math.log(times[i])
        return math.exp(y0 + (y1 - y0) * (math.log(size) - x0) / (x1 - x0))


def _ring(n: int) -> float:
    return 2 * (n - 1) / n


@dataclass(frozen=True)
class AllReduceModel:
    """All-reduce time of one interconnect at a worker count (a table, scaled if needed)."""

    table: AllReduceTable
    num_workers: int

    def time(self, size: float) -> float:
        """Seconds; bandwidth-bound traffic scales by the ring factor when the table was
        measured at another worker count (its first entry, the latency floor, does not)."""
        base = self.table.time(size)
        if self.num_workers == self.table.num_workers:
            return base
        floor = self.table.times_s[0]
        scale = _ring(self.num_workers) / _ring(self.table.num_workers)
        return floor + max(base - floor, 0.0) * scale


@cache
def _tables() -> dict[str, Any]:
    path = resources.files("kvloop.executor.simulated").joinpath("data/network.json")
    return json.loads(path.read_text(encoding="utf-8"))


def interconnects() -> list[str]:
    """Names of the shipped interconnect tables."""
    return sorted(_tables()["interconnects"])


def allreduce_model(interconnect: str, num_workers: int) -> AllReduceModel:
    """The shipped table of ``interconnect`` closest to ``num_workers`` (see the module
    docstring); ValueError for an unknown interconnect."""
    data = _tables()["interconnects"]
    if interconnect not in data:
        raise ValueError(
            f"unknown interconnect '{interconnect}': one of {', '.join(sorted(data))}"
        )
    by_n = {int(n): t for n, t in data[interconnect]["tables"].items()}
    n = min(by_n, key=lambda k: (abs(k - num_workers), -k))
    rows = by_n[n]
    table = AllReduceTable(
        interconnect, n, tuple(int(s) for s, _ in rows), tuple(float(t) for _, t in rows)
    )
    return AllReduceModel(table, num_workers)
