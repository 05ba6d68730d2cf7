"""What the loop did: one ``StepRecord`` per step, and running totals of the scheduler."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any


@dataclass
class ScheduledEntry:
    """One request's share of a step."""

    request_id: str
    num_tokens: int
    """Tokens computed for the request in this step."""
    kind: str
    """``prefill`` (prompt chunk), ``recompute`` (re-prefill after preemption) or ``decode``."""
    num_computed_tokens: int
    """Tokens already in the KV cache before this step (the context it attends over)."""


@dataclass
class StepRecord:
    """Everything one step did, written as one JSONL line."""

    step: int
    time_s: float
    """Clock time when the step was scheduled (virtual in the simulator)."""
    step_time_s: float
    """Duration reported by the executor."""
    end_time_s: float
    """Clock time when the step's results were applied: the time of its sampled tokens."""
    scheduled: list[ScheduledEntry]
    num_batched_tokens: int
    token_budget: int
    preempted: list[tuple[str, str]]
    """(request_id, mode) for each preemption, mode ``recompute`` or ``swap``."""
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    swapped_in: list[str]
    finished: list[tuple[str, str]]
    """(request_id, finish reason) for requests that finished in this step."""
    arrived: list[tuple[str, float, int]]
    """(request_id, arrival time, prompt tokens) of requests added since the last step."""
    sampled: list[str]
    """Requests that received an output token in this step."""
    kv_blocks_used: int
    num_gpu_blocks: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache by admissions this step."""
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_swapped: int
    arrived_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    """For arrivals in ``arrived`` that have any: their tenant, priority and SLO targets
    (``slo_ttft``/``slo_tpot`` in seconds, the scheduler's defaults applied)."""
    admitted: list[list[Any]] = field(default_factory=list)
    """[request_id, tokens scheduled, tokens found in the prefix cache] for each request
    admitted from the waiting queue in this step."""
    held: list[list[str]] = field(default_factory=list)
    """[request_id, reason] for each waiting request the waiting pass examined and left
    waiting (reasons: ``kvloop.core.decisions.Reason``)."""
    held_reason: str | None = None
    """Why the waiting pass stopped (or did not run) with requests still waiting."""
    num_held_behind: int = 0
    """Waiting requests never examined: they wait behind, for ``held_reason``."""
    left_out: list[list[str]] = field(default_factory=list)
    """[request_id, reason] for running or swapped-out requests that computed nothing."""
    preempt_causes: list[list[str]] = field(default_factory=list)
    """[victim, cause, request that needed the room] for each of ``preempted``, in order
    (causes: ``kvloop.core.decisions.Cause``)."""
    kv_blocks_allocated: int = 0
    """Device blocks taken from the free pool in this step (prefix hits not counted)."""
    kv_blocks_freed: int = 0
    """Device blocks returned to the free pool in this step, net of cached blocks revived
    by prefix hits."""
    kv_cached_blocks: int = 0
    """Device blocks holding a prefix-cache hash after the step (owned or free)."""
    host_blocks_used: int = 0
    """Host (CPU swap tier) blocks holding swapped-out requests after the step."""
    num_host_blocks: int = 0
    block_size: int = 0
    """Tokens per KV block (0: not recorded)."""

    num_blocks_loaded: int = 0
    """Prefix blocks loaded host -> device (the prefix cache's host tier)."""
    num_blocks_offloaded: int = 0
    """Prefix blocks stored device -> host."""
    kv_load_choices: list[tuple[str, str, int]] = field(default_factory=list)
    """(request_id, ``load`` or ``recompute``, host blocks) for admissions whose prefix
    continued in the host tier: the scheduler's choice by the load and prefill costs."""

    def to_dict(self) -> dict[str, Any]:
        """The record as its JSON line has it (``asdict``'s result, several times faster).

        NOTE: shares the record's lists and its entries' dicts: read it, do not change it."""
        d = dict(vars(self))
        d["scheduled"] = [vars(e) for e in self.scheduled]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        d = dict(d)
        d["scheduled"] = [ScheduledEntry(**e) for e in d["scheduled"]]
        d["preempted"] = [tuple(p) for p in d["preempted"]]
        d["finished"] = [tuple(p) for p in d["finished"]]
        d["arrived"] = [tuple(p) for p in d["arrived"]]
        if "kv_load_choices" in d:
            d["kv_load_choices"] = [tuple(p) for p in d["kv_load_choices"]]
        return cls(**d)


class StepRecorder:
    """Collects step records in memory and/or streams them to a JSONL file."""

    def __init__(self, *, keep_in_memory: bool = True, sink: IO[str] | None = None) -> None:
        self.keep_in_memory = keep_in_memory
        self.sink = sink
        self.records: list[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        if self.keep_in_memory:
            self.records.append(record)
        if self.sink is not None:
            self.sink.write(record.to_json())
            self.sink.write("\n")

    def write_jsonl(self, path: str) -> None:
        with open(path, "w") as f:
            for record in self.records:
                f.write(record.to_json())
                f.write("\n")


def read_jsonl(path: str) -> list[StepRecord]:
    """Load step records written by ``StepRecorder``."""
    with open(path) as f:
        return [StepRecord.from_dict(json.loads(line)) for line in f if line.strip()]


@dataclass
class SchedulerStats:
    """Running totals over the scheduler's life."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recomputed_tokens: int = 0
    """Tokens computed again after recompute preemptions (prefix hits excluded)."""
    num_preemptions_avoided: int = 0
    """Times cost-aware preemption left a request out of a step instead of preempting."""
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    kv_usage_sum: float = 0.0
    """Sum over steps of the used fraction of device blocks (mean = sum / steps)."""
    kv_usage_peak: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache at first admissions."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    recompute_prefix_hits: int = 0
    """Tokens found cached when a recompute-preempted request was readmitted."""
    finished_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage_mean(self) -> float:
        return self.kv_usage_sum / self.num_steps if self.num_steps else 0.0
