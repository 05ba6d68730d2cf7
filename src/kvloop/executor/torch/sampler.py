"""Token sampler: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Semantics follow vLLM: penalties act on the raw logits (repetition over prompt + output,
presence / frequency over the output only), greedy rows take the argmax of the penalised
logits, random rows are scaled by their temperature, then filtered by top-k, top-p and min-p
and sampled. Logprobs are those of the raw logits (vLLM's default ``raw_logprobs``).

Every stage is vectorised over the batch and skipped when no row in the batch uses it.

A row whose logits or probabilities are not numbers (NaN: a broken model, or logits that
overflowed) gets no token: ``sample`` returns None for it and the runner fails that request
with a clear error, instead of emitting whatever an argmax makes of NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvloop.executor.torch import native
from kvloop.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingState:
    """One request's sampling inputs; the runner keeps it for the request's lifetime.

    NOTE: the runner appends every sampled token to ``output_token_ids`` (this same list).
    A seeded request's random draw at output position ``n`` depends only on ``(seed, n)``,
    so its tokens do not depend on the batch it runs in, nor on a recompute preemption that
    rebuilds this state from the tokens generated so far.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    seed_offset: int = 0
    """Runner-level seed for an unseeded request: non-zero gives it its own reproducible
    stream (the runner should hand each request a distinct value); 0 uses the shared RNG."""
    stop_ids: frozenset[int] = frozenset()
    """Ids masked while fewer than ``params.min_tokens`` tokens are out."""
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This request's generator, re-seeded for the current output position; None when
        the request has no seed (it then uses the batch's shared draw)."""
        seed = self.params.seed if self.params.seed is not None else self.seed_offset or None
        if seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(_mix(seed, len(self.output_token_ids)))
        return self._generator

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        """The prompt as a cached int64 tensor on ``device``."""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = list(self.prompt_token_ids)
            self._prompt_ids = torch.tensor(ids, dtype=torch.long, device=device)
        return self._prompt_ids


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed from ``(seed, position)`` (splitmix64 finaliser)."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _argmax_only(s: SamplingState) -> bool:
    """Whether this row's token is its raw logits' argmax: greedy, no penalty, no stop ids
    masked by ``min_tokens`` this step, no logprobs."""
    p = s.params
    return (p.greedy and p.logprobs is None and not _has_penalty(p)
            and not (p.min_tokens > len(s.output_token_ids) and s.stop_ids))


def _row_token_tensors(
    token_lists: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of all the rows' tokens, flattened."""
    lens = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.arange(len(token_lists), device=device)
    total = sum(len(t) for t in token_lists)
    return torch.repeat_interleave(rows, lens, output_size=total), torch.cat(token_lists)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Logits with repetition, then frequency and presence penalties applied (vLLM order).

    Repetition divides positive / multiplies negative logits of tokens seen in prompt or
    output; then ``logits -= frequency * count + presence * (count > 0)`` over output tokens.
    Returns ``logits`` itself when no row uses a penalty, else a new tensor.
    """
    rows = [i for i, s in enumerate(states) if _has_penalty(s.params)]
    if not rows:
        return logits
    dev = logits.device
    sub = [states[i] for i in rows]
    idx = torch.tensor(rows, device=dev)
    x = logits.index_select(0, idx)
    counts = torch.zeros_like(x)
    outs = [torch.tensor(s.output_token_ids, dtype=torch.long, device=dev) for s in sub]
    if any(len(o) for o in outs):
        r, t = _row_token_tensors(outs, dev)
        counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
    in_output = counts > 0
    reps = [s.params.repetition_penalty for s in sub]
    if any(rp != 1.0 for rp in reps):
        seen = in_output.clone()
        r, t = _row_token_tensors([s.prompt_ids(dev) for s in sub], dev)
        seen[r, t] = True
        rep = torch.tensor(reps, dtype=x.dtype, device=dev).unsqueeze(1)
        factor = torch.where(seen, rep, torch.ones((), dtype=x.dtype, device=dev))
        x = torch.where(x > 0, x / factor, x * factor)
    freq = torch.tensor([s.params.frequency_penalty for s in sub], dtype=x.dtype, device=dev)
    pres = torch.tensor([s.params.presence_penalty for s in sub], dtype=x.dtype, device=dev)
    x = x - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * in_output
    return logits.index_copy(0, idx, x)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k (ties at the k-th value kept) and
    outside its nucleus: the smallest set of most likely tokens whose mass reaches ``p``
    (at least one token kept). ``k`` (int64, use V for "all") and ``p`` are per row."""
    if k is None and p is None:
        return logits
    s, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = s.gather(1, (s.shape[-1] - k).clamp(min=0).unsqueeze(1))
        s = s.masked_fill(s < kth, float("-inf"))
    if p is not None:
        cum = s.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False
        s = s.masked_fill(drop, float("-inf"))
    return torch.empty_like(s).scatter_(-1, order, s)


def apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Mask each row's stop ids while it has fewer than ``min_tokens`` output tokens."""
    rows, cols = [], []
    v = logits.shape[-1]
    for i, s in enumerate(states):
        if s.params.min_tokens > len(s.output_token_ids) and s.stop_ids:
            for t in s.stop_ids:
                if 0 <= t < v:
                    rows.append(i)
                    cols.append(t)
    if not rows:
        return logits
    out = logits.clone()  # NOTE: ``logits`` may be the raw tensor logprobs are read from
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = (
        float("-inf"))
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` × the row's top probability
    (in log space: logit < max logit + log(min_p); min_p = 0 keeps everything)."""
    thresh = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < thresh, float("-inf"))


def _draw(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by the exponential race ``argmax(probs / Exp(1))``: unseeded rows
    share one batched draw, each seeded row draws from its own generator."""
    q = torch.empty_like(probs)
    if any(g is None for g in gens):
        q.exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            q[i].exponential_(generator=g)
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


class Sampler:
    """Samples one token per logits row, vectorised over the batch (CPU or CUDA)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._argmax_rows: Callable[[torch.Tensor, int], list[int]] | bool | None = False
        """kvloop's CPU argmax kernel (``native``), None where its kernels are off; False
        until first needed (looking it up may build the kernels)."""

    def _argmax_tokens(self, logits: torch.Tensor) -> list[int | None]:
        """Each row's argmax over the vocabulary (None for a row holding a NaN): one kernel
        call on CPU (``argmax_rows``), as ``_argmax`` picks."""
        columns = min(self.vocab_size, logits.shape[-1])
        if (logits.device.type == "cpu" and columns > 0 and logits.dtype == torch.float32
                and logits.stride(-1) == 1):
            kernel = self._argmax_rows
            if kernel is False:  # NOTE: looked up on CPU only (it may build the kernels)
                kernel = self._argmax_rows = getattr(native.kernels(), "argmax_rows", None)
            if kernel is not None:
                tokens = kernel(logits, columns)
                picked = logits.numpy()[np.arange(len(tokens)), tokens]
                return _unless_nan(tokens, np.isnan(picked).tolist())
        x = logits[:, :columns].float()
        return _drop_nan(_argmax(x), x)

    def sample(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """Sample a token for each row of ``logits`` ([N, V], one row per state).

        Returns the token ids (None for a row whose distribution holds a NaN: nothing can be
        sampled from it) and, per row, a dict token id -> logprob (raw logits) of the top
        ``params.logprobs`` tokens plus the sampled one, or None when not asked for.
        Columns past ``vocab_size`` (padded vocabularies) are ignored.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(states), "one row per state"
        if not states:
            return [], []
        if all(_argmax_only(s) for s in states):
            return self._argmax_tokens(logits), [None] * len(states)
        raw = logits[:, : self.vocab_size].float()
        x = apply_min_tokens(apply_penalties(raw, states), states)
        rand_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        greedy = _argmax(x) if len(rand_rows) < len(states) else None
        if rand_rows:
            sampled, probs = self._sample_random(x, [states[i] for i in rand_rows], rand_rows)
            # NOTE: what each row's token was picked from, one value a row, to find NaN rows
            chosen = _picked(probs, sampled)
            if greedy is None:
                tokens = sampled
            else:
                rows = torch.tensor(rand_rows, device=x.device)
                tokens = greedy.index_copy(0, rows, sampled)
                chosen = _picked(x, greedy).index_copy(0, rows, chosen)
        else:
            assert greedy is not None
            tokens, chosen = greedy, _picked(x, greedy)
        logprobs = _logprobs(raw, tokens, states)
        return _unless_nan(tokens.tolist(), chosen.isnan().tolist()), logprobs

    def _sample_random(
        self, x: torch.Tensor, states: list[SamplingState], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k, top-p, min-p, then a draw, for the non-greedy rows: their
        tokens, and what each was the argmax of (probabilities over noise)."""
        dev, v = x.device, x.shape[-1]
        if len(rows) < x.shape[0]:
            x = x.index_select(0, torch.tensor(rows, device=dev))
        params = [s.params for s in states]
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x = x / torch.tensor(temps, dtype=x.dtype, device=dev).unsqueeze(1)
        ks = [p.top_k if 0 < p.top_k < v else v for p in params]
        k = torch.tensor(ks, device=dev) if any(kk < v for kk in ks) else None
        ps = [p.top_p for p in params]
        p = torch.tensor(ps, dtype=x.dtype, device=dev) if any(pp < 1.0 for pp in ps) else None
        x = apply_top_k_top_p(x, k, p)
        min_ps = [pr.min_p for pr in params]
        if any(m > 0.0 for m in min_ps):
            x = apply_min_p(x, torch.tensor(min_ps, dtype=x.dtype, device=dev))
        probs = x.softmax(dim=-1)
        # NOTE: ``_draw`` divides ``probs`` in place by noise >= the smallest normal float,
        # which leaves every probability finite and every NaN a NaN: what the NaN check needs.
        return _draw(probs, [s.generator(dev) for s in states]), probs


def _picked(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's value at its token ([N, V], [N] -> [N])."""
    return values.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _drop_nan(tokens: torch.Tensor, values: torch.Tensor) -> list[int | None]:
    """``tokens`` as a list, None where the chosen value is NaN (one transfer from CUDA)."""
    bad = _picked(values, tokens).isnan()
    return [None if t < 0 else t for t in torch.where(bad, -1, tokens).tolist()]


def _unless_nan(tokens: list[int], bad: list[bool]) -> list[int | None]:
    """``tokens`` with None where ``bad``. NOTE: a row holds a NaN exactly when the value its
    token was picked at is one: an argmax (torch's, numpy's or kvloop's) picks a row's first
    NaN, and so does the exponential race's."""
    if not any(bad):
        return tokens  # type: ignore[return-value]
    return [None if b else t for t, b in zip(tokens, bad, strict=True)]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value ([N, V] -> [N] int64; the first of equal maxima,
    and a NaN counts as the largest, as in torch). NOTE: on CPU through numpy, whose argmax is
    vectorised: torch's CPU argmax took ~90 us for one row of a 49k vocabulary, numpy ~16."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingState]
) -> list[dict[int, float] | None]:
    """Per row asking for them: the sampled token's and the top-n raw-logit logprobs."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    out: list[dict[int, float] | None] = [None] * len(states)
    if not rows:
        return out
    idx = torch.tensor(rows, device=raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
    tok = tokens.index_select(0, idx)
    tok_lp = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
    n_max = min(max(states[i].params.logprobs or 0 for i in rows), lp.shape[-1])
    top_v, top_i = lp.topk(n_max, dim=-1)
    top_v_l, top_i_l, tok_l, tok_lp_l = (
        top_v.tolist(),
        top_i.tolist(),
        tok.tolist(),
        tok_lp.tolist(),
    )
    for j, i in enumerate(rows):
        n = states[i].params.logprobs or 0
        d = {tok_l[j]: tok_lp_l[j]}
        d.update(zip(top_i_l[j][:n], top_v_l[j][:n], strict=True))
        out[i] = d
    return out


__all__ = ["Sampler", "SamplingState", "apply_min_p", "apply_penalties", "apply_top_k_top_p"]
