"""inference-perf configs as workloads: the parser, shared prefixes, stages, per-stage figures
and ``kvloop simulate --workload``."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from kvloop.cli import main
from kvloop.sim.inference_perf import Stage, load_inference_perf, workload_from_config
from kvloop.sim.stages import OVERLOAD_WAIT_S, format_stages, stage_summaries, stage_summary


def _shared(groups: int = 3, per_group: int = 2, *, old_names: bool = False,
            system: int = 32, stages: list[dict[str, Any]] | None = None,
            **extra: Any) -> dict[str, Any]:
    names = (("num_unique_system_prompts", "num_users_per_system_prompt") if old_names
             else ("num_groups", "num_prompts_per_group"))
    sp = {names[0]: groups, names[1]: per_group, "system_prompt_len": system,
          "question_len": 8, "output_len": 4, **extra}
    return {"data": {"type": "shared_prefix", "shared_prefix": sp},
            "load": {"type": "constant",
                     "stages": stages or [{"rate": 10, "duration": 2}]}}


def _random(kind: str = "random", n_rate: float = 100, duration: float = 10,
            inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    return {"data": {"type": kind,
                     "input_distribution": inputs or {"mean": 100, "std_dev": 30, "min": 10,
                                                      "max": 200},
                     "output_distribution": outputs or {"mean": 50}},
            "load": {"type": "constant", "stages": [{"rate": n_rate, "duration": duration}]}}


def _prompts(workload) -> list[list[int]]:
    return [list(r.prompt_token_ids) for r in workload.requests]


# -- data: shared prefix ----------------------------------------------------------------------


def test_both_spellings_of_the_shared_prefix_fields_give_one_workload():
    new = workload_from_config(_shared(), seed=3)
    old = workload_from_config(_shared(old_names=True), seed=3)
    assert new.kind == old.kind == "shared_prefix"
    assert _prompts(new) == _prompts(old)
    assert [r.output_len for r in new.requests] == [r.output_len for r in old.requests]
    assert len({tuple(p) for p in _prompts(new)}) == 3 * 2


def test_a_group_shares_its_system_prompt_and_a_repeated_prompt_is_identical():
    w = workload_from_config(_shared(groups=3, per_group=2, system=32), seed=1)
    prompts = _prompts(w)
    assert len(prompts) == 20 and all(len(p) == 32 + 8 for p in prompts)
    systems: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for p in prompts:
        systems.setdefault(tuple(p[:32]), set()).add(tuple(p[32:]))
    # three system prompts, each shared by its group's two questions
    assert len(systems) == 3 and all(len(q) == 2 for q in systems.values())
    # no question shares tokens with another question or with a system prompt
    questions = [q for qs in systems.values() for q in qs]
    tokens = [t for q in questions for t in q] + [t for s in systems for t in s]
    assert len(tokens) == len(set(tokens))
    # the 6 prompts are sent in one order, cycling: request i repeats request i - 6 exactly
    for i in range(6, 20):
        assert prompts[i] == prompts[i - 6]
    assert len({tuple(p) for p in prompts[:6]}) == 6


def test_shared_prefix_lengths_may_vary():
    w = workload_from_config(_shared(groups=10, per_group=10, question_len_std=4,
                                     question_len_min=5, question_len_max=12,
                                     output_len=30, output_len_std=10,
                                     stages=[{"rate": 100, "duration": 1}]))
    questions = [len(r.prompt_token_ids) - 32 for r in w.requests]
    outputs = [r.output_len for r in w.requests]
    assert min(questions) >= 5 and max(questions) <= 12 and len(set(questions)) > 3
    assert min(outputs) >= 1 and len(set(outputs)) > 5
    assert 25 < statistics.fmean(outputs) < 35


def test_without_a_system_prompt_every_prompt_is_its_question():
    w = workload_from_config(_shared(system=0))
    assert all(len(r.prompt_token_ids) == 8 for r in w.requests)


# -- data: random / synthetic -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "synthetic"])
def test_random_lengths_follow_their_distribution(kind):
    w = workload_from_config(_random(kind), seed=5)
    assert w.kind == kind and len(w.requests) == 1000
    ins = [len(r.prompt_token_ids) for r in w.requests]
    assert min(ins) >= 10 and max(ins) <= 200
    assert 95 < statistics.fmean(ins) < 105 and 25 < statistics.stdev(ins) < 35
    assert {r.output_len for r in w.requests} == {50}  # no std_dev: every draw is the mean
    tokens = [t for p in _prompts(w) for t in p]
    assert len(tokens) == len(set(tokens))  # every prompt unique: no prefix hits


def test_random_lengths_are_clipped_to_min_and_max_and_std_is_an_alias():
    w = workload_from_config(_random(inputs={"mean": 100, "std": 50, "min": 60, "max": 80}),
                             seed=2)
    ins = [len(r.prompt_token_ids) for r in w.requests]
    assert min(ins) == 60 and max(ins) == 80
    unbounded = workload_from_config(_random(inputs={"mean": 100, "std_dev": 20}), seed=2)
    # no max: the draws are not cut at the mean
    assert max(len(r.prompt_token_ids) for r in unbounded.requests) > 130


def test_the_seed_decides_the_draws():
    a, b = (workload_from_config(_random(), seed=s) for s in (0, 1))
    again = workload_from_config(_random(), seed=0)
    assert _prompts(a) == _prompts(again)
    assert [len(p) for p in _prompts(a)] != [len(p) for p in _prompts(b)]


# -- load: stages -----------------------------------------------------------------------------


def test_constant_stages_are_rate_times_duration_evenly_spaced():
    stages = [{"rate": 2, "duration": 3}, {"rate": 5, "duration": 2}, {"rate": 0.5,
                                                                      "duration": 4}]
    w = workload_from_config(_shared(stages=stages))
    assert w.stages == [Stage(2.0, 3.0, 0.0), Stage(5.0, 2.0, 3.0), Stage(0.5, 4.0, 5.0)]
    assert w.stages[-1].end_s == 9.0
    assert w.stage_of == [0] * 6 + [1] * 10 + [2] * 2
    times = [r.arrival_time for r in w.requests]
    expected = [i / 2 for i in range(6)] + [3 + i / 5 for i in range(10)] + [5, 7]
    assert times == pytest.approx(expected)
    assert len({r.request_id for r in w.requests}) == len(w.requests)


def test_poisson_stages_stay_in_their_windows_with_about_rate_times_duration():
    config = _shared(stages=[{"rate": 200, "duration": 5}, {"rate": 20, "duration": 10}])
    config["load"]["type"] = "poisson"
    w = workload_from_config(config, seed=7)
    counts = [w.stage_of.count(k) for k in range(2)]
    assert abs(counts[0] - 1000) < 4 * math.sqrt(1000)
    assert abs(counts[1] - 200) < 4 * math.sqrt(200)
    for r, k in zip(w.requests, w.stage_of, strict=True):
        assert w.stages[k].start_s <= r.arrival_time < w.stages[k].end_s
    times = [r.arrival_time for r in w.requests]
    assert times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times[:counts[0]])]
    assert statistics.stdev(gaps) > 0.5 * statistics.fmean(gaps)  # exponential, not even
    other = workload_from_config(config, seed=8)
    assert [r.arrival_time for r in other.requests] != times


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_yaml_and_json_files_give_the_config_s_workload(tmp_path, suffix):
    config = _shared(stages=[{"rate": 4, "duration": 2}, {"rate": 8, "duration": 1}])
    path = tmp_path / f"ip{suffix}"
    path.write_text(json.dumps(config) if suffix == ".json" else yaml.safe_dump(config))
    w = load_inference_perf(path, seed=4)
    direct = workload_from_config(config, seed=4)
    assert _prompts(w) == _prompts(direct) and w.stage_of == direct.stage_of == [0] * 8 + [1] * 8


@pytest.mark.parametrize("name, text, needle", [
    ("missing.yaml", None, "cannot read the workload file"),
    ("bad.yaml", "data: [1, 2\nload: 3\n", "bad.yaml:2: not YAML"),
    ("bad.json", '{"data": 1,}', "bad.json:1: not JSON"),
    ("empty.yaml", "", "mapping with 'data' and 'load'"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, text, needle):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=r"^[^\n]*$") as info:
        load_inference_perf(path)
    assert needle in str(info.value) and name in str(info.value)


def _set(config: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is _DROP:
        del node[last]
    else:
        node[last] = value
    return config


_DROP = object()


@pytest.mark.parametrize("make, dotted, value, needle", [
    (_shared, "load", _DROP, "'load' must be a mapping"),
    (_shared, "data", "shared_prefix", "'data' must be a mapping"),
    (_shared, "load.stages", [], "load.stages must be a non-empty list"),
    (_shared, "load.stages.0", 5, "load.stages[0] must be a mapping"),
    (_shared, "load.stages.0.rate", -1, "load.stages[0]: 'rate' must be a finite number > 0"),
    (_shared, "load.stages.0.rate", math.inf, "'rate' must be a finite number"),
    (_shared, "load.stages.0.duration", "10s", "load.stages[0]: 'duration'"),
    (_shared, "load.type", "burst", "load.type 'burst' is not supported"),
    (_shared, "data.type", "mock", "data.type 'mock' is not supported"),
    (_shared, "data.shared_prefix.question_len", _DROP, "data.shared_prefix: 'question_len'"),
    (_shared, "data.shared_prefix.num_groups", 0, "'num_groups' must be a finite number >= 1"),
    (_shared, "data.shared_prefix.output_len", True, "'output_len'"),
    (_random, "data.output_distribution", _DROP, "data: 'output_distribution' must be a map"),
    (_random, "data.input_distribution.max", 5, "data.input_distribution: 'max' must be"),
    (_random, "data.input_distribution.mean", math.nan, "input_distribution: 'mean'"),
    (_random, "data.output_distribution.stdev", 5, "data.output_distribution: unknown field "
     "'stdev'; the fields read here are max, mean, min, std, std_dev, total_count"),
    (_shared, "data.shared_prefix.question_lenn", 5, "data.shared_prefix: unknown field "
     "'question_lenn'"),
])
def test_bad_config_is_a_value_error_naming_the_field(make, dotted, value, needle):
    config = _set(make(), dotted, value)
    with pytest.raises(ValueError) as info:
        workload_from_config(config, where="ip.yaml")
    assert needle in str(info.value) and str(info.value).startswith("ip.yaml: ")


def test_a_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(ValueError, match="a mapping with 'data' and 'load'"):
        workload_from_config([1, 2])


# -- per-stage figures ------------------------------------------------------------------------


def _done(rid: str, arrival: float, ttft: float, n_out: int, gap: float,
          status: str = "FINISHED_LENGTH") -> SimpleNamespace:
    first = arrival + ttft
    times = [first + i * gap for i in range(n_out)]
    return SimpleNamespace(request_id=rid, arrival_time=arrival, first_token_time=first,
                           token_times=times, finished_time=times[-1],
                           output_token_ids=[0] * n_out, status=status)


def test_stage_summary_figures():
    stage = Stage(rate=2.0, duration_s=10.0, start_s=5.0)
    reqs = [_done(f"r{i}", 5 + i * 0.5, 0.1 * (i + 1), 11, 0.02) for i in range(20)]
    reqs.append(SimpleNamespace(request_id="gone", arrival_time=6.0, first_token_time=None,
                                token_times=[], finished_time=6.0, output_token_ids=[],
                                status="FINISHED_ABORTED"))
    row = stage_summary(stage, reqs)
    assert (row["rate"], row["start_s"], row["duration_s"]) == (2.0, 5.0, 10.0)
    assert row["requests"] == 21 and row["completed"] == 20
    ttfts = [0.1 * (i + 1) for i in range(20)]
    assert row["ttft_mean"] == pytest.approx(statistics.fmean(ttfts))
    assert row["ttft_p50"] == pytest.approx(1.0) and row["ttft_p90"] == pytest.approx(1.8)
    assert row["e2e_mean"] == pytest.approx(statistics.fmean(ttfts) + 0.2)
    assert row["e2e_p50"] == pytest.approx(1.2)
    assert row["output_len_median"] == 11
    assert row["decode_per_token"] == pytest.approx(0.02)
    span = (5 + 19 * 0.5 + 2.0 + 0.2) - 5  # first arrival to last token
    assert row["output_tokens"] == 220
    assert row["output_throughput"] == pytest.approx(220 / span)
    # first tenth (2 requests) waits 0.15 s on average, last tenth 1.95 s
    assert row["ttft_growth"] == pytest.approx(1.8) and row["overloaded"] is False
    assert stage_summary(stage, reqs, output_len=6)["decode_per_token"] == pytest.approx(0.04)


def test_overloaded_when_the_last_tenth_waits_ten_seconds_longer():
    stage = Stage(rate=10.0, duration_s=10.0, start_s=0.0)

    def row(extra_wait: float) -> dict[str, Any]:
        # waits grow linearly: the last tenth waits extra_wait longer than the first
        reqs = [_done(f"r{i}", i / 10, 0.05 + extra_wait * i / 90, 5, 0.01) for i in range(100)]
        return stage_summary(stage, reqs)

    over, under = row(OVERLOAD_WAIT_S * 1.2), row(OVERLOAD_WAIT_S * 0.8)
    assert over["overloaded"] is True and under["overloaded"] is False
    assert over["ttft_growth"] > OVERLOAD_WAIT_S > under["ttft_growth"]


def test_a_stage_without_completed_requests_has_no_figures():
    row = stage_summary(Stage(1.0, 1.0, 0.0), [])
    assert row["requests"] == row["completed"] == 0
    assert row["ttft_mean"] is None and row["overloaded"] is None
    assert "-" in format_stages([row]).splitlines()[2]


def test_stage_summaries_group_requests_by_the_stage_they_arrived_in():
    w = workload_from_config(_shared(stages=[{"rate": 2, "duration": 2},
                                             {"rate": 3, "duration": 1}]))
    reqs = [_done(r.request_id, r.arrival_time, 0.1, 4, 0.01) for r in w.requests]
    reqs.append(_done("not-in-the-workload", 0.0, 0.1, 4, 0.01))
    rows = stage_summaries(reversed(reqs), w)  # any order
    assert [(r["requests"], r["rate"]) for r in rows] == [(4, 2.0), (3, 3.0)]
    table = format_stages(rows)
    assert len(table.splitlines()) == 2 + len(rows) + 1 and "Overloaded" in table


# -- kvloop simulate --workload ---------------------------------------------------------------


_LIGHT_THEN_HEAVY = """\
data:
  type: shared_prefix
  shared_prefix:
    num_groups: 2
    num_prompts_per_group: 4
    system_prompt_len: 256
    question_len: 64
    output_len: 200
load:
  type: constant
  stages:
    - rate: 1
      duration: 4
    - rate: 40
      duration: 3
"""
"""One request at a time (``--max-num-seqs 1``) on smollm2-135m serves about 3 requests/s:
the first stage is light, the second far beyond capacity."""


def test_simulate_workload_reports_each_stage(tmp_path, capsys):
    config, out = tmp_path / "ip.yaml", tmp_path / "out.json"
    config.write_text(_LIGHT_THEN_HEAVY)
    rc = main(["simulate", "--workload", str(config), "--model", "smollm2-135m",
               "--max-num-seqs", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "inference-perf, shared_prefix, 2 stages" in text and " Stages " in text
    m = json.loads(out.read_text())
    assert m["config"]["workload"] == str(config) and m["completed"] == 4 + 120
    light, heavy = m["stages"]
    assert (light["rate"], light["duration_s"], light["requests"]) == (1.0, 4.0, 4)
    assert (heavy["rate"], heavy["duration_s"], heavy["requests"]) == (40.0, 3.0, 120)
    for s in (light, heavy):
        assert s["completed"] == s["requests"]
        assert 0 < s["ttft_p50"] <= s["ttft_p90"] and s["ttft_mean"] < s["e2e_mean"]
        assert s["output_len_median"] == 200 and s["output_tokens"] == 200 * s["requests"]
        assert s["decode_per_token"] == pytest.approx(m["tpot"]["p50"], rel=0.05)
        assert s["output_throughput"] > 0
    assert light["overloaded"] is False and light["ttft_mean"] < 0.1
    assert heavy["overloaded"] is True and heavy["ttft_growth"] > OVERLOAD_WAIT_S
    assert heavy["ttft_mean"] > 10 * light["e2e_mean"]
    # requests of a group share their system prompt, and prompts repeat: the cache hits
    assert m["scheduler"]["prefix_cache_hit_rate"] > 0.8
    rows = [line.split() for line in text.splitlines() if line.startswith("    ")]
    assert [r[-1] for r in rows[-2:]] == ["no", "yes"]


@pytest.mark.parametrize("extra, text, needle", [
    ([], "data: [1, 2\nload: 3\n", "ip.yaml:2: not YAML"),
    ([], "data: {type: mock}\nload: {stages: [{rate: 1, duration: 1}]}\n", "ip.yaml: data.type"),
    (["--trace", "azure-conv"], _LIGHT_THEN_HEAVY, "not with --trace"),
    (["--num-requests", "5", "--rate-scale", "2"], _LIGHT_THEN_HEAVY,
     "not with --num-requests, --rate-scale"),
])
def test_simulate_workload_errors_are_one_line_and_exit_2(tmp_path, capsys, extra, text,
                                                          needle):
    config = tmp_path / "ip.yaml"
    config.write_text(text)
    rc = main(["simulate", "--workload", str(config), "--model", "smollm2-135m", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_config_asking_for_too_many_requests_is_refused() -> None:
    from kvloop.sim.inference_perf import MAX_REQUESTS, workload_from_config

    config = {"data": {"type": "random", "input_distribution": {"mean": 10},
                       "output_distribution": {"mean": 10}},
              "load": {"type": "constant", "stages": [{"rate": 1e6, "duration": 600}]}}
    with pytest.raises(ValueError, match=f"at most {MAX_REQUESTS:,}"):
        workload_from_config(config)
