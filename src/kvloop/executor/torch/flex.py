"""Paged attention that reads the KV blocks in place: FlexAttention with a paged block mask.

The gather path (``attention.paged_attention``) copies every group's context out of the
pool before each ``scaled_dot_product_attention`` call. This path does not: the layer's
whole pool is one key/value sequence of ``num_blocks * block_size`` slots, and a
``BlockMask`` lists, for every request and every block of its query rows, the physical
blocks it reads — so the kernel visits those blocks where they lie and no others.

For query block ``m`` of request ``b`` (rows ``[m * Q, (m + 1) * Q)`` of its chunk, at
positions ``first .. last``):

- **full** blocks are the logical blocks ``j`` with ``(j + 1) * block_size - 1 <= first``:
  every query row of the block sees every slot of them, so no mask is evaluated there;
- **partial** blocks are the rest up to ``last // block_size``: the causal diagonal of a
  prefill chunk and a decode's last, partly filled block. There ``mask_mod`` compares the
  slot's logical position with the query's: ``logical[slot // bs] * bs + slot % bs <=
  q_pos[b, row]``, where ``logical`` maps each physical block to its index in the block
  tables that hold it.

NOTE: a physical block has one logical index in every table that holds it: blocks are
shared only through prefix caching, and a cached prefix block sits at the same position in
every sequence that reuses it. So one ``[num_blocks]`` map serves the whole step.

The same groups as the gather path are used (decodes, then prefill chunks padded to their
group's longest), so both paths give the same rows. FlexAttention needs ``torch.compile``
(Triton on CUDA, C++ on CPU). It runs only where asked for (``TorchModelRunner(...,
flex_attention=True)``, ``benchmarks/decode_floor.py --attention flex``). The block lists
are checked on CPU by reading them as the compiled kernels do
(``tests/torch/test_flex_block_lists.py``); the compiled CUDA kernels have not been run on
a GPU against the gather path yet (``benchmarks/gpu_check.sh`` does), so the gather path
stays the default there too. On CPU, inductor's flex template walks the whole key sequence
of the pool whatever the block mask says (measured 8x slower than the gather path at 32
decodes over a 64k-slot pool).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention


class Group(Protocol):
    """What this module reads of a group of ``attention.build_metadata`` (NOTE: a protocol,
    so that ``attention``, which builds the block masks here, is not imported back)."""

    num_seqs: int

    def queries(self, q: Tensor) -> Tensor: ...

    def outputs(self, out: Tensor) -> Tensor: ...


class Metadata(Protocol):
    """What :func:`flex_paged_attention` reads of ``attention.AttentionMetadata``."""

    groups: Sequence[Group]
    flex_masks: list[BlockMask] | None

Q_BLOCK = 128
"""Query rows per block of the block mask (FlexAttention's default tile)."""


@functools.cache
def _compiled() -> Callable[..., Tensor]:
    # NOTE: dynamic shapes: batch, query length and block counts change every step; one
    # dynamic graph instead of a recompilation per shape. Each step's ``mask_mod`` is a new
    # closure, but dynamo guards on its code and takes its tensors as inputs: after a few
    # shape specialisations (a batch or query length of one) no step recompiles
    # (``tests/torch/test_flex_block_lists.py``).
    return torch.compile(flex_attention, dynamic=True)


def _mask_mod(
    table: Tensor, logical: Tensor, starts: Tensor, last: Tensor, block_size: int
) -> Callable[..., Tensor]:
    """Exact on its own (the eager fallback ignores the block lists): the slot's block is
    request ``b``'s block at its logical index, and the slot is not after the query."""
    width = table.shape[1] - 1

    def allowed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = kv_idx // block_size
        index = logical[block]
        owned = table[b, torch.clamp(index, max=width)] == block
        kv_pos = index * block_size + kv_idx % block_size
        return owned & (kv_pos <= starts[b] + torch.minimum(q_idx, last[b]))

    return allowed


def group_block_mask(
    table: Tensor, starts: Tensor, lens: Tensor, logical: Tensor, block_size: int,
    num_slots: int, device: torch.device,
) -> BlockMask:
    """The block mask of one group: requests with padded block tables ``table`` ([B, n]
    int64, logical order) computing ``lens`` tokens from ``starts`` (both [B] int64), over
    a pool of ``num_slots`` key slots. ``logical`` is the step's physical → logical block
    map, on ``device``; the other inputs are on CPU (no device sync while building)."""
    q_max = int(lens.max())
    rows = torch.arange(q_max)
    # Padded query rows repeat their chunk's last token (as on the gather path).
    q_pos = starts[:, None] + torch.minimum(rows[None, :], (lens - 1)[:, None])
    num_q_blocks = -(-q_max // Q_BLOCK)
    first = q_pos[:, ::Q_BLOCK]  # [B, M]: position of each query block's first row
    last_row = (torch.arange(1, num_q_blocks + 1) * Q_BLOCK).clamp_(max=q_max)
    last = q_pos[:, last_row - 1]  # [B, M]: and of its last row
    n_full = torch.div(first + 1, block_size, rounding_mode="floor")
    n_part = torch.div(last, block_size, rounding_mode="floor") + 1 - n_full
    cols = n_full[..., None] + torch.arange(int(n_part.max()))
    cols = cols.clamp_(max=table.shape[1] - 1)  # past n_part: never read
    rows_of = table[:, None, :].expand(-1, num_q_blocks, -1)
    partial = torch.gather(rows_of, 2, cols)

    def dev(t: Tensor) -> Tensor:  # [B, M, ...] -> [B, 1 (heads), M, ...] int32
        return t.int()[:, None].to(device, non_blocking=True)

    table_d, starts_d, last_d = (
        t.to(device, non_blocking=True) for t in (table, starts, lens - 1)
    )
    return BlockMask.from_kv_blocks(
        dev(n_part),
        dev(partial),
        dev(n_full),
        dev(rows_of.contiguous()),
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=_mask_mod(table_d, logical, starts_d, last_d, block_size),
        seq_lengths=(q_max, num_slots),
        compute_q_blocks=False,
    )


def block_masks(
    table: Tensor, starts: Tensor, lens: Tensor, ctx: list[int], groups: Sequence[Group],
    block_size: int, pool_blocks: int, device: torch.device,
) -> list[BlockMask]:
    """One block mask per group of the step (``attention.build_metadata``): ``table``
    [R, n] padded block tables, ``starts``/``lens`` [R] of the step's requests in group
    order (all on CPU), ``ctx`` their context lengths, over a pool of ``pool_blocks``
    blocks."""
    need = torch.tensor([-(-c // block_size) for c in ctx])
    cols = torch.arange(table.shape[1])
    valid = cols[None, :] < need[:, None]  # padding (block 0) must not enter the map
    logical = torch.zeros(pool_blocks, dtype=torch.int32)
    logical[table[valid]] = cols.expand_as(table)[valid].int()
    logical = logical.to(device, non_blocking=True)
    masks = []
    lo = 0
    for g in groups:
        hi = lo + g.num_seqs
        masks.append(group_block_mask(
            table[lo:hi], starts[lo:hi], lens[lo:hi], logical, block_size,
            pool_blocks * block_size, device,
        ))
        lo = hi
    return masks


def flex_paged_attention(
    q: Tensor, cache: Tensor, meta: Metadata, scale: float
) -> Tensor:
    """``attention.paged_attention`` reading the blocks in place: same arguments, same
    result ([T, H * d]); ``meta.flex_masks`` must hold one block mask per group."""
    _, num_heads, head_dim = q.shape
    num_kv = cache.shape[-2]
    # [2, blocks, bs, kv, d] -> K and V as one sequence [1, kv, blocks * bs, d] (a view).
    k = cache[0].view(1, -1, num_kv, head_dim).transpose(1, 2)
    v = cache[1].view(1, -1, num_kv, head_dim).transpose(1, 2)
    # NOTE: compiled on CUDA only. Inductor's CPU flex template walks the whole pool and
    # fails to compile some dynamic shapes; the eager kernel is exact (``_mask_mod``) and
    # serves the CPU tests of this path.
    attend = _compiled() if q.is_cuda else flex_attention
    parts: list[Tensor] = []
    masks = meta.flex_masks
    assert masks is not None and len(masks) == len(meta.groups)
    # NOTE: a kernel tile may not straddle two KV blocks (pages): Triton's flex kernels
    # need the page size to be a multiple of their BLOCK_N (64 or 128 by default).
    for g, mask in zip(meta.groups, masks, strict=True):
        out = attend(
            g.queries(q), k, v, block_mask=mask, scale=scale, enable_gqa=num_heads != num_kv,
            kernel_options={"BLOCK_N": min(mask.BLOCK_SIZE[1], 64)},
        )
        parts.append(g.outputs(out))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
