"""Why a request waited, for the timeline: its tenant, priority and TTFT target, and
whether it missed that target.

Read from ``StepRecord.arrived_info`` (what the scheduler knew on arrival: only non-default
keys are recorded) and the steps that sampled each request's first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloop.core.stats import StepRecord

__all__ = ["TENANT_CHARS", "RowInfo", "row_infos", "row_suffix"]

TENANT_CHARS = 12
"""Characters of a tenant name kept in a row label (longer ones end in ``…``)."""


@dataclass(frozen=True, slots=True)
class RowInfo:
    """What the scheduler knew of one request, and how its TTFT target went."""

    tenant: str = ""
    priority: int = 0
    ttft_deadline: float | None = None
    """Arrival + its TTFT target, on the record clock (None: no target recorded)."""
    missed_ttft: bool = False
    """Its first token came after the deadline, or never came while the trace ran past it
    (rejected, aborted or still waiting)."""


def row_infos(records: list[StepRecord], ids: list[str]) -> list[RowInfo]:
    """One ``RowInfo`` per request id (an empty one for requests without recorded info).

    NOTE: the whole trace is read, not only the window, so a request whose first token comes
    after the window is judged by when it came."""
    want = set(ids)
    info: dict[str, dict[str, Any]] = {}
    arrival: dict[str, float] = {}
    first_token: dict[str, float] = {}
    for rec in records:
        extra = rec.arrived_info
        for rid, at, _ in rec.arrived:
            if rid in want:
                arrival[rid] = float(at)
                if extra and rid in extra:
                    info[rid] = extra[rid]
        for rid in rec.sampled:
            if rid in want and rid not in first_token:
                first_token[rid] = rec.end_time_s
    end = records[-1].end_time_s if records else 0.0
    out = []
    for rid in ids:
        d = info.get(rid, {})
        target = d.get("slo_ttft")
        deadline = arrival[rid] + float(target) if target and rid in arrival else None
        missed = False
        if deadline is not None:
            first = first_token.get(rid)
            missed = first > deadline if first is not None else end > deadline
        out.append(RowInfo(str(d.get("tenant", "") or ""), int(d.get("priority", 0) or 0),
                           deadline, missed))
    return out


def row_suffix(info: RowInfo) -> str:
    """What a row label adds: the tenant (cut to ``TENANT_CHARS``) and ``p<priority>`` when
    it is not 0; empty when neither."""
    parts = []
    if info.tenant:
        t = info.tenant
        parts.append(t if len(t) <= TENANT_CHARS + 1 else t[:TENANT_CHARS] + "…")
    if info.priority:
        parts.append(f"p{info.priority}")
    return " ".join(parts)
