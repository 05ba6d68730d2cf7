"""Small recorded traces for the web view's tests: the scheduler alone, on a fake clock."""

from __future__ import annotations

from helpers import make_scheduler, req, run_all
from kvloop.core import StepRecord


def tight_pool_trace() -> list[StepRecord]:
    """Three 8-token prompts in a 6-block pool (4 tokens a block), cost-aware preemption
    off: step 1 preempts C (recompute) for A's next block; C then waits for blocks, comes
    back and finishes; a fourth request with markup in its id arrives later."""
    s = make_scheduler(num_gpu_blocks=6, max_num_seqs=4, cost_aware_preemption=False,
                       max_num_batched_tokens=64)
    for rid in "ABC":
        s.add_request(req(rid, 8, 8))
    s.add_request(req("<b>x</b>", 4, 2))
    run_all(s)
    return s.recorder.records
