"""The prefix cache's host tier: stores, loads, the shared host budget, failed steps."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_content import KVContentExecutor, StepFault

from helpers import FakeClock, req
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Scheduler, StepRecorder
from kvloop.core.host_tier import HostTier
from kvloop.core.kv_offload import LoadCosts

BS = 4


def make(num_gpu: int, num_cpu: int = 0, offload: int = 0, **kw: object) -> Scheduler:
    cache = {k: kw.pop(k) for k in list(kw)
             if k.startswith("kv_") or k == "enable_prefix_caching"}
    return Scheduler(
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64, **kw),  # type: ignore
        CacheConfig(block_size=BS, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu,
                    kv_offload_blocks=offload, **cache),  # type: ignore[arg-type]
        clock=FakeClock(), recorder=StepRecorder())


def drive(s: Scheduler, ex: KVContentExecutor, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        try:
            result = ex.execute(out)
        except StepFault as exc:
            s.abandon_step(out, str(exc))
        else:
            s.update_from_output(out, result)
        s.check_invariants()
    assert not s.has_unfinished_requests(), "did not drain"


def shared(rid: str, prefix: list[int], extra: int, max_tokens: int = 3):
    rng = random.Random(rid)
    return req(rid, 0, max_tokens, prompt=prefix + [rng.randrange(100, 900)
                                                    for _ in range(extra)])


def test_host_tier_lru_limit_and_swap_reclaim() -> None:
    t = HostTier(num_swap_blocks=2, num_prefix_blocks=3)
    stored = [t.store(bytes([i])) for i in range(3)]
    assert t.store(b"x") is None  # the three are pinned by the step being built
    t.hand_over()
    t.begin_step()
    stored.append(t.store(bytes([3])))
    assert None not in stored and len(t.cached) == 3  # the 4th evicted the 1st (LRU)
    assert t.lookup(bytes([0])) is None and t.lookup(bytes([1])) is not None
    assert t.store(bytes([1])) is None  # held already: only touched
    t.hand_over()
    t.begin_step()
    assert t.can_take(5) and not t.can_take(6)
    swap = t.take(4)  # 2 free + 1 free left by the limit... then reclaims prefix blocks
    assert len(set(swap)) == 4
    t.check_invariants(swap)
    t.release(swap)
    t.check_invariants([])


def test_pinned_host_blocks_are_never_reclaimed() -> None:
    t = HostTier(num_swap_blocks=0, num_prefix_blocks=2)
    a, b = t.store(b"a"), t.store(b"b")
    t.hand_over()  # both stores in flight: pinned
    assert not t.can_take(1)
    assert t.store(b"c") is None  # no unpinned victim
    t.begin_step()
    assert t.store(b"c") in (a, b) and t.lookup(b"a") is None


def test_load_costs_choose_per_request() -> None:
    c = LoadCosts("auto", load_s_per_block=1e-4, load_latency_s=1e-3,
                  recompute_s_per_token=1e-4)
    assert not c.load(1, 4)  # 1.1 ms to load, 0.4 ms to recompute
    assert c.load(10, 4)  # 2 ms to load, 4 ms to recompute
    assert LoadCosts("recompute").load(100, 16) is False
    assert LoadCosts("auto").load(1, 16)  # unknown recompute cost: load


def test_evicted_prefix_is_loaded_back_not_recomputed() -> None:
    prefix = list(range(1000, 1016))  # 4 blocks
    s = make(num_gpu=8, offload=16)
    ex = KVContentExecutor(8, s.kv.num_cpu_blocks, BS)
    s.add_request(shared("a", prefix, 3))
    drive(s, ex)
    s.add_request(req("filler", 29, 2))  # takes every device block: the prefix leaves
    drive(s, ex)
    assert not any(h in s.kv.pool.cached for h in s.kv.host.cached)
    s.add_request(shared("b", prefix, 5))
    drive(s, ex)
    st = s.kv.host.stats
    assert st.host_hit_blocks == 4 and st.blocks_loaded == 4 and ex.bytes_loaded == 4
    choices = [c for r in s.recorder.records for c in r.kv_load_choices]  # type: ignore
    assert choices == [("b", "load", 4)]
    assert s.stats.prefix_cache_hits == 16


def test_recompute_choice_is_recorded_and_loads_nothing() -> None:
    prefix = list(range(1000, 1016))
    s = make(num_gpu=8, offload=16, kv_offload_load="recompute")
    ex = KVContentExecutor(8, s.kv.num_cpu_blocks, BS)
    for p in (shared("a", prefix, 3), req("filler", 29, 2), shared("b", prefix, 5)):
        s.add_request(p)
        drive(s, ex)
    st = s.kv.host.stats
    assert st.blocks_loaded == 0 and st.host_recomputed_blocks == 4


def test_config_rejects_bad_offload_fields() -> None:
    with pytest.raises(ValueError, match="kv_offload_blocks"):
        CacheConfig(kv_offload_blocks=-1)
    with pytest.raises(ValueError, match="kv_offload_write_policy"):
        CacheConfig(kv_offload_write_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_load_s_per_block"):
        CacheConfig(kv_load_s_per_block=-1.0)
    with pytest.raises(ValueError, match="kv_eviction"):
        CacheConfig(kv_eviction="mru")  # type: ignore[arg-type]


def _workload(seed: int, n: int) -> list:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 9000) for _ in range(rng.randrange(4, 24))]
                for _ in range(3)]
    out = []
    for i in range(n):
        p = prefixes[rng.randrange(3)]
        out.append((rng.randrange(0, 6), shared(f"r{i}", p, rng.randrange(1, 9),
                                                max_tokens=rng.randrange(1, 7))))
    return out


def _run(seed: int, n: int, num_gpu: int, num_cpu: int, offload: int, faults: bool,
         **kw: object) -> dict[str, list[int]]:
    s = make(num_gpu=num_gpu, num_cpu=num_cpu, offload=offload, max_num_seqs=4, **kw)
    ex = KVContentExecutor(num_gpu, s.kv.num_cpu_blocks, BS)
    rng = random.Random(seed + 1)
    arrivals = _workload(seed, n)
    reqs = [r for _, r in arrivals]
    step = 0
    while arrivals or s.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step % 6:
            s.add_request(arrivals.pop(0)[1])
        if faults and rng.random() < 0.15:
            ex.fail_at = rng.choice(("store", "load", "forward"))
        if s.has_unfinished_requests():
            out = s.schedule()
            try:
                result = ex.execute(out)
            except StepFault as exc:
                s.abandon_step(out, str(exc))
            else:
                s.update_from_output(out, result)
            s.check_invariants()
        step += 1
        assert step < 5000
    kv = s.kv
    assert kv.num_used_blocks == 0 and not kv.swapped_blocks, "device blocks leaked"
    assert len(kv.host.free) + len(kv.host.cached) + len(kv.host.releasing) == kv.num_cpu_blocks
    return {r.request_id: list(r.output_token_ids) for r in reqs if r.error is None}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_gpu=st.integers(10, 24), num_cpu=st.integers(0, 12),
       offload=st.integers(1, 24), swap=st.booleans(), through=st.booleans(),
       queue_aware=st.booleans(), faults=st.booleans())
def test_two_tiers_keep_kv_exact(seed: int, num_gpu: int, num_cpu: int, offload: int,
                                 swap: bool, through: bool, queue_aware: bool,
                                 faults: bool) -> None:
    """Random shared-prefix traffic on a small pool: every read KV slot holds its token
    (the executor checks), no block leaks, also with faults injected during loads and
    stores; and without faults the outputs equal those of a run with no host tier."""
    kw = dict(preemption_mode="swap" if swap else "recompute",
              kv_offload_write_policy="write_through" if through else "write_back",
              kv_eviction="queue-aware" if queue_aware else "lru")
    got = _run(seed, 14, num_gpu, num_cpu, offload, faults, **kw)
    if not faults:
        base = _run(seed, 14, num_gpu, num_cpu, 0, False,
                    preemption_mode=kw["preemption_mode"])
        assert got == base


def test_queue_aware_eviction_passes_over_what_the_queue_will_hit() -> None:
    from kvloop.core.block_pool import BlockPool

    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.free_blocks(blocks)  # LRU order 0, 1, 2, 3
    pool.protected = {bytes([0]), bytes([2])}
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 3]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [0]  # none unprotected left
    pool.check_invariants({b.block_id: 1 for b in blocks if b.block_id != 2})


def test_no_prefix_cache_means_no_host_tier() -> None:
    s = make(num_gpu=8, num_cpu=2, offload=16, enable_prefix_caching=False)
    assert s.kv.plain_lru and s.kv.num_cpu_blocks == 2 and s.kv.host.num_blocks == 2


def test_engine_args_refuse_a_negative_offload_space() -> None:
    from kvloop.engine.args import EngineArgs

    with pytest.raises(ValueError, match="kv_offload_space"):
        EngineArgs(kv_offload_space=-1.0).cache_config(8, 0)


def test_auto_recomputes_a_hit_too_short_to_pay_for_its_load() -> None:
    from kvloop.core.stats import StepRecord

    prefix = list(range(1000, 1016))
    s = make(num_gpu=8, offload=16, kv_load_latency_s=1.0, kv_load_s_per_block=1e-4,
             kv_recompute_s_per_token=1e-3)  # 1.0004 s to load 4 blocks, 16 ms to prefill
    ex = KVContentExecutor(8, s.kv.num_cpu_blocks, BS)
    for p in (shared("a", prefix, 3), req("filler", 29, 2), shared("b", prefix, 5)):
        s.add_request(p)
        drive(s, ex)
    records = [r for r in s.recorder.records if r.kv_load_choices]  # type: ignore[union-attr]
    assert [c for r in records for c in r.kv_load_choices] == [("b", "recompute", 4)]
    again = StepRecord.from_dict(json.loads(records[0].to_json()))
    assert again.kv_load_choices == [("b", "recompute", 4)]
