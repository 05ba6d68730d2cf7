"""kvloop's own CPU prefill attention (``native.prefill_attention``) through
``paged_attention`` (``native``): causal chunks over their paged context (fresh prompts,
chunks after a cached prefix, shared blocks, odd block and head sizes, tasks split within a
chunk) against the gather path and a float64 reference, on one thread and on all; a NaN key
reaching only the rows that see it; bad input refused with a RuntimeError (tables past the
cache in a fresh interpreter)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from native_helpers import BF16, OPS  # noqa: E402
from test_native_attention import TOLS, _in_subprocess, paged_setup  # noqa: E402

from kvloop.executor.torch.attention import build_metadata, paged_attention  # noqa: E402


def setup(starts: list[int], lengths: list[int], *, block_size: int, kv: int, rep: int,
          head_dim: int, dtype: torch.dtype, seed: int, share: bool = False,
          ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """``paged_setup``'s cache and block tables for the chunks' contexts, with one strided
    query row per chunk token ([T, H, d], a view into a wider qkv-like tensor)."""
    ctx = [s + n for s, n in zip(starts, lengths, strict=True)]
    cache, _, tables = paged_setup(ctx, block_size=block_size, kv=kv, rep=rep,
                                   head_dim=head_dim, dtype=dtype, seed=seed, share=share)
    gen = torch.Generator().manual_seed(seed + 1)
    heads = kv * rep
    wide = torch.randn(sum(lengths), (heads + 2 * kv) * head_dim, generator=gen).to(dtype)
    return cache, wide[:, : heads * head_dim].view(-1, heads, head_dim), tables


def reference(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
              starts: list[int], lengths: list[int], causal: bool = True) -> torch.Tensor:
    """float64 causal attention of each chunk's tokens over their context: [T, H * d]
    (``causal=False``: every token sees its whole chunk)."""
    _, _, block_size, kv, d = cache.shape
    rep = q.shape[1] // kv
    outs, row = [], 0
    for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        slots = torch.arange(s + n)
        blocks = torch.tensor(tables[b])[slots // block_size]
        k = cache[0, blocks, slots % block_size].double().repeat_interleave(rep, 1)
        v = cache[1, blocks, slots % block_size].double().repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), k) / math.sqrt(d)
        last = s + torch.arange(n) if causal else torch.full((n,), s + n - 1)
        seen = torch.arange(s + n)[None, :] <= last[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1))
        row += n
    return torch.cat(outs)


def metadata(starts: list[int], lengths: list[int], tables: list[list[int]], block_size: int,
             dtype: torch.dtype, native: bool):  # type: ignore[no-untyped-def]
    meta, _ = build_metadata(starts=starts, lengths=lengths, block_tables=tables, num_decodes=0,
                             block_size=block_size, device=torch.device("cpu"), dtype=dtype,
                             native=native)
    return meta


@pytest.fixture(params=["all-threads", "one-thread"])
def threads(request: pytest.FixtureRequest) -> Iterator[None]:
    """The kernel's tasks are taken from a shared counter: the same results on any count."""
    before = torch.get_num_threads()
    if request.param == "one-thread":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CASES = [  # (starts, lengths, block_size, kv, rep, head_dim, share)
    pytest.param([0], [1], 16, 2, 3, 64, False, id="one-token-prompt"),
    pytest.param([0, 0], [16, 17], 16, 1, 1, 128, True, id="block-edge-shared"),
    pytest.param([0], [100], 16, 3, 3, 64, False, id="long-chunk-several-tasks"),
    pytest.param([37], [45], 16, 2, 3, 64, False, id="chunk-after-prefix"),
    pytest.param([0, 5, 17, 40, 0], [7, 1, 30, 64, 3], 5, 2, 2, 64, True, id="block-size-5"),
    pytest.param([3, 0], [40, 61], 16, 2, 2, 80, False, id="d80"),
    pytest.param([0], [70], 16, 1, 8, 32, False, id="gqa8-d32"),
]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("starts, lengths, block_size, kv, rep, head_dim, share", CASES)
def test_prefill_attention_matches_the_gather_path(
        starts: list[int], lengths: list[int], block_size: int, kv: int, rep: int,
        head_dim: int, share: bool, dtype: torch.dtype, threads: None) -> None:
    cache, q, tables = setup(starts, lengths, block_size=block_size, kv=kv, rep=rep,
                             head_dim=head_dim, dtype=dtype, seed=sum(lengths) + head_dim,
                             share=share)
    fast_meta = metadata(starts, lengths, tables, block_size, dtype, native=True)
    slow_meta = metadata(starts, lengths, tables, block_size, dtype, native=False)
    (group,) = fast_meta.groups
    assert group.starts.tolist() == starts and (group.row_start, group.row_end) == (0, len(q))
    assert all(g.starts is None and g.context_lens is None for g in slow_meta.groups)
    scale = head_dim**-0.5
    fast = paged_attention(q, cache, fast_meta, scale)
    slow = paged_attention(q, cache, slow_meta, scale)
    assert fast.dtype == dtype and fast.shape == (len(q), kv * rep * head_dim)
    tol = TOLS[dtype]
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    ref = reference(q, cache, tables, starts, lengths)
    torch.testing.assert_close(fast.double(), ref, atol=tol, rtol=tol)
    if dtype == BF16:  # float32 inside, rounded once: within half a bfloat16 step of exact
        assert bool(((fast.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-5).all())
    # Able to fail: seeing past the diagonal, or a neighbour KV head, is far off.
    if max(lengths) > 1:
        unmasked = reference(q, cache, tables, starts, lengths, causal=False)
        assert float((fast.double() - unmasked).abs().max()) > 10 * tol
    if kv > 1:
        shifted = ref.view(len(q), kv, rep * head_dim).roll(1, 1).view_as(ref)
        assert float((fast.double() - shifted).abs().max()) > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_mixed_step_reads_every_group_in_place(dtype: torch.dtype) -> None:
    """Decodes, then a chunk after a cached prefix (shared with a decode's blocks) and a
    fresh prompt: two groups, both read in place, and the step equals the all-gather one."""
    block_size, kv, rep, d = 16, 2, 3, 64
    starts, lengths = [19, 40, 61, 0], [1, 1, 9, 6]  # decodes first, each kind by context
    cache, q, tables = setup(starts, lengths, block_size=block_size, kv=kv, rep=rep,
                             head_dim=d, dtype=dtype, seed=11)
    tables[2][:2] = tables[1][:2]  # the chunk's cached prefix is a decode's blocks

    def step(native: bool):  # type: ignore[no-untyped-def]
        meta, positions = build_metadata(
            starts=starts, lengths=lengths, block_tables=tables, num_decodes=2,
            block_size=block_size, device=torch.device("cpu"), dtype=dtype, native=native)
        return meta, positions, paged_attention(q, cache, meta, d**-0.5)

    fast_meta, fast_pos, fast = step(True)
    slow_meta, slow_pos, slow = step(False)
    assert torch.equal(fast_pos, slow_pos)
    assert all(g.context_lens is None for g in slow_meta.groups)
    decodes, prefills = fast_meta.groups
    assert (decodes.row_start, decodes.row_end, decodes.starts) == (0, 2, None)
    assert (prefills.row_start, prefills.row_end) == (2, 17)
    assert prefills.starts.tolist() == starts[2:]
    assert prefills.context_lens.tolist() == [70, 6]
    tol = TOLS[dtype]
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    ref = reference(q[2:], cache, tables[2:], starts[2:], lengths[2:])
    torch.testing.assert_close(fast[2:].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("starts, lengths, num_decodes", [
    pytest.param([40, 0, 0], [1, 5, 3], 1, id="one-block-prefills-after-a-long-decode"),
    pytest.param([3, 9, 0], [1, 1, 40], 2, id="one-block-decodes-before-a-long-prefill"),
])
def test_groups_narrower_than_the_step_read_their_own_blocks(
        starts: list[int], lengths: list[int], num_decodes: int) -> None:
    """A group whose contexts all fit in one block, in a step whose table is wider: its
    table rows are still read entry by entry (a regression: they viewed as [n, 1] with the
    wide table's stride and the kernels refused them, failing the step in a server)."""
    cache, q, tables = setup(starts, lengths, block_size=16, kv=2, rep=2, head_dim=64,
                             dtype=torch.float32, seed=3)
    metas = [build_metadata(starts=starts, lengths=lengths, block_tables=tables,
                            num_decodes=num_decodes, block_size=16,
                            device=torch.device("cpu"), dtype=torch.float32, native=native)[0]
             for native in (True, False)]
    assert all(g.blocks.view(g.num_seqs, -1).stride(1) == 1 for g in metas[0].groups)
    fast, slow = (paged_attention(q, cache, m, 0.125) for m in metas)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_prefill_attention_nan_reaches_only_the_rows_that_see_it() -> None:
    """A NaN key at position 20 of a 30-token prompt: the rows of its KV head's query heads
    at positions >= 20 are NaN, every other output is finite."""
    cache, q, tables = setup([0], [30], block_size=16, kv=2, rep=2, head_dim=64, dtype=BF16,
                             seed=6)
    cache[0, tables[0][1], 4, 0, 5] = float("nan")  # slot 20, KV head 0
    out = paged_attention(q, cache, metadata([0], [30], tables, 16, BF16, True), 0.125)
    assert out[20:, :128].isnan().all()  # query heads 0 and 1 read KV head 0
    assert out[:20].isfinite().all() and out[:, 128:].isfinite().all()


# -- bad input ------------------------------------------------------------------------------
def _args(**change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": torch.randn(5, 4, 64),
        "cache": torch.randn(2, 6, 16, 2, 64),
        "block_table": torch.tensor([[0, 1], [2, 3]]),
        "starts": torch.tensor([18, 29]),
        "context_lens": torch.tensor([20, 32]),
        "scale": 0.125,
        "out": torch.empty(5, 4 * 64),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}, "block_table"),
    ({"starts": torch.tensor([18, 29], dtype=torch.int32)}, "starts"),
    ({"starts": torch.tensor([18])}, "starts"),
    ({"context_lens": torch.tensor([20])}, "context_lens"),
    ({"q": torch.randn(6, 4, 64), "out": torch.empty(6, 4 * 64)}, "the chunks have 5 tokens"),
    ({"q": torch.randn(5, 4, 64).to(BF16)}, "dtypes"),
    ({"q": torch.randn(5, 4, 40), "cache": torch.randn(2, 6, 16, 2, 40),
      "out": torch.empty(5, 4 * 40)}, "head size"),
    ({"q": torch.randn(5, 3, 64)}, "query heads per KV head"),
    ({"cache": torch.randn(6, 16, 2, 64)}, "cache layout"),
    ({"out": torch.empty(5, 4 * 32)}, "out"),
    ({"q": torch.randn(5, 4, 64).half(), "cache": torch.randn(2, 6, 16, 2, 64).half(),
      "out": torch.empty(5, 4 * 64).half()}, "bfloat16 or float32"),
], ids=["table-int32", "starts-int32", "starts-count", "lens-count", "rows", "q-dtype",
        "head-size-40", "heads", "cache-dims", "out-size", "float16"])
def test_prefill_attention_refuses_bad_input(change: dict[str, object], message: str) -> None:
    OPS.prefill_attention(**_args())  # the unchanged arguments run
    with pytest.raises(RuntimeError, match=message):
        OPS.prefill_attention(**_args(**change))


BAD_CHUNKS = {  # (block table, starts, context lengths) over a 6-block cache of 16 slots
    "context-past-table": ("[[0, 1]]", "[30]", "[33]"),  # 33 slots over 2 blocks
    "block-id-past-cache": ("[[0, 10**9]]", "[0]", "[32]"),
    "negative-block": ("[[-1, 1]]", "[0]", "[3]"),
    "empty-chunk": ("[[0, 1]]", "[3]", "[3]"),
    "negative-start": ("[[0, 1]]", "[-1]", "[2]"),
}


def test_prefill_attention_refuses_a_chunk_past_its_blocks() -> None:
    """Each bad table or chunk raises RuntimeError, none reads out of bounds: the calls run
    in one fresh interpreter (a crash would end it before it prints every case's name)."""
    lines = []
    for name, (table, starts, lens) in BAD_CHUNKS.items():
        lines += [
            f"s, n = torch.tensor({starts}), torch.tensor({lens})",
            "t = max(int((n - s).sum()), 1)",
            "try:",
            "    k.prefill_attention(torch.randn(t, 4, 64), torch.randn(2, 6, 16, 2, 64), "
            f"torch.tensor({table}), s, n, 0.125, torch.empty(t, 256))",
            "except RuntimeError:",
            f"    print('refused {name}')",
        ]
    proc = _in_subprocess("\n".join(lines) + "\n")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-400:])
    assert proc.stdout.split("\n")[:-1] == [f"refused {name}" for name in BAD_CHUNKS]


def test_prefill_attention_refuses_positions_float32_cannot_hold() -> None:
    """The causal mask compares positions in float32: a context past 2^24 tokens is refused."""
    table = torch.zeros(1, (1 << 20) + 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"past 2\^24"):
        OPS.prefill_attention(torch.randn(1, 4, 64), torch.randn(2, 6, 16, 2, 64), table,
                              torch.tensor([1 << 24]), torch.tensor([(1 << 24) + 1]), 0.125,
                              torch.empty(1, 256))
