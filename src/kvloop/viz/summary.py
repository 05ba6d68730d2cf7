"""Metrics from a step trace: the ``kvloop simulate`` table for any recorded run.

Each request's life is rebuilt from the step records alone (``arrived``, ``scheduled``,
``preempted``, ``sampled``, ``finished``) into a light object that
:func:`kvloop.sim.metrics.summarize_requests` accepts, so a real run and a simulated one are
measured by the very same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvloop.core.stats import StepRecord
from kvloop.sim.load import load_summary
from kvloop.sim.metrics import summarize_requests

__all__ = [
    "TraceRequest",
    "load_records",
    "reconstruct_requests",
    "scheduler_totals",
    "summarize_trace",
]

_STATUS_BY_REASON = {
    "stop": "FINISHED_STOPPED",
    "length": "FINISHED_LENGTH",
    "abort": "FINISHED_ABORTED",
    "error": "FINISHED_ERROR",
    "rejected": "FINISHED_REJECTED",
}


def load_records(path: str) -> list[StepRecord]:
    """Read a JSONL step trace; any malformed line is a ``ValueError`` naming its line.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file that is not
    a step trace or holds no records.
    """
    records: list[StepRecord] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(StepRecord.from_dict(json.loads(line)))
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    raise ValueError(
                        f"{path}: line {lineno} is not a step record ({type(exc).__name__}: "
                        f"{str(exc)[:80]})"
                    ) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"trace file not found: {path}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text JSONL step trace") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ValueError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if not records:
        raise ValueError(f"{path}: the trace holds no step records")
    return records


@dataclass(slots=True)
class TraceRequest:
    """One request as the step records saw it (duck-types ``core.request.Request``)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    status: str = "WAITING"
    """``RequestStatus`` name: WAITING until a record says it finished."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    recompute_prefix_hits: int = 0
    finish_reason: str | None = None
    seen_arrival: bool = True
    """False when the trace never recorded its arrival (arrival = first step that saw it)."""
    tenant: str = ""
    """Who sent it (``StepRecord.arrived_info``; empty: none recorded)."""
    priority: int = 0
    slo_ttft: float | None = None
    """Its TTFT target in seconds as the scheduler saw it (its own, or the default)."""
    slo_tpot: float | None = None

    @property
    def output_token_ids(self) -> range:
        """Placeholder ids: traces keep token times, not token values."""
        return range(len(self.token_times))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)


def reconstruct_requests(records: list[StepRecord]) -> dict[str, TraceRequest]:
    """Rebuild every request's timestamps from the records, in order of appearance.

    NOTE: within one step the scheduler preempts before it schedules (a victim is never
    re-admitted in its own step), tokens are sampled at ``end_time_s`` and one token per
    request listed in ``sampled``; arrivals in a record happened before that step began.
    """
    reqs: dict[str, TraceRequest] = {}
    # Requests preempted by recompute whose re-admission is still to come.
    pending_recompute: set[str] = set()

    def get(rid: str, rec: StepRecord) -> TraceRequest:
        r = reqs.get(rid)
        if r is None:
            r = reqs[rid] = TraceRequest(rid, rec.time_s, 0, seen_arrival=False)
        return r

    for rec in records:
        info = rec.arrived_info
        for rid, arrival, n_prompt in rec.arrived:
            r = reqs[rid] = TraceRequest(rid, float(arrival), int(n_prompt))
            if info and rid in info:
                _apply_info(r, info[rid])
        for rid, mode in rec.preempted:
            r = get(rid, rec)
            r.num_preemptions += 1
            if r.first_scheduled_time is None:  # admitted and preempted in one step
                r.first_scheduled_time = rec.time_s
            if mode == "recompute":
                pending_recompute.add(rid)
        for e in rec.scheduled:
            r = get(e.request_id, rec)
            if r.first_scheduled_time is None:
                r.first_scheduled_time = rec.time_s
            if e.request_id in pending_recompute:
                # Re-admission: the scheduler counts what it must compute again, as
                # prompt + outputs - 1 (the next token is new work) - prefix-cache hits.
                pending_recompute.discard(e.request_id)
                total = r.num_prompt_tokens + len(r.token_times)
                r.num_recomputed_tokens += max(0, total - 1 - e.num_computed_tokens)
                r.recompute_prefix_hits += e.num_computed_tokens
        end = rec.end_time_s
        for rid in rec.sampled:
            r = get(rid, rec)
            if r.first_token_time is None:
                r.first_token_time = end
            r.token_times.append(end)
        for rid, reason in rec.finished:
            r = get(rid, rec)
            r.finished_time = end
            r.finish_reason = reason
            r.status = _STATUS_BY_REASON.get(reason, "FINISHED_ERROR")
    return reqs


def _apply_info(r: TraceRequest, info: dict[str, Any]) -> None:
    """Tenant, priority and SLO targets of an arrival (``StepRecord.arrived_info``)."""
    r.tenant = str(info.get("tenant", "") or "")
    r.priority = int(info.get("priority", 0) or 0)
    for name in ("slo_ttft", "slo_tpot"):
        value = info.get(name)
        setattr(r, name, float(value) if value else None)


def scheduler_totals(
    records: list[StepRecord], requests: dict[str, TraceRequest] | None = None
) -> dict[str, Any]:
    """Scheduler totals in the shape of ``kvloop.sim.driver.scheduler_summary``
    (``num_cpu_blocks`` absent where the records do not carry the host pool's size)."""
    if requests is None:
        requests = reconstruct_requests(records)
    modes = [mode for rec in records for _, mode in rec.preempted]
    queries = sum(rec.prefix_cache_queries for rec in records)
    hits = sum(rec.prefix_cache_hits for rec in records)
    usage_sum = peak = 0.0
    for rec in records:  # NOTE: summed in step order, as SchedulerStats does
        u = rec.kv_blocks_used / rec.num_gpu_blocks if rec.num_gpu_blocks else 0.0
        usage_sum += u
        peak = max(peak, u)
    n = len(records)
    host = {"num_cpu_blocks": records[-1].num_host_blocks} if (
        records and records[-1].num_host_blocks) else {}
    return {
        **host,
        "num_steps": n,
        "num_preemptions": len(modes),
        "num_recompute_preemptions": modes.count("recompute"),
        "num_swap_preemptions": modes.count("swap"),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in requests.values()),
        "swapped_out_blocks": sum(rec.num_blocks_swapped_out for rec in records),
        "swapped_in_blocks": sum(rec.num_blocks_swapped_in for rec in records),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "recompute_prefix_hits": sum(r.recompute_prefix_hits for r in requests.values()),
        "kv_usage_mean": usage_sum / n if n else 0.0,
        "kv_usage_peak": peak,
        "num_gpu_blocks": records[-1].num_gpu_blocks if records else 0,
    }


def summarize_trace(
    records: list[StepRecord],
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, Any]:
    """``summarize_requests`` over the rebuilt requests, plus ``scheduler`` totals, ``load``
    (``kvloop.sim.load.load_summary``; busy time = the steps' spans) and
    ``requests_without_arrival`` (requests the trace saw but whose arrival it missed).

    When the trace recorded tenants (``StepRecord.arrived_info``), ``tenants`` has a row per
    tenant (requests, tokens served, goodput, mean/p99 TTFT). Goodput counts each request's
    recorded SLO targets (its own or the scheduler's default); ``slo_ttft``/``slo_tpot``,
    when given, replace them for every request (a what-if on the same run)."""
    reqs = reconstruct_requests(records)
    for name, value in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
        if value is not None:
            for r in reqs.values():
                setattr(r, name, None)  # NOTE: the given target applies to all
    summary = summarize_requests(reqs.values(), slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    summary["scheduler"] = scheduler_totals(records, reqs)
    busy = sum(max(0.0, rec.end_time_s - rec.time_s) for rec in records)
    summary["load"] = load_summary(reqs.values(), busy, summary["duration"])
    summary["requests_without_arrival"] = sum(1 for r in reqs.values() if not r.seen_arrival)
    return summary
