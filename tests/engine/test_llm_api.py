"""The offline API end to end on a tiny real model: LLM.generate / chat, sampling, errors."""

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvloop import SamplingParams  # noqa: E402
from kvloop.core import read_jsonl  # noqa: E402
from kvloop.engine.llm import LLM  # noqa: E402
from server.serverkit import ENGINE_ARGS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE_ARGS)


def _hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def test_generate_matches_transformers_and_reports_timing(llm: LLM, model_dir: Path):
    prompts = ["the quick brown fox", "hello world, how are you", "numbers 0123"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert o.token_ids == _hf_greedy(model_dir, o.prompt_token_ids, 8)
        assert o.finish_reason == "length" and o.text == llm.get_tokenizer().decode(o.token_ids)
        m = o.metrics
        assert 0 <= m.queue_time <= m.ttft <= m.e2e and m.tpot is not None
    assert llm.engine.scheduler.kv.num_used_blocks == 0


def test_chat_and_token_id_prompts(llm: LLM):
    outs = llm.chat(
        [{"role": "user", "content": "hello"}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(outs) == 1 and len(outs[0].token_ids) == 4
    ids = llm.get_tokenizer().encode("the lazy dog")
    (out,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.prompt_token_ids == ids


def test_sampling_seeds(llm: LLM):
    def run(seed, **kw):
        p = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True, **kw)
        return llm.generate(["the quick"], p, use_tqdm=False)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)
    greedy = llm.generate(
        ["the quick"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert run(3, top_k=1) == greedy[0].token_ids


def test_logprobs_and_stop_strings(llm: LLM):
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    (out,) = llm.generate(["hello world"], p, use_tqdm=False)
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and all(v <= 0 for v in lp.values())
    full = out.text
    if len(full) > 2:
        stop = full[1:3]
        (cut,) = llm.generate(
            ["hello world"],
            SamplingParams(temperature=0, max_tokens=6, stop=[stop], ignore_eos=True),
            use_tqdm=False,
        )
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert full.startswith(cut.text)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ("the " * 300, SamplingParams(), "max_model_len"),
        ("hello", SamplingParams(max_tokens=250), "max_tokens"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm: LLM, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_used_blocks == 0
    (ok,) = llm.generate(["fine prompt"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert ok.finished


@pytest.mark.parametrize("priority", [1, "0", [0]])
def test_priority_is_one_integer_per_prompt(llm: LLM, priority):
    with pytest.raises(ValueError, match="priority") as err:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=priority,
                     use_tqdm=False)
    assert err.value.field == "priority"
    assert not llm.engine.has_unfinished_requests()


def test_bad_params_name_the_field():
    for kw, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.2}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="no_such_knob"):
        LLM("default", no_such_knob=1)


def test_trace_out_records_the_run(model_dir: Path, tmp_path: Path):
    path = tmp_path / "steps.jsonl"
    llm = LLM(str(model_dir), trace_out=str(path), **ENGINE_ARGS)
    llm.generate(["a b c", "d e"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    llm.close()
    records = read_jsonl(str(path))
    assert sum(len(r.finished) for r in records) == 2
    assert sum(len(r.sampled) for r in records) == 6
