"""The scheduler loop's pure-Python core: requests, paged KV blocks, scheduler, stats.

Nothing here imports torch, numpy or server code.
"""

from kvloop.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvloop.core.interface import (
    CachedRequestData,
    Executor,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.loop import StepResult, run_step
from kvloop.core.policies import POLICIES, Policy, make_policy
from kvloop.core.request import FinishReason, Request, RequestStatus
from kvloop.core.scheduler import Scheduler
from kvloop.core.stats import ScheduledEntry, SchedulerStats, StepRecord, StepRecorder, read_jsonl

__all__ = [
    "POLICIES",
    "BlockPool",
    "CachedRequestData",
    "Executor",
    "FinishReason",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "Policy",
    "Request",
    "RequestStatus",
    "ScheduledEntry",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StepRecord",
    "StepRecorder",
    "StepResult",
    "make_policy",
    "read_jsonl",
    "run_step",
]
