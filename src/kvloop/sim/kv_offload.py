"""The prefix cache's host tier in the simulator: its costs and its report.

The scheduler's load-or-recompute choice needs what a load and a prefill cost on the
simulated device (``load_costs``, from the cost model: the host link for loads, a prefill
chunk for recompute). The report counts device and host hits, bytes moved both ways, and
the prompt tokens computed again although some earlier request had computed them
(``prefix_reuse``: against an unbounded prefix cache, which no eviction ever empties).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloop.core.request import Request
from kvloop.executor.simulated.executor import StepCost

RECOMPUTE_CHUNK = 2048
"""Tokens of the prefill chunk whose time per token prices recompute (vLLM's default
budget on GPUs)."""


def load_costs(cost: StepCost, block_size: int) -> tuple[float, float, float]:
    """(seconds per block loaded host -> device, per load, per prompt token prefilled) on
    the simulated device, for ``CacheConfig``'s ``kv_load_*`` and
    ``kv_recompute_s_per_token``; zeros (load) when the cost model cannot price them."""
    try:
        per_block = cost.step_time(0, 0, (), 1, block_size=block_size)
        per_token = cost.step_time(0, 0, [(RECOMPUTE_CHUNK, 0)]) / RECOMPUTE_CHUNK
    except KeyError:  # NOTE: recorded step times (``MeasuredSteps``) may not know these
        return 0.0, 0.0, 0.0  # unknown: ``auto`` loads
    return per_block, 0.0, per_token


def prefix_reuse(requests: Sequence[Request], block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache would have served at first admission: for
    each request in arrival order, its full prompt blocks (all but the last token) that an
    earlier request's prompt held."""
    seen: set[bytes] = set()
    total = 0
    for r in sorted(requests, key=lambda r: (r.arrival_time, r.arrival_order)):
        hashes = r.block_hashes
        limit = min(len(hashes), (r.num_prompt_tokens - 1) // block_size)
        hit = 0
        while hit < limit and hashes[hit] in seen:
            hit += 1
        total += hit * block_size
        seen.update(hashes[:r.num_prompt_tokens // block_size])
    return total


def offload_summary(totals: dict[str, Any], requests: Sequence[Request], block_size: int,
                    block_bytes: int) -> dict[str, Any]:
    """Host-tier figures for the metrics JSON: ``totals`` is ``scheduler_summary``'s
    ``kv_offload`` entry (blocks), completed with bytes and recomputed prompt tokens."""
    out = dict(totals)
    out["bytes_loaded"] = totals["blocks_loaded"] * block_bytes
    out["bytes_stored"] = totals["blocks_stored"] * block_bytes
    unbounded = prefix_reuse(requests, block_size)
    out["unbounded_prefix_hits"] = unbounded
    hits = (totals["device_hit_blocks"] + totals["host_hit_blocks"]) * block_size
    out["recomputed_prefix_tokens"] = max(0, unbounded - hits)
    return out


def offload_rows(kv: dict[str, Any]) -> dict[str, Any]:
    """The host tier's lines of the metrics table."""
    gib = 1 << 30
    return {
        "Prefix blocks hit (device / host)":
            f"{kv['device_hit_blocks']} / {kv['host_hit_blocks']}",
        "Host hits recomputed (blocks)": kv["host_recomputed_blocks"],
        "Host tier moved (in / out, GiB)":
            f"{kv.get('bytes_loaded', 0) / gib:.2f} / {kv.get('bytes_stored', 0) / gib:.2f}",
        "Prefix tokens recomputed": kv.get("recomputed_prefix_tokens", "-"),
    }
