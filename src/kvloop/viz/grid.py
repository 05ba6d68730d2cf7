"""The timeline's data: which request did what in each step, rebuilt from step records.

:func:`select_window` picks the steps and requests to show; :func:`build_grid` replays the
records into an integer matrix of :class:`Cell` values (drawn by ``viz.timeline``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import numpy as np

from kvloop.core.stats import StepRecord
from kvloop.viz.chrome import trace_origin
from kvloop.viz.slo import RowInfo, row_infos, row_suffix

__all__ = [
    "LEGEND",
    "MAX_REQUESTS",
    "MAX_STEPS",
    "Cell",
    "TimelineGrid",
    "Window",
    "build_grid",
    "id_prefix",
    "parse_requests",
    "parse_steps",
    "select_window",
    "short_ids",
]

MAX_STEPS = 500
"""Most steps one picture shows before the trace is windowed."""
MAX_REQUESTS = 100
"""Most requests (rows) one picture shows before the trace is windowed."""
SHORT_ID = 10
"""Characters of a request id kept on the picture (more only where needed to tell apart)."""


class Cell(enum.IntEnum):
    """What a request did in one step: the value of a grid cell."""

    NONE = 0
    WAITING = 1
    IDLE = 2
    PREFILL = 3
    RECOMPUTE = 4
    DECODE = 5
    PREEMPTED = 6
    SWAPPED = 7
    FINISHED = 8


LEGEND: dict[Cell, tuple[str, str]] = {
    Cell.NONE: ("not arrived / done", "#ffffff"),
    Cell.WAITING: ("waiting", "#f2df8c"),
    Cell.IDLE: ("running, not scheduled", "#c8c8c8"),
    Cell.PREFILL: ("prefill chunk", "#1f5fb4"),
    Cell.RECOMPUTE: ("recompute (re-prefill)", "#ff8c1a"),
    Cell.DECODE: ("decode", "#2ca02c"),
    Cell.PREEMPTED: ("preempted (recompute)", "#d62728"),
    Cell.SWAPPED: ("swapped out", "#9467bd"),
    Cell.FINISHED: ("finished", "#000000"),
}
"""Label and colour of each cell value (index = value, for the ListedColormap)."""

_KIND = {"prefill": Cell.PREFILL, "recompute": Cell.RECOMPUTE, "decode": Cell.DECODE}
_IDLE_BY_STATE = {"waiting": Cell.WAITING, "running": Cell.IDLE, "swapped": Cell.SWAPPED}


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """Parse ``A:B`` (either side may be empty) into a half-open step window."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"--steps must look like A:B (e.g. 100:400), got {text!r}")
    try:
        a, b = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise ValueError(f"--steps bounds must be integers, got {text!r}") from None
    if (a is not None and a < 0) or (a is not None and b is not None and b <= a):
        raise ValueError(f"--steps needs 0 <= A < B, got {text!r}")
    return a, b


def parse_requests(text: str) -> list[str] | int:
    """Parse ``--requests``: a count N (the first N active requests) or ``ID,ID,...``."""
    text = text.strip()
    if text.isdigit():
        if int(text) == 0:
            raise ValueError("--requests N needs N >= 1")
        return int(text)
    ids = [t.strip() for t in text.split(",") if t.strip()]
    if not ids:
        raise ValueError("--requests needs a count or a comma-separated list of request ids")
    return ids


def id_prefix(ids: list[str]) -> str:
    """The prefix all ``ids`` share, up to and including its last separator (``cmpl-``,
    ``azure-conv-``); empty when there is none."""
    if not ids:
        return ""
    common = ids[0]
    for rid in ids[1:]:
        while not rid.startswith(common):
            common = common[:-1]
    seps = [m.end() for m in re.finditer(r"[-_:./]", common)]
    drop = seps[-1] if seps else 0
    return common[:drop] if all(len(rid) > drop for rid in ids) else ""


def short_ids(ids: list[str], keep: int = SHORT_ID) -> list[str]:
    """Short, still distinct, labels for request ids.

    The shared prefix (:func:`id_prefix`) is dropped, then each id longer than ``keep``
    characters is cut to ``keep`` with a trailing ``…``; where two cut ids collide more
    characters are kept.
    """
    if not ids:
        return []
    drop = len(id_prefix(ids))
    rest = [rid[drop:] for rid in ids]
    n = keep
    while True:
        out = [r if len(r) <= n + 1 else r[:n] + "…" for r in rest]
        if len(set(out)) == len(set(rest)) or n >= max(map(len, rest)):
            return out
        n += 2


@dataclass
class TimelineGrid:
    """The category matrix of a window of the trace, ready to draw."""

    request_ids: list[str]
    """Row labels, top to bottom (arrival order)."""
    records: list[StepRecord]
    """The window's records, one per column."""
    cells: np.ndarray
    """``Cell`` values, shape (rows, columns)."""
    tokens: np.ndarray
    """Tokens each request computed in each step (0 when it did not run)."""
    total_steps: int
    total_requests: int
    numbers: list[int] = field(default_factory=list)
    """Row numbers: each request's place in the order the trace first saw them (from 1),
    the same in every window of one trace."""
    arrivals: list[float | None] = field(default_factory=list)
    """Each row's arrival time on the record clock, when the trace recorded it."""
    t0: float = 0.0
    """The trace's first arrival (or first step start, if earlier) on the record clock:
    time zero of the picture."""
    infos: list[RowInfo] = field(default_factory=list)
    """Each row's tenant, priority and TTFT deadline (``viz.slo``); empty: none known."""

    @property
    def steps(self) -> list[int]:
        return [r.step for r in self.records]

    @property
    def ids_cut(self) -> bool:
        """Whether row labels cut request ids short (then they carry row numbers)."""
        return any(s.endswith("…") for s in short_ids(self.request_ids))

    def labels(self) -> list[str]:
        """Row labels: the request ids less their shared prefix (:func:`id_prefix`); where
        ids are long, the row number and a short id (:func:`short_ids`; ``kvloop trace plot``
        writes the full ids by number)."""
        short = short_ids(self.request_ids)
        if self.ids_cut:
            width = len(str(max(self.numbers, default=0)))
            short = [f"{n:>{width}} {s}" for n, s in zip(self.numbers, short, strict=True)]
        suffixes = self.suffixes()
        if not any(suffixes):
            return short
        # NOTE: ids padded to one width, so the tenants line up in a column.
        width = max(map(len, short), default=0)
        return [f"{s:<{width}} {x}".rstrip() for s, x in zip(short, suffixes, strict=True)]

    def suffixes(self) -> list[str]:
        """Each row's tenant and non-zero priority (``viz.slo.row_suffix``)."""
        return [row_suffix(i) for i in self.infos] if self.infos else [""] * len(self.request_ids)

    def label_title(self) -> str:
        """The y axis title: what the row labels are."""
        prefix = id_prefix(self.request_ids)
        what = "request (row, id" if self.ids_cut else "request (id"
        what += f" after {prefix!r}" if prefix else ""
        if any(self.suffixes()):
            what += "; tenant, p = priority"
        return what + ")"


def _lifespans(records: list[StepRecord]) -> dict[str, tuple[int, int]]:
    """Record index of each request's arrival (or first sighting) and finish (or end)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, rec in enumerate(records):
        for rid, *_ in rec.arrived:
            first.setdefault(rid, i)
        for e in rec.scheduled:
            first.setdefault(e.request_id, i)
        for rid, _ in rec.finished:
            last[rid] = i
    end = len(records) - 1
    return {rid: (i, last.get(rid, end)) for rid, i in first.items()}


@dataclass
class Window:
    """Which part of a trace to draw: record indices ``[lo, hi)`` and the rows."""

    lo: int
    hi: int
    request_ids: list[str]
    notes: list[str]
    """Why the picture shows less than the trace, and how to choose another window."""
    total_requests: int
    numbers: list[int] = field(default_factory=list)
    """Each row's place in the order the trace first saw its request (from 1)."""


def select_window(
    records: list[StepRecord],
    steps: tuple[int | None, int | None] | None = None,
    requests: list[str] | int | None = None,
) -> Window:
    """Choose the steps and requests to draw.

    ``steps`` is a half-open window of step numbers; ``requests`` a list of ids or a count
    (the first N requests active in the steps). Without a window at most ``MAX_STEPS``
    steps and ``MAX_REQUESTS`` requests are kept, and the notes say so.
    """
    spans = _lifespans(records)
    notes: list[str] = []
    numbers = [r.step for r in records]
    if isinstance(requests, list):
        missing = [rid for rid in requests if rid not in spans]
        if missing:
            raise ValueError(f"requests not in the trace: {', '.join(missing[:5])}")
    if steps is not None:
        a, b = steps
        lo = next((i for i, s in enumerate(numbers) if a is None or s >= a), len(records))
        hi = next((i for i, s in enumerate(numbers) if b is not None and s >= b), len(records))
        if lo >= hi:
            raise ValueError(
                f"--steps {a}:{b} selects no step; the trace has steps {numbers[0]}..{numbers[-1]}"
            )
    elif isinstance(requests, list):
        lo = min(spans[rid][0] for rid in requests)
        hi = max(spans[rid][1] for rid in requests) + 1
    else:
        lo, hi = 0, len(records)
    if steps is None and hi - lo > MAX_STEPS:
        hi = lo + MAX_STEPS
        notes.append(f"plotted steps {numbers[lo]}:{numbers[hi - 1] + 1} of {len(records)}")
    if isinstance(requests, list):
        ids = list(dict.fromkeys(requests))
    else:
        active = [rid for rid, (a, b) in spans.items() if a < hi and b >= lo]
        limit = requests if isinstance(requests, int) else MAX_REQUESTS
        if len(active) > limit and requests is None:
            notes.append(f"plotted the first {limit} of {len(active)} requests active there")
        ids = active[:limit]
    if notes:
        notes.append("choose a window with --steps A:B and --requests N or ID,ID,...")
    order = {rid: k for k, rid in enumerate(spans, 1)}
    return Window(lo, hi, ids, notes, len(spans), [order[rid] for rid in ids])


def build_grid(records: list[StepRecord], window: Window) -> TimelineGrid:
    """Replay records up to the window's end to colour its cells.

    NOTE: state carries across steps (waiting, running, swapped, finished); events of a step
    (preemption, scheduling, finishing) colour that step's cell and take precedence, and a
    prefill after a recompute preemption counts as recompute until the request samples.
    """
    lo, hi, ids = window.lo, window.hi, window.request_ids
    row = {rid: i for i, rid in enumerate(ids)}
    cells = np.zeros((len(ids), hi - lo), dtype=np.int8)
    tokens = np.zeros((len(ids), hi - lo), dtype=np.int32)
    state: dict[str, str] = {}
    redo: set[str] = set()
    arrivals: list[float | None] = [None] * len(ids)
    for i in range(hi):
        rec = records[i]
        col = i - lo
        marked: dict[str, Cell] = {}
        for rid, arrival, _ in rec.arrived:
            if rid in row:
                state[rid] = "waiting"
                arrivals[row[rid]] = float(arrival)
        for rid, mode in rec.preempted:
            if rid in row:
                swap = mode == "swap"
                state[rid] = "swapped" if swap else "waiting"
                marked[rid] = Cell.SWAPPED if swap else Cell.PREEMPTED
                if not swap:
                    redo.add(rid)
        for rid in rec.swapped_in:
            if rid in row:
                state[rid] = "running"
        for e in rec.scheduled:
            rid = e.request_id
            if rid in row:
                state[rid] = "running"
                kind = _KIND.get(e.kind, Cell.PREFILL)
                marked[rid] = Cell.RECOMPUTE if kind == Cell.PREFILL and rid in redo else kind
                if col >= 0:
                    tokens[row[rid], col] = e.num_tokens
        redo.difference_update(rec.sampled)
        for rid, _ in rec.finished:
            if rid in row:
                state[rid] = "finished"
                marked[rid] = Cell.FINISHED
        if col < 0:
            continue
        for rid, r in row.items():
            value = marked.get(rid)
            if value is None:
                value = _IDLE_BY_STATE.get(state.get(rid, ""), Cell.NONE)
            cells[r, col] = value
    t0 = trace_origin(records)
    numbers = window.numbers or list(range(1, len(ids) + 1))
    return TimelineGrid(ids, records[lo:hi], cells, tokens, len(records), window.total_requests,
                        numbers, arrivals, t0, row_infos(records, ids))
