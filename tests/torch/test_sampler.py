"""Sampler: greedy, penalties, temperature / top-k / top-p / min-p, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from kvloop.executor.torch.sampler import Sampler, SamplingState, apply_penalties
from kvloop.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def state(prompt: list[int] | None = None, out: list[int] | None = None, **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt or [0], list(out or []))


def rand_logits(n: int, v: int, seed: int, device: torch.device, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * scale).to(device)


def draw_counts(sampler: Sampler, row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Token counts of ``n`` unseeded draws of one logits row (one batch of n rows)."""
    tokens, _ = sampler.sample(row.expand(n, -1).contiguous(), [state(**kw)] * n)
    return torch.bincount(torch.tensor(tokens), minlength=row.shape[-1])


# -- greedy -------------------------------------------------------------------------------------
def test_greedy_is_argmax(device):
    logits = rand_logits(6, 50, 0, device)
    tokens, lps = Sampler(50, device).sample(logits, [state(temperature=0.0) for _ in range(6)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 6


def test_greedy_ties_as_torch_and_no_token_from_nan(device):
    """Greedy picks the first of equal maxima, as torch's argmax does (on CPU the sampler
    takes kvloop's kernel or numpy's), on both paths; a row holding a NaN gets no token (None)
    and leaves the other rows alone; bfloat16 logits and a padded, strided vocabulary too."""
    import kvloop.executor.torch.sampler as sampler_mod

    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, 2.0, 0.0], [1.0, nan, 5.0, nan, 0.0], [-inf] * 5,
            [0.0, 0.0, 0.0, 0.0, 7.0], [2.0, -1.0, inf, inf, 0.0], [nan] * 5]
    for dtype in (torch.float32, torch.bfloat16):
        padded = torch.tensor([[*r, 9.0] for r in rows], dtype=dtype, device=device)
        tokens, _ = Sampler(5, device).sample(padded, [state(temperature=0.0)] * len(rows))
        assert tokens == [1, None, 0, 4, 2, None]
        expected = padded[:, :5].float().argmax(-1).tolist()
        assert [t for t in tokens if t is not None] == [expected[i] for i in (0, 2, 3, 4)]
        full, lps = Sampler(5, device).sample(  # the full path: logprobs asked for
            padded, [state(temperature=0.0, logprobs=1)] * len(rows))
        assert full == tokens and len(lps) == len(rows)
    real = sampler_mod._argmax_only
    try:
        sampler_mod._argmax_only = lambda s: False
        assert Sampler(5, device).sample(padded, [state(temperature=0.0)] * len(rows))[0] == (
            tokens)
    finally:
        sampler_mod._argmax_only = real


def test_random_rows_with_nan_get_no_token(device):
    """A sampled row whose logits hold a NaN, or whose probabilities do (+inf logits), gets
    None; the greedy and sampled rows beside it are drawn as without it."""
    nan, inf = float("nan"), float("inf")
    logits = rand_logits(5, 12, 3, device)
    bad = logits.clone()
    bad[1, 4] = nan
    bad[3, 7] = inf
    states = [state(temperature=0.0), state(seed=5), state(seed=6), state(seed=7, top_p=0.9),
              state(seed=8, min_p=0.1)]
    sampler = Sampler(12, device)
    good = sampler.sample(logits, states)[0]
    tokens, _ = sampler.sample(bad, states)
    assert tokens == [good[0], None, good[2], None, good[4]]
    assert all(isinstance(t, int) for t in good)


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-38, 1e-45, 5e-324])
def test_tiny_temperatures_are_greedy(device, temperature):
    """Below ``GREEDY_TEMPERATURE`` a request samples greedily (as vLLM), where dividing the
    logits by the temperature would overflow them; the ones just above still sample."""
    from kvloop.sampling_params import GREEDY_TEMPERATURE

    logits = rand_logits(3, 40, 4, device, scale=20.0)
    tokens, _ = Sampler(40, device).sample(logits, [state(temperature=temperature, seed=1)] * 3)
    assert tokens == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    near, _ = Sampler(40, device).sample(logits, [state(temperature=GREEDY_TEMPERATURE)] * 3)
    assert near == logits.argmax(-1).tolist()  # scale 20: the top token wins at once


def test_plain_greedy_takes_one_argmax_call(device, monkeypatch):
    """A step whose rows are all plain greedy (no penalty, no logprobs, no min_tokens mask)
    goes straight to the argmax; a row with any of those takes the full path, and both pick
    the same token where they must."""
    import kvloop.executor.torch.sampler as sampler_mod

    logits = rand_logits(4, 64, 5, device)
    sampler = Sampler(64, device)
    full = []
    real = sampler_mod.apply_penalties
    monkeypatch.setattr(sampler_mod, "apply_penalties",
                        lambda x, states: full.append(len(states)) or real(x, states))
    plain, lps = sampler.sample(logits, [state(temperature=0.0)] * 4)
    assert full == [] and lps == [None] * 4
    assert plain == logits.argmax(-1).tolist()
    for kw in ({"logprobs": 2}, {"repetition_penalty": 1.0, "presence_penalty": 0.5},
               {"min_tokens": 3, "stop_token_ids": [7]}):
        st = [state(temperature=0.0, **kw) for _ in range(4)]
        if "min_tokens" in kw:
            for s in st:
                s.stop_ids = frozenset({7})
        tokens, _ = sampler.sample(logits, st)
        assert full, kw  # the full path ran
        full.clear()
        if "presence_penalty" not in kw:
            masked = logits.clone()
            if "min_tokens" in kw:
                masked[:, 7] = float("-inf")
            assert tokens == masked.argmax(-1).tolist()


def test_plain_greedy_on_any_logits_layout(device):
    """The greedy fast path picks what the full path picks on bfloat16 logits, on a strided
    float32 view, and on logits narrower than the vocabulary (a head without padding rows:
    the columns there are the vocabulary)."""
    import kvloop.executor.torch.sampler as sampler_mod

    wide = rand_logits(5, 80, 9, device)
    cases = [wide.to(torch.bfloat16), wide[:, ::2], wide[::2], wide[:, :30]]
    for logits in cases:
        fast, _ = Sampler(40, device).sample(logits, [state(temperature=0.0)] * logits.shape[0])
        assert fast == logits[:, :40].float().argmax(-1).tolist()
        real = sampler_mod._argmax_only
        try:
            sampler_mod._argmax_only = lambda s: False
            full, _ = Sampler(40, device).sample(logits, [state(temperature=0.0)] * logits.shape[0])
        finally:
            sampler_mod._argmax_only = real
        assert full == fast


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_1_equals_greedy(device, temperature):
    logits = rand_logits(5, 40, 1, device)
    sampler = Sampler(40, device)
    states = [state(temperature=temperature, top_k=1, seed=i) for i in range(5)]
    greedy, _ = sampler.sample(logits, [state(temperature=0.0) for _ in range(5)])
    assert sampler.sample(logits, states)[0] == greedy


def test_padded_vocab_columns_ignored(device):
    logits = torch.zeros(1, 8, device=device)
    logits[0, 7] = 100.0  # a padding column past vocab_size
    assert Sampler(6, device).sample(logits, [state(temperature=0.0)])[0][0] < 6


# -- seeds --------------------------------------------------------------------------------------
def seed_of(name: str, step: int) -> int:
    return sum(map(ord, name)) * 1000 + step


def run_steps(sampler, device, order: list[str], states: dict[str, SamplingState], steps: int):
    """Sample ``steps`` tokens for the states in ``order``; each request's logits at step t
    depend only on (its name, t), so they are the same whatever the batch."""
    for t in range(steps):
        rows = [rand_logits(1, 64, seed_of(n, t), device, 1.0)[0] for n in order]
        tokens, _ = sampler.sample(torch.stack(rows), [states[n] for n in order])
        for n, tok in zip(order, tokens, strict=True):
            states[n].output_token_ids.append(tok)


def test_seed_reproducible_alone_or_batched(device):
    sampler = Sampler(64, device)
    alone = {"a": state(seed=7)}
    run_steps(sampler, device, ["a"], alone, 12)
    batched = {"x": state(), "a": state(seed=7), "g": state(temperature=0.0), "y": state(seed=1)}
    run_steps(sampler, device, ["x", "a", "g", "y"], batched, 12)
    again = {"y": state(seed=1), "a": state(seed=7), "x": state(top_p=0.9)}
    run_steps(sampler, device, ["y", "x", "a"], again, 12)
    assert alone["a"].output_token_ids == batched["a"].output_token_ids
    assert again["a"].output_token_ids == alone["a"].output_token_ids
    assert again["y"].output_token_ids == batched["y"].output_token_ids


def test_seed_survives_state_rebuild(device):
    """A recompute preemption rebuilds the state from the tokens so far: same continuation."""
    sampler = Sampler(64, device)
    full = {"a": state(seed=3)}
    run_steps(sampler, device, ["a"], full, 10)
    part = {"a": state(seed=3)}
    run_steps(sampler, device, ["a"], part, 4)
    rebuilt = {"a": state(seed=3, out=part["a"].output_token_ids)}
    for t in range(4, 10):
        row = rand_logits(1, 64, seed_of("a", t), device, 1.0)
        rebuilt["a"].output_token_ids += sampler.sample(row, [rebuilt["a"]])[0]
    assert rebuilt["a"].output_token_ids == full["a"].output_token_ids


def test_different_seeds_differ(device):
    sampler = Sampler(64, device)
    row = torch.zeros(20, 64, device=device)  # uniform; row i is output position i
    seq = [sampler.sample(row, [state(seed=s, out=[0] * i) for i in range(20)])[0] for s in (1, 2)]
    assert seq[0] != seq[1]


def test_seed_offset_gives_unseeded_request_its_own_stream(device):
    row = torch.zeros(1, 64, device=device)
    sampler = Sampler(64, device)
    make = lambda off: SamplingState(SamplingParams(), [0], [], seed_offset=off)  # noqa: E731
    a = [sampler.sample(row, [make(5)])[0][0] for _ in range(3)]
    assert a == [a[0]] * 3
    assert [sampler.sample(row, [make(o)])[0][0] for o in range(1, 30)] != [a[0]] * 29


# -- filters and temperature --------------------------------------------------------------------
ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def sampled_set(sampler, device, **kw) -> set[int]:
    counts = draw_counts(sampler, ROW.to(device), 20_000, **kw)
    return set(torch.nonzero(counts).flatten().tolist())


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_support(device, k):
    assert sampled_set(Sampler(8, device), device, top_k=k) == set(range(k))


@pytest.mark.parametrize(("p", "temperature"), [(0.5, 1.0), (0.7, 1.0), (0.9, 0.7)])
def test_top_p_support(device, p, temperature):
    probs = torch.softmax(ROW / temperature, -1)  # ROW is sorted descending
    before = torch.cumsum(probs, 0) - probs  # mass of the more likely tokens
    allowed = set(torch.nonzero(before < p).flatten().tolist())
    got = sampled_set(Sampler(8, device), device, top_p=p, temperature=temperature)
    assert got == allowed and len(allowed) < 8


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7])
def test_min_p_support(device, min_p):
    probs = torch.softmax(ROW, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert sampled_set(Sampler(8, device), device, min_p=min_p) == allowed


def test_filters_combined(device):
    got = sampled_set(Sampler(8, device), device, top_k=5, top_p=0.95, min_p=0.2)
    assert got == {0, 1, 2, 3}  # min_p drops logits < 2 + ln 0.2 = 0.39


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(device, temperature):
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.manual_seed(0)
    n = 40_000
    counts = draw_counts(Sampler(8, device), ROW.to(device), n, temperature=temperature)
    expected = torch.softmax(ROW / temperature, -1) * n
    keep = expected > 5
    chi2 = (((counts.cpu() - expected) ** 2)[keep] / expected[keep]).sum().item()
    assert chi2 < 35.0  # df <= 7: p ~ 1e-5


# -- penalties ----------------------------------------------------------------------------------
LOGITS = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 0.0, 2.0, -1.0]])
PROMPT, OUT = [0, 1, 5], [2, 3, 3, 6, 6, 6]


def test_repetition_penalty_matches_transformers(device):
    got = apply_penalties(LOGITS.to(device), [state(PROMPT, OUT, repetition_penalty=1.3)])
    ids = torch.tensor([PROMPT + OUT])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, LOGITS.clone())
    torch.testing.assert_close(got.cpu(), want)
    assert got[0, 7].item() == -1.0 and got[0, 4].item() == -0.5  # unseen: untouched


def test_presence_and_frequency_exact(device):
    st = state(PROMPT, OUT, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(LOGITS.to(device), [st]).cpu()
    counts = torch.bincount(torch.tensor(OUT), minlength=8).float()
    want = LOGITS - 0.25 * counts - 0.5 * (counts > 0).float()
    torch.testing.assert_close(got, want)
    assert got[0, 0] == LOGITS[0, 0]  # prompt tokens are not penalised by presence/frequency


def test_all_penalties_batched_and_order(device):
    states = [
        state(PROMPT, OUT, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5),
        state(PROMPT, OUT),  # no penalty: row untouched
        state([7], [], repetition_penalty=0.5),  # < 1 boosts the prompt token
    ]
    x = LOGITS.repeat(3, 1).to(device)
    got = apply_penalties(x, states).cpu()
    counts = torch.bincount(torch.tensor(OUT), minlength=8).float()
    row0 = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([PROMPT + OUT]), LOGITS.clone())
    row0 = row0 - 0.5 * counts - 1.0 * (counts > 0).float()
    row2 = LOGITS.clone()
    row2[0, 7] = -0.5
    torch.testing.assert_close(got, torch.cat([row0, LOGITS, row2]))
    assert apply_penalties(x, [state(), state(), state()]) is x  # skipped entirely


def test_greedy_argmax_after_penalties(device):
    sampler = Sampler(8, device)
    assert sampler.sample(LOGITS.to(device), [state(temperature=0.0)])[0] == [2]
    st = state(PROMPT, OUT, temperature=0.0, frequency_penalty=1.5, presence_penalty=1.0)
    assert sampler.sample(LOGITS.to(device), [st])[0] == [0]  # token 2: 3 - 1.5 - 1 < 1
    st = state([2], [], temperature=0.0, repetition_penalty=2.0)  # 3 / 2 < 2 (token 6)
    assert sampler.sample(LOGITS.to(device), [st])[0] == [6]


# -- logprobs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_logprobs_raw_topn_plus_sampled(device, n):
    logits = rand_logits(4, 8, 5, device)
    states = [
        state(PROMPT, OUT, logprobs=n, temperature=1.5, repetition_penalty=1.5, seed=i)
        for i in range(3)
    ] + [state(temperature=0.0)]
    tokens, lps = Sampler(8, device).sample(logits, states)
    raw = torch.log_softmax(logits.float(), -1).cpu()
    top = raw.topk(n, -1).indices.tolist()
    assert lps[3] is None
    for i in range(3):
        d = lps[i]
        assert d is not None and tokens[i] in d
        assert set(top[i]) <= set(d) and len(d) == n + (tokens[i] not in top[i][:n])
        for tok, lp in d.items():
            assert lp == pytest.approx(raw[i, tok].item(), abs=1e-5)


# -- mixed batch --------------------------------------------------------------------------------
def test_mixed_batch(device):
    logits = rand_logits(4, 32, 9, device)
    sampler = Sampler(32, device)
    mixed = [state(temperature=0.0), state(seed=11), state(top_k=3), state(seed=12, top_p=0.5)]
    before = logits.clone()
    tokens, _ = sampler.sample(logits, mixed)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[1] == sampler.sample(logits[1:2], [state(seed=11)])[0][0]
    assert tokens[2] in logits[2].topk(3).indices.tolist()
    assert tokens[3] == sampler.sample(logits[3:4], [state(seed=12, top_p=0.5)])[0][0]


def test_empty_batch(device):
    assert Sampler(8, device).sample(torch.zeros(0, 8, device=device), []) == ([], [])
