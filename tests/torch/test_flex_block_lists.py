"""FlexAttention's block lists (``flex.py``), checked the way its compiled kernels read them.

The eager ``flex_attention`` (what runs without a GPU) evaluates ``mask_mod`` over the whole
key sequence and ignores the block lists; the compiled kernels visit only the listed
blocks: every slot of a *full* block without evaluating the mask, and the slots of a
*partial* block where ``mask_mod`` allows them. This test computes attention exactly that
way from the lists ``build_metadata`` made, over many query blocks, pages shared by a
cached prefix and decodes beside prefill chunks, and requires the dense reference's rows:
a block missing from the lists, or called full when some of its slots must stay hidden,
fails it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import attention as attn_mod  # noqa: E402
from kvloop.executor.torch.flex import Q_BLOCK  # noqa: E402

HEADS, KV_HEADS, D = 4, 2, 8


def _as_kernel_reads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object,
                     scale: float) -> torch.Tensor:
    """Attention of ``q`` [B, H, Q, d] over ``k``/``v`` [1, kv, S, d] through the block
    lists of ``mask`` only (a ``BlockMask``), as FlexAttention's compiled kernels read them.
    Returns [B, H, Q, d]."""
    qb, kb = mask.BLOCK_SIZE  # type: ignore[attr-defined]
    b_n, heads, q_len, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(b_n):
        for m in range(-(-q_len // qb)):
            full = mask.full_kv_indices[b, 0, m, :mask.full_kv_num_blocks[b, 0, m]]
            partial = mask.kv_indices[b, 0, m, :mask.kv_num_blocks[b, 0, m]]
            assert not set(full.tolist()) & set(partial.tolist()), "a block listed twice"
            rows = torch.arange(m * qb, min((m + 1) * qb, q_len))
            blocks = torch.cat([full, partial]).long()
            slots = (blocks[:, None] * kb + torch.arange(kb)).reshape(-1)
            is_full = torch.cat([torch.ones(len(full), dtype=torch.bool),
                                 torch.zeros(len(partial), dtype=torch.bool)])
            allowed = mask.mask_mod(  # type: ignore[attr-defined]
                torch.tensor(b), torch.tensor(0), rows[:, None], slots[None, :])
            allowed = allowed | is_full.repeat_interleave(kb)[None, :]
            for h in range(heads):
                scores = q[b, h, rows] @ k[0, h // group, slots].T * scale
                w = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
                out[b, h, rows] = w @ v[0, h // group, slots]
    return out


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_listed_blocks_give_the_dense_rows(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    pool = 96
    # (start, length): decodes, then prefill chunks; one chunk spans three query blocks.
    reqs = [(5, 1), (40, 1), (130, 1), (0, 70), (48, 2 * Q_BLOCK + 37), (100, 30)]
    free = torch.randperm(pool, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(s + n) // block_size))] for s, n in reqs]
    shared = 41 // block_size  # request 1's full pages
    tables[4][:shared] = tables[1][:shared]  # a cached prefix: the same pages, positions
    meta, positions = attn_mod.build_metadata(
        starts=[s for s, _ in reqs], lengths=[n for _, n in reqs], block_tables=tables,
        num_decodes=3, block_size=block_size, device=torch.device("cpu"),
        dtype=torch.float32, flex_pool_blocks=pool)
    assert meta.flex_masks is not None and len(meta.flex_masks) == len(meta.groups)
    cache = torch.zeros(2, pool, block_size, KV_HEADS, D)
    dense = [torch.randn(2, s + n, KV_HEADS, D, generator=gen) for s, n in reqs]
    dense[4][:, :shared * block_size] = dense[1][:, :shared * block_size]
    for (s, n), table, kvs in zip(reqs, tables, dense, strict=True):
        for p in range(s + n):
            cache[:, table[p // block_size], p % block_size] = kvs[:, p]
    q = torch.randn(len(positions), HEADS, D, generator=gen)
    k = cache[0].view(1, -1, KV_HEADS, D).transpose(1, 2)
    v = cache[1].view(1, -1, KV_HEADS, D).transpose(1, 2)
    scale = D**-0.5
    parts = [g.outputs(_as_kernel_reads(g.queries(q), k, v, mask, scale))
             for g, mask in zip(meta.groups, meta.flex_masks, strict=True)]
    out = torch.cat(parts)
    assert max(mask.kv_indices.shape[2] for mask in meta.flex_masks) >= 3  # query blocks
    row = 0
    for (s, n), kvs in zip(reqs, dense, strict=True):
        for t in range(n):
            keys, values = kvs[:, : s + t + 1].repeat_interleave(HEADS // KV_HEADS, dim=2)
            w = torch.einsum("hd,lhd->hl", q[row], keys).mul(scale).softmax(-1)
            ref = torch.einsum("hl,lhd->hd", w, values).reshape(-1)
            torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
            row += 1


def test_one_compiled_kernel_serves_every_step() -> None:
    """A new ``mask_mod`` each step is no new kernel: dynamo guards on its code and passes
    its tensors as inputs, so the compiled FlexAttention (``flex._compiled``'s call, dynamic
    shapes) recompiles only for the few shapes it specialises (a batch or query length of
    one) and then serves every step. Counted with dynamo's eager backend: graphs, not
    kernels, are what recompiling would add."""
    import random
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(flex_attention, dynamic=True, backend=counter)
    block_size, pool = 16, 256
    cache = torch.randn(2, pool, block_size, KV_HEADS, D)
    k = cache[0].view(1, -1, KV_HEADS, D).transpose(1, 2)
    v = cache[1].view(1, -1, KV_HEADS, D).transpose(1, 2)
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    frames = []
    for _ in range(48):
        decodes, chunks = rng.randint(0, 4), rng.randint(0, 3)
        reqs = ([(rng.randint(1, 300), 1) for _ in range(decodes or (not chunks))]
                + [(rng.randint(0, 200), rng.randint(2, 200)) for _ in range(chunks)])
        free = torch.randperm(pool, generator=gen).tolist()
        tables = [[free.pop() for _ in range(-(-(s + n) // block_size))] for s, n in reqs]
        meta, positions = attn_mod.build_metadata(
            starts=[s for s, _ in reqs], lengths=[n for _, n in reqs], block_tables=tables,
            num_decodes=sum(n == 1 for _, n in reqs), block_size=block_size,
            device=torch.device("cpu"), dtype=torch.float32, flex_pool_blocks=pool)
        q = torch.randn(len(positions), HEADS, D, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for g, mask in zip(meta.groups, meta.flex_masks, strict=True):
                compiled(g.queries(q), k, v, block_mask=mask, scale=D**-0.5,
                         enable_gqa=True, kernel_options={"BLOCK_N": block_size})
        frames.append(counter.frame_count)
    assert frames[-1] == frames[len(frames) // 2] <= 8, frames
