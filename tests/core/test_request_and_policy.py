"""Request, waiting-queue policies, SamplingParams and config validation."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import POLICIES, FinishReason, Request, RequestStatus, make_policy
from kvloop.core.policies import FCFSQueue, KeyedQueue
from kvloop.sampling_params import SamplingParams


def rids(requests):
    return [r.request_id for r in requests]


# -- Request -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[], range(0), ()])
def test_the_gate_refuses_an_empty_prompt(prompt):
    from kvloop.engine.intake import EngineLimits, validate_request
    from kvloop.errors import InvalidRequestError

    limits = EngineLimits(max_model_len=64, kv_cache_tokens=1024, block_size=16)
    with pytest.raises(InvalidRequestError, match="prompt"):
        validate_request(prompt, None, limits)


@pytest.mark.parametrize("priority", [1.5, True, 2**63, -(2**63) - 1, 10**400])
def test_the_gate_refuses_priority_outside_64_bits(priority):
    from kvloop.engine.intake import EngineLimits, validate_request

    limits = EngineLimits(max_model_len=64, kv_cache_tokens=1024, block_size=16)
    with pytest.raises(ValueError, match="priority"):
        validate_request([1], None, limits, priority=priority)


@pytest.mark.parametrize("priority", [2**63 - 1, -(2**63)])
def test_priority_policy_orders_the_64_bit_extremes(priority):
    """The priority key (``priority * aging_s + arrival``) stays finite and ordered at the
    limits a request may carry."""
    from kvloop.core import Scheduler

    s = Scheduler(SchedulerConfig(max_model_len=64, policy="priority", aging_s=1e8),
                  CacheConfig(block_size=4, num_gpu_blocks=16))
    s.add_request(Request("x", [1, 2], priority=priority))
    s.add_request(Request("zero", [1, 2]))
    s.check_invariants()
    first = [r.request_id for r in s.waiting]
    assert first[0] == ("x" if priority < 0 else "zero")


def test_add_request_is_all_or_nothing_when_the_policy_refuses():
    """A request the policy cannot order (its key raises) leaves no trace in the scheduler."""
    from kvloop.core import Scheduler

    s = Scheduler(SchedulerConfig(max_model_len=64, policy="priority"),
                  CacheConfig(block_size=4, num_gpu_blocks=16))
    bad = Request("bad", [1, 2])
    bad.priority = 10**400  # NOTE: past Request's own check, as a buggy caller might
    for _ in range(3):
        with pytest.raises(OverflowError):
            s.add_request(bad)
    assert not s.requests and not s.has_unfinished_requests() and s.num_waiting == 0
    s.check_invariants()
    s.add_request(Request("ok", [1, 2]))
    assert list(s.requests) == ["ok"]


def test_request_defaults():
    r = Request("r", [1, 2, 3])
    assert r.status == RequestStatus.WAITING and not r.is_finished
    assert r.num_tokens == 3 and r.num_computed_tokens == 0
    assert r.max_tokens == SamplingParams().max_tokens
    assert r.max_total_tokens == 3 + r.max_tokens
    assert r.finish_reason is None


def test_token_ids_over_prompt_output_boundary_with_range_prompt():
    r = Request("r", range(10, 20))  # never materialised as a list
    r.output_token_ids.extend([1, 2, 3])
    assert r.num_prompt_tokens == 10 and r.num_tokens == 13 and r.num_output_tokens == 3
    assert r.token_ids(0, 3) == [10, 11, 12]
    assert r.token_ids(8, 10) == [18, 19]  # ends exactly at the boundary
    assert r.token_ids(8, 12) == [18, 19, 1, 2]  # crosses it
    assert r.token_ids(10, 13) == [1, 2, 3]  # starts exactly at it
    assert r.token_ids(11, 12) == [2]
    assert r.token_ids(9, 11) == [19, 1]
    assert r.all_token_ids() == [*range(10, 20), 1, 2, 3]
    assert isinstance(r.token_ids(0, 2), list)
    assert r.prompt_token_ids == range(10, 20)


def test_block_hashes_extend_incrementally_and_ignore_the_prompt_output_split():
    r = Request("r", list(range(6)))
    assert r.update_block_hashes(4) == r.block_hashes and len(r.block_hashes) == 1
    first = list(r.block_hashes)
    r.output_token_ids.extend([6, 7, 8])
    assert len(r.update_block_hashes(4)) == 2
    assert r.block_hashes[:1] == first
    whole = Request("w", range(9))
    assert whole.update_block_hashes(4) == r.block_hashes
    other = Request("o", [0, 1, 2, 3, 4, 5, 6, 99, 8])
    assert other.update_block_hashes(4)[0] == r.block_hashes[0]
    assert other.block_hashes[1] != r.block_hashes[1]


def test_block_hashes_depend_on_salt():
    plain = Request("a", range(8)).update_block_hashes(4)
    s1 = Request("b", range(8), cache_salt="s1").update_block_hashes(4)
    s1_again = Request("c", range(8), cache_salt="s1").update_block_hashes(4)
    s2 = Request("d", range(8), cache_salt="s2").update_block_hashes(4)
    assert s1 == s1_again
    assert len({plain[0], s1[0], s2[0]}) == 3
    assert len({plain[1], s1[1], s2[1]}) == 3


_HASH_SCRIPT = """
import json
from kvloop.core import Request
out = {}
for salt in (None, "tenant-a"):
    r = Request("x", list(range(10)), cache_salt=salt)
    r.output_token_ids.extend([7, 8, 9])
    out[str(salt)] = [h.hex() for h in r.update_block_hashes(4)]
print(json.dumps(out))
"""


def test_block_hashes_are_the_same_in_another_process():
    expected = {}
    for salt in (None, "tenant-a"):
        r = Request("x", list(range(10)), cache_salt=salt)
        r.output_token_ids.extend([7, 8, 9])
        expected[str(salt)] = [h.hex() for h in r.update_block_hashes(4)]
    # A different string-hash seed than ours: the salt must not go through hash(str).
    seed = "4242" if os.environ.get("PYTHONHASHSEED") != "4242" else "77"
    proc = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == expected
    assert expected["None"] != expected["tenant-a"]


def test_block_hashes_are_sha256_of_the_parent_and_the_token_bytes():
    """The documented formula, recomputed independently: any machine gets these values."""
    import hashlib
    import struct

    from kvloop.core.prefix_hash import block_hash, root_hash

    r = Request("x", [1, 2, 3, 50000, 5, 6, 7, 8, 9], cache_salt="t")
    got = r.update_block_hashes(4)
    parent = hashlib.sha256(b"kvloop-prefix-v1\0t").digest()
    for i, h in enumerate(got):
        block = r.prompt_token_ids[4 * i:4 * i + 4]
        parent = hashlib.sha256(parent + struct.pack("<4q", *block)).digest()
        assert h == parent
        assert block_hash(got[i - 1] if i else root_hash("t"), block) == h
    assert len(got) == 2 and len(got[0]) == 32


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
        (RequestStatus.FINISHED_REJECTED, FinishReason.REJECTED),
    ],
)
def test_finish_reason_mapping(status, reason):
    r = Request("r", [1])
    r.status = status
    assert r.is_finished and status.finished
    assert r.finish_reason is reason


@pytest.mark.parametrize(
    "status",
    [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED, RequestStatus.PREEMPTED],
)
def test_unfinished_statuses_have_no_finish_reason(status):
    r = Request("r", [1])
    r.status = status
    assert not r.is_finished and not status.finished
    assert r.finish_reason is None


def test_finish_reasons_use_openai_names():
    assert [str(f) for f in FinishReason] == ["stop", "length", "abort", "error", "rejected"]
    assert FinishReason.STOP == "stop"


def _priority_queue() -> KeyedQueue:
    """Strict priority order (no aging), as vLLM's."""
    return KeyedQueue(_policy("priority", aging_s=0).key)


# -- FCFS queue --------------------------------------------------------------------------------
def test_fcfs_queue_arrival_order():
    q = FCFSQueue()
    for name in "abc":
        q.add(Request(name, [1]))
    assert len(q) == 3 and rids(q) == ["a", "b", "c"]
    assert q.pop().request_id == "a"
    assert rids(q) == ["b", "c"]


def test_fcfs_preempted_requests_go_to_the_front():
    q = FCFSQueue()
    q.add(Request("a", [1]))
    q.add(Request("b", [1]))
    c = Request("c", [1])
    c.num_preemptions = 1
    q.add(c)
    assert rids(q) == ["c", "a", "b"]
    d = Request("d", [1])
    d.num_preemptions = 2
    q.add(d)  # victims are preempted latest-arrived first, so the last one goes first
    assert rids(q) == ["d", "c", "a", "b"]


def test_fcfs_add_front_keeps_order():
    q = FCFSQueue()
    q.add(Request("a", [1]))
    q.add(Request("b", [1]))
    x, y = Request("x", [1]), Request("y", [1])
    q.add_front([x, y])
    assert rids(q) == ["x", "y", "a", "b"]
    q.add_front([])
    assert rids(q) == ["x", "y", "a", "b"]
    q.add_front(iter([Request("p", [1]), Request("q", [1])]))
    assert rids(q) == ["p", "q", "x", "y", "a", "b"]


def test_fcfs_remove():
    q = FCFSQueue()
    a, b = Request("a", [1]), Request("b", [1])
    q.add(a)
    q.add(b)
    assert q.remove(a) is True
    assert q.remove(a) is False
    assert q.remove(Request("z", [1])) is False
    assert len(q) == 1 and rids(q) == ["b"]


def test_fcfs_pop_on_empty_raises():
    q = FCFSQueue()
    with pytest.raises(IndexError):
        q.pop()
    assert len(q) == 0


# -- priority queue ----------------------------------------------------------------------------
def _pr(rid, priority, arrival, order):
    r = Request(rid, [1], priority=priority, arrival_time=arrival)
    r.arrival_order = order
    return r


def test_priority_queue_orders_by_priority_arrival_then_arrival_order():
    q = _priority_queue()
    reqs = [
        _pr("late_urgent", 0, 5.0, 4),
        _pr("low", 2, 0.0, 0),
        _pr("early_urgent_2", 0, 1.0, 2),
        _pr("early_urgent_1", 0, 1.0, 1),
        _pr("mid", 1, 0.5, 3),
        _pr("negative", -1, 9.0, 5),
    ]
    for r in reqs:
        q.add(r)
    expected = ["negative", "early_urgent_1", "early_urgent_2", "late_urgent", "mid", "low"]
    assert len(q) == 6
    assert rids(q) == expected  # iteration does not consume
    assert [q.pop().request_id for _ in range(6)] == expected
    assert len(q) == 0


def test_priority_queue_ties_keep_insertion_order():
    q = _priority_queue()
    for name in "abc":
        q.add(_pr(name, 0, 0.0, 0))
    assert [q.pop().request_id for _ in range(3)] == ["a", "b", "c"]


def test_priority_queue_lazy_remove():
    q = _priority_queue()
    a, b, c = _pr("a", 0, 0.0, 0), _pr("b", 1, 0.0, 1), _pr("c", 2, 0.0, 2)
    for r in (a, b, c):
        q.add(r)
    assert q.remove(b) is True
    assert len(q) == 2 and rids(q) == ["a", "c"]
    assert q.remove(b) is False  # already removed
    assert q.remove(_pr("z", 0, 0.0, 9)) is False  # never added
    assert len(q) == 2
    assert q.remove(a) is True  # the head
    assert len(q) == 1 and rids(q) == ["c"]
    assert q.pop() is c
    assert len(q) == 0 and list(q) == []


def test_priority_queue_add_front_reinserts_in_key_order():
    q = _priority_queue()
    a, b = _pr("a", 0, 0.0, 0), _pr("b", 1, 0.0, 1)
    q.add(b)
    q.add_front([a])
    assert rids(q) == ["a", "b"]


def test_priority_queue_pop_on_empty_raises_without_side_effects():
    q = _priority_queue()
    a = _pr("a", 0, 0.0, 0)
    q.add(a)
    q.remove(a)  # only a stale heap entry is left
    with pytest.raises(IndexError):
        q.pop()
    assert len(q) == 0


def test_priority_queue_remove_then_add_again():
    q = _priority_queue()
    a, b = _pr("a", 0, 0.0, 0), _pr("b", 1, 0.0, 1)
    q.add(a)
    q.add(b)
    assert q.remove(a)
    q.add(a)
    assert len(q) == 2
    assert rids(q) == ["a", "b"]
    assert q.remove(a) is True
    assert len(q) == 1


# -- policy registry ---------------------------------------------------------------------------
def _policy(name: str, **kw):
    if name in ("slo", "balanced"):
        kw.setdefault("slo_ttft", 1.0)
    return make_policy(SchedulerConfig(policy=name, **kw), lambda: 0.0)


def test_make_policy_by_name():
    assert set(POLICIES) == {"fcfs", "priority", "slo", "fair", "sjf", "mlfq", "balanced"}
    assert isinstance(_policy("fcfs").waiting, FCFSQueue)
    assert isinstance(_policy("priority").waiting, KeyedQueue)
    for name in POLICIES:
        assert _policy(name).name == name


@pytest.mark.parametrize("name", ["lifo", "", "FCFS"])
def test_unknown_policy_name(name):
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority, slo, fair, sjf"):
        SchedulerConfig(policy=name)


def test_policy_keys_order_urgency():
    early, late = _pr("early", 1, 0.0, 0), _pr("late", 0, 1.0, 1)
    assert _policy("fcfs").key(early) < _policy("fcfs").key(late)
    assert _policy("priority").key(late) < _policy("priority").key(early)


# -- SamplingParams ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"stop": ["a"] * 65}, "stop"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": True}, "n"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 10**400}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges():
    sp = SamplingParams(
        max_tokens=1, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=0, stop="x"
    )
    assert sp.stop == ["x"] and sp.greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    for seed in (2**63 - 1, -(2**63)):
        assert SamplingParams(seed=seed).seed == seed
    SamplingParams(repetition_penalty=100.0, stop=["a"] * 64, stop_token_ids=list(range(1024)))
    SamplingParams(repetition_penalty=1e-6)


def test_error_messages_stay_short_for_huge_values():
    with pytest.raises(ValueError, match=r"^seed .*, got an integer of 1329 bits$"):
        SamplingParams(seed=10**400)
    with pytest.raises(ValueError, match=r"got a list of 2000 items$"):
        SamplingParams(stop=["x"] * 2000)


# -- configs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_num_partial_prefills"]
)
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_scheduler_config_non_positive_ints(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SchedulerConfig(**{field: value})


def test_scheduler_config_negative_threshold():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policy", "lifo"),
        ("preemption_mode", "kill"),
        ("scheduling_order", "random"),
        ("policy", "FCFS"),
    ],
)
def test_scheduler_config_bad_choice(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be one of"):
        SchedulerConfig(**{field: value})


def test_scheduler_config_no_chunking_needs_budget_for_a_whole_request():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200)
    SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=200, max_model_len=200)
    SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=100, max_model_len=200)


@pytest.mark.parametrize("field", ["block_size", "num_gpu_blocks"])
@pytest.mark.parametrize("value", [0, -4])
def test_cache_config_non_positive_ints(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        CacheConfig(**{field: value})


def test_cache_config_negative_cpu_blocks():
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CacheConfig(num_cpu_blocks=-1)
    assert CacheConfig(num_cpu_blocks=0).num_cpu_blocks == 0


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().max_num_seqs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().block_size = 3  # type: ignore[misc]


def test_prefill_chunk_cap_defaults():
    assert SchedulerConfig().prefill_chunk_cap == 0
    assert SchedulerConfig(max_num_partial_prefills=2, max_model_len=8192).prefill_chunk_cap == 327
    assert SchedulerConfig(max_num_partial_prefills=4, max_model_len=1000).prefill_chunk_cap == 40
    # Never 0 when it applies, even for tiny models.
    assert SchedulerConfig(max_num_partial_prefills=2, max_model_len=10).prefill_chunk_cap == 1
    # An explicit threshold wins either way.
    assert SchedulerConfig(long_prefill_token_threshold=64).prefill_chunk_cap == 64
    both = SchedulerConfig(max_num_partial_prefills=2, long_prefill_token_threshold=64)
    assert both.prefill_chunk_cap == 64
