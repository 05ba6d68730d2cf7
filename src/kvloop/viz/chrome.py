"""Chrome trace-event JSON from step records (opens in Perfetto and chrome://tracing).

Layout (one process, ``pid`` 1):

- tid 0, "engine steps": one complete event ("X") per step, args with its token count,
  batch make-up, KV use and queue lengths;
- tid 1..N, one track per request in order of appearance: a "waiting" span from arrival
  (or a recompute preemption) to the step that runs it, one "X" event per step it ran
  (named prefill / recompute / decode, args with tokens), a "swapped" span while it sits
  in host memory, and instant events ("i") for arrival, preemption, swap-in and finish;
- counters ("C"): KV blocks used (and the pool), queue lengths, tokens per step.

Timestamps are microseconds since the trace's first arrival (or first step, if earlier):
a step spans ``time_s`` to ``end_time_s`` (``step_time_s`` when the clock did not move, as
in a stalled step), less that origin; ``otherData.origin_s`` is the origin on the record
clock.
"""

from __future__ import annotations

import json
from typing import Any

from kvloop.core.stats import StepRecord

__all__ = ["ENGINE_TID", "PID", "chrome_trace", "trace_origin", "write_chrome_trace"]

PID = 1
ENGINE_TID = 0
_US = 1e6


def _span(rec: StepRecord, origin: float) -> tuple[float, float]:
    """Start (since ``origin``) and duration of a step in microseconds."""
    dur = rec.end_time_s - rec.time_s
    if dur <= 0:
        dur = rec.step_time_s
    return (rec.time_s - origin) * _US, max(dur, 0.0) * _US


def trace_origin(records: list[StepRecord]) -> float:
    """Time zero of a trace on its record clock: the first arrival, or the first step if it
    started earlier (a trace that missed the arrivals)."""
    if not records:
        return 0.0
    first = records[0]
    return min([first.time_s, *(float(a) for _, a, _ in first.arrived)])


class _Builder:
    """Accumulates events; one track per request, created on first sight."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": "kvloop"}},
            {"ph": "M", "pid": PID, "tid": ENGINE_TID, "name": "thread_name",
             "args": {"name": "engine steps"}},
            {"ph": "M", "pid": PID, "tid": ENGINE_TID, "name": "thread_sort_index",
             "args": {"sort_index": 0}},
        ]
        self.tids: dict[str, int] = {}
        self.open_span: dict[str, tuple[str, float]] = {}
        """Request id -> (name, start µs) of its open waiting/swapped span."""

    def tid(self, rid: str) -> int:
        tid = self.tids.get(rid)
        if tid is None:
            tid = self.tids[rid] = len(self.tids) + 1
            self.events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name",
                                "args": {"name": rid}})
            self.events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                                "args": {"sort_index": tid}})
        return tid

    def instant(self, rid: str, name: str, ts: float, **args: Any) -> None:
        self.events.append({"ph": "i", "s": "t", "pid": PID, "tid": self.tid(rid),
                            "name": name, "ts": ts, "args": args})

    def complete(self, tid: int, name: str, ts: float, dur: float, **args: Any) -> None:
        self.events.append({"ph": "X", "pid": PID, "tid": tid, "name": name, "ts": ts,
                            "dur": dur, "args": args})

    def open(self, rid: str, name: str, ts: float) -> None:
        self.close(rid, ts)
        self.open_span[rid] = (name, ts)

    def close(self, rid: str, ts: float) -> None:
        span = self.open_span.pop(rid, None)
        if span is not None:
            name, start = span
            self.complete(self.tid(rid), name, start, max(ts - start, 0.0))

    def counter(self, name: str, ts: float, **values: float) -> None:
        self.events.append({"ph": "C", "pid": PID, "name": name, "ts": ts, "args": values})


def chrome_trace(records: list[StepRecord]) -> dict[str, Any]:
    """The trace-event document for ``records`` (a dict ready for ``json.dump``)."""
    b = _Builder()
    origin = trace_origin(records)
    for rec in records:
        ts, dur = _span(rec, origin)
        end = ts + dur
        for rid, arrival, n_prompt in rec.arrived:
            t = (float(arrival) - origin) * _US
            b.instant(rid, "arrived", t, prompt_tokens=n_prompt)
            b.open(rid, "waiting", t)
        for rid, mode in rec.preempted:
            b.close(rid, ts)
            name = "swapped out" if mode == "swap" else "preempted (recompute)"
            b.instant(rid, name, ts, mode=mode)
            b.open(rid, "swapped" if mode == "swap" else "waiting", ts)
        for rid in rec.swapped_in:
            b.close(rid, ts)
            b.instant(rid, "swapped in", ts)
        kinds: dict[str, int] = {}
        for e in rec.scheduled:
            b.close(e.request_id, ts)
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
            b.complete(b.tid(e.request_id), e.kind, ts, dur, step=rec.step,
                       tokens=e.num_tokens, context=e.num_computed_tokens)
        for rid, reason in rec.finished:
            b.close(rid, end)
            b.instant(rid, "finished", end, reason=reason)
        b.complete(
            ENGINE_TID, f"step {rec.step}", ts, dur,
            tokens=rec.num_batched_tokens, token_budget=rec.token_budget,
            num_scheduled=len(rec.scheduled), **{f"num_{k}": v for k, v in kinds.items()},
            num_running=rec.num_running, num_waiting=rec.num_waiting,
            num_swapped=rec.num_swapped, kv_blocks_used=rec.kv_blocks_used,
            num_preempted=len(rec.preempted), num_finished=len(rec.finished),
            step_time_ms=rec.step_time_s * 1e3,
        )
        b.counter("KV blocks", end, used=rec.kv_blocks_used, pool=rec.num_gpu_blocks)
        b.counter("queues", end, running=rec.num_running, waiting=rec.num_waiting,
                  swapped=rec.num_swapped)
        b.counter("tokens per step", ts, tokens=rec.num_batched_tokens,
                  budget=rec.token_budget)
    if records:  # spans still open at the end of the trace run to its last step
        last = _span(records[-1], origin)
        for rid in list(b.open_span):
            b.close(rid, last[0] + last[1])
    return {
        "traceEvents": b.events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "kvloop step trace", "num_steps": len(records),
                      "num_requests": len(b.tids), "origin_s": origin},
    }


def write_chrome_trace(records: list[StepRecord], path: str) -> dict[str, Any]:
    """Write the trace-event JSON to ``path``; return the document."""
    doc = chrome_trace(records)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return doc
