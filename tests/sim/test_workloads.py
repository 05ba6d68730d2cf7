"""Trace loading (shipped and files), BlockPrompt, synthetic workloads and length specs."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvloop.sim.traces import (
    SHIPPED_TRACES,
    BlockPrompt,
    TraceFormatError,
    load_trace,
    trace_lengths,
)
from kvloop.sim.workloads import (
    LengthSpec,
    apply_priority_mix,
    parse_length_spec,
    parse_priority_mix,
    synthetic_workload,
)


def _monotonic(reqs) -> bool:
    return all(a.arrival_time <= b.arrival_time for a, b in itertools.pairwise(reqs))


# -- shipped traces -----------------------------------------------------------------------


def test_azure_conv_loads_whole_trace():
    reqs = load_trace("azure-conv")
    assert len(reqs) == 19_366
    assert reqs[0].arrival_time == 0.0
    assert _monotonic(reqs)
    assert 3000 < reqs[-1].arrival_time < 3700  # about one hour
    assert (len(reqs[0].prompt_token_ids), reqs[0].output_len) == (374, 44)
    assert len({r.request_id for r in reqs}) == len(reqs)
    # Unique prompts: no two requests share a first 16-token block.
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == len(reqs)
    assert all(isinstance(r.prompt_token_ids, range) for r in reqs)


@pytest.mark.parametrize("name", sorted(SHIPPED_TRACES))
def test_every_shipped_trace_loads(name):
    reqs = load_trace(name, num_requests=50)
    assert len(reqs) == 50
    assert reqs[0].arrival_time == 0.0 and _monotonic(reqs)
    assert all(len(r.prompt_token_ids) >= 1 and r.output_len >= 1 for r in reqs)
    assert len(trace_lengths(name)) > 3000


def test_rate_scale_and_num_requests():
    base = load_trace("azure-code", num_requests=100)
    fast = load_trace("azure-code", num_requests=100, rate_scale=2.0)
    assert len(base) == 100
    for a, b in zip(base, fast, strict=True):
        assert b.arrival_time == pytest.approx(a.arrival_time / 2)
    with pytest.raises(ValueError):
        load_trace("azure-code", rate_scale=0)


def test_sharegpt_arrivals():
    at_once = load_trace("sharegpt", num_requests=200)
    assert {r.arrival_time for r in at_once} == {0.0}
    assert (len(at_once[0].prompt_token_ids), at_once[0].output_len) == (74, 918)
    poisson = load_trace("sharegpt", num_requests=2000, request_rate=10.0, seed=3)
    assert poisson == load_trace("sharegpt", num_requests=2000, request_rate=10.0, seed=3)
    assert poisson[-1].arrival_time / 1999 == pytest.approx(0.1, rel=0.1)


def test_mooncake_prefix_reuse():
    reqs = load_trace("mooncake")
    assert len(reqs) == 3993
    assert reqs[2].arrival_time == pytest.approx(0.040)
    first_block: dict[int, tuple] = {}
    seen_blocks: set[tuple] = set()
    shared = distinct = 0
    for r in reqs[:120]:
        p = r.prompt_token_ids
        assert isinstance(p, BlockPrompt)
        for b, h in enumerate(p._hash_ids):
            if (b + 1) * 512 > len(p):
                break
            block = tuple(p[b * 512 : (b + 1) * 512])
            if h in first_block:
                assert first_block[h] == block
                shared += 1
            else:
                assert block not in seen_blocks  # different ids, different tokens
                first_block[h] = block
                seen_blocks.add(block)
                distinct += 1
    assert shared > 0 and distinct > 0


def test_block_prompt_matches_materialised_list():
    bp = BlockPrompt([7, 3, 7], length=3 * 512 + 100, tail_base=10_000, block_size=512)
    full = [h * 512 + j for h in (7, 3, 7) for j in range(512)] + list(range(10_000, 10_100))
    assert len(bp) == len(full) and list(bp) == full
    for sl in [
        slice(0, 16),
        slice(500, 530),
        slice(1000, 1700),
        slice(-50, None),
        slice(1530, 1560),
        slice(None, None, 7),
        slice(10, 5),
        slice(-3000, 20),
    ]:
        assert list(bp[sl]) == full[sl], sl
    assert isinstance(bp[520:600], range)
    assert bp[0:16] == bp[1024:1040]  # equal hash ids, equal ids
    assert bp[-1] == full[-1] and bp[513] == full[513]
    with pytest.raises(IndexError):
        bp[len(full)]
    partial = BlockPrompt([1, 2], length=600)
    assert list(partial) == [512 + j for j in range(512)] + [1024 + j for j in range(88)]


@given(
    hash_ids=st.lists(st.integers(0, 5), max_size=5),
    extra=st.integers(-7, 9),
    start=st.integers(-40, 40),
    stop=st.integers(-40, 40) | st.none(),
    step=st.sampled_from([None, 1, 2, -1]),
)
def test_block_prompt_slices_property(hash_ids, extra, start, stop, step):
    length = max(0, len(hash_ids) * 8 + extra)
    bp = BlockPrompt(hash_ids, length, tail_base=1000, block_size=8)
    full = [h * 8 + j for h in hash_ids for j in range(8)][:length]
    full += range(1000, 1000 + length - len(full))
    assert list(bp) == full and len(bp) == length
    assert list(bp[start:stop:step]) == full[start:stop:step]


# -- malformed trace files ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n"
            "2023-11-16 18:15:47.1,12,abc\n",
            "bad.csv:3: GeneratedTokens is not an integer: 'abc'",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n", "bad.csv:2: TIMESTAMP"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,5\n",
            "bad.csv:2: ContextTokens is 0",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10\n",
            "bad.csv:2: expected",
        ),
        (
            "num_prefill_tokens,num_decode_tokens\n5,6\n-3,4\n",
            "bad.csv:3: num_prefill_tokens is neg",
        ),
        ("a,b,c\n1,2,3\n", "bad.csv:1: unknown trace header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "bad.csv: trace has no requests"),
        ("", "bad.csv: trace has no requests"),
    ],
)
def test_malformed_csv(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_trace("bad.csv")
    assert message in str(info.value)


def test_malformed_jsonl(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    lines = [json.dumps(good), "{not json", json.dumps({**good, "hash_ids": ["x"]})]
    for bad_line, what in [(1, "not valid JSON"), (2, "hash_ids")]:
        (tmp_path / "t.jsonl").write_text("\n".join([lines[0], lines[bad_line]]) + "\n")
        with pytest.raises(TraceFormatError) as info:
            load_trace("t.jsonl")
        assert f"t.jsonl:2: {what}" in str(info.value)
    (tmp_path / "t.jsonl").write_text(json.dumps({**good, "output_length": 2.5}))
    with pytest.raises(TraceFormatError) as info:
        load_trace("t.jsonl")
    assert "t.jsonl:1: output_length is not an integer: 2.5" in str(info.value)


def test_trace_files_and_gzip(tmp_path):
    csv_text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.5000000,10,0\n2023-11-17 00:00:01.2500000,20,4\n"
    )
    path = tmp_path / "day.csv.gz"
    path.write_bytes(gzip.compress(csv_text.encode()))
    reqs = load_trace(str(path))
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 1.75])
    assert [r.output_len for r in reqs] == [1, 4]  # output 0 clamped to 1
    rows = [{"timestamp": 1500, "input_length": 5, "output_length": 2, "hash_ids": [4]}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (req,) = load_trace(str(tmp_path / "m.jsonl"))
    assert req.arrival_time == 0.0 and list(req.prompt_token_ids) == list(range(2048, 2053))


def test_unknown_trace_name_lists_shipped():
    with pytest.raises(ValueError, match="azure-conv") as info:
        load_trace("no-such-trace")
    assert not isinstance(info.value, TraceFormatError)


# -- synthetic workloads ------------------------------------------------------------------


def test_synthetic_deterministic_and_rate():
    kw = {"request_rate": 4.0, "prompt_len": "128:1024", "output_len": "64"}
    a = synthetic_workload(4000, seed=1, **kw)
    assert a == synthetic_workload(4000, seed=1, **kw)
    assert a != synthetic_workload(4000, seed=2, **kw)
    assert a[0].arrival_time == 0.0 and _monotonic(a)
    assert a[-1].arrival_time / 3999 == pytest.approx(0.25, rel=0.05)
    assert all(128 <= len(r.prompt_token_ids) <= 1024 and r.output_len == 64 for r in a)
    assert len({r.prompt_token_ids[0] for r in a}) == len(a)
    # Same seed, other rate: same lengths.
    b = synthetic_workload(4000, seed=1, **{**kw, "request_rate": 40.0})
    assert [len(r.prompt_token_ids) for r in a] == [len(r.prompt_token_ids) for r in b]


def test_burstiness_and_infinite_rate():
    def gaps(burstiness: float) -> list[float]:
        reqs = synthetic_workload(
            3000, request_rate=2.0, burstiness=burstiness, prompt_len=8, output_len=8
        )
        return [b.arrival_time - a.arrival_time for a, b in itertools.pairwise(reqs)]

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert statistics.mean(bursty) == pytest.approx(0.5, rel=0.15)
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(poisson)
    flat = synthetic_workload(10, request_rate=math.inf, prompt_len="4", output_len="4")
    assert {r.arrival_time for r in flat} == {0.0}


def test_trace_lengths_drawn_as_pairs():
    pairs = set(trace_lengths("sharegpt"))
    reqs = synthetic_workload(
        300, request_rate=1.0, prompt_len="trace:sharegpt", output_len="trace:sharegpt"
    )
    assert all((len(r.prompt_token_ids), r.output_len) in pairs for r in reqs)
    capped = synthetic_workload(
        300, request_rate=1.0, prompt_len="trace:sharegpt@512", output_len="trace:azure-conv"
    )
    assert max(len(r.prompt_token_ids) for r in capped) <= 512


def test_parse_length_spec():
    assert parse_length_spec("512") == LengthSpec(512, 512)
    assert parse_length_spec(" 128:1024 ") == LengthSpec(128, 1024)
    assert parse_length_spec("trace:mooncake@2048") == LengthSpec(trace="mooncake", cap=2048)
    assert str(parse_length_spec("trace:sharegpt")) == "trace:sharegpt"
    assert parse_length_spec(7) == LengthSpec(7, 7)
    for bad in ["", "abc", "0", "10:5", "1:2:3", "trace:nope", "trace:sharegpt@x", "-4"]:
        with pytest.raises(ValueError, match="bad length spec"):
            parse_length_spec(bad)


def test_priority_mix():
    assert parse_priority_mix("0:0.2, 1:0.8") == {0: 0.2, 1: 0.8}
    for bad in ["", "0", "a:1", "0:x", "0:-1", "0:0", "0:1,0:2", f"{2**63}:1"]:
        with pytest.raises(ValueError, match="priority mix"):
            parse_priority_mix(bad)
    reqs = synthetic_workload(2000, request_rate=1.0, prompt_len=4, output_len=4)
    apply_priority_mix(reqs, {0: 0.2, 1: 0.8}, seed=5)
    prios = [r.priority for r in reqs]
    assert set(prios) == {0, 1} and prios.count(0) / len(prios) == pytest.approx(0.2, abs=0.04)
    again = synthetic_workload(2000, request_rate=1.0, prompt_len=4, output_len=4)
    apply_priority_mix(again, {0: 0.2, 1: 0.8}, seed=5)
    assert [r.priority for r in again] == prios
