"""Paged attention over a mixed batch: single-token decodes plus prefill chunks.

One step's tokens are laid out flat: decodes first (one token each), then every prefill
chunk, each kind sorted by context length. ``AttentionMetadata`` holds the index tensors of
the step, built once and shared by all layers:

- ``slot_mapping``: the cache slot (block * block_size + offset) of every new token.
- ``groups``: a few runs of consecutive requests of one kind, each served by one
  ``scaled_dot_product_attention`` call. A group's block tables are padded to its longest
  context, its K/V gathered block-wise from the cache, and an additive mask hides padding.
  Decode groups lay the g = heads / kv_heads query heads of a KV head out as g query rows
  (no K/V repeat); prefill groups pad queries to their longest chunk and place each chunk
  causally at its offset in its context (cached prefix, earlier chunks, then itself: the
  chunk's own K/V is written to the cache before attention). A prefill group whose chunks
  all start at position 0 needs no mask tensor: SDPA's ``is_causal`` is exact for it.

Splitting a kind into groups trades one more call per layer against padding: a group
costs about ``requests × padded context`` gathered slots (prefill: times ``1 + Q / 5`` for
the padded query rows), plus a fixed overhead worth ``_GROUP_OVERHEAD`` slots. Equal lengths
make one group; a long prompt next to short ones gets its own.

``flex.py`` reads the same groups' blocks in place instead (where asked for): the metadata
then carries one FlexAttention block mask per group and no additive masks. On CPUs where
kvloop's own kernels run (``native``), nothing is gathered or padded: the decodes are one
group read in place by ``native.decode_attention`` and the prefill chunks another, read in
place by ``native.prefill_attention`` (both walk each sequence's block table; the prefill
kernel is causal per chunk and visits no key tile past a chunk's diagonal).

NOTE: the cache must be zero-initialised: masked slots still enter the ``P @ V`` product
(with weight 0), and garbage NaNs there would poison the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from kvloop.executor.torch import native
from kvloop.executor.torch.flex import block_masks

_GROUP_OVERHEAD = 512
"""Cost of one more attention call per layer, in gathered-slot equivalents (CPU-measured:
~150 µs of fixed cost against ~0.3 µs of memory traffic per slot)."""
_PAIR_COST = 0.2
"""Cost of one (query, key) pair of a prefill group, relative to one gathered slot."""
_MAX_SPLITS = 3
"""Most times one kind (decodes or prefills) is split: at most 4 groups of each."""


@dataclass
class AttentionGroup:
    """Consecutive requests of one kind attended by one call."""

    row_start: int
    row_end: int
    """Token rows ``[row_start, row_end)`` of the step's flat layout."""
    num_seqs: int
    blocks: Tensor
    """[num_seqs * nblk] int64: the padded block tables, flattened."""
    mask: Tensor | None
    """Additive mask (0 / -inf): [B, 1, 1, L] for decodes, [B, 1, Q, L] for prefills;
    None for decodes whose contexts fill every gathered slot."""
    q_max: int = 1
    """Longest chunk (1: a decode group)."""
    causal: bool = False
    """Prefills that all start at position 0: SDPA's ``is_causal`` over the first
    ``q_max`` keys is exact for their real rows, so no mask tensor is built (padded rows
    are dropped)."""
    q_index: Tensor | None = None
    """[B * q_max] int64 rows (from row_start) of the padded queries (None: no padding)."""
    out_index: Tensor | None = None
    """[row_end - row_start] int64 rows of the padded output that are real tokens."""
    context_lens: Tensor | None = None
    """[B] int64 context lengths of a group read in place by kvloop's kernels
    (``native.decode_attention`` or ``prefill_attention``); None on the gather path."""
    starts: Tensor | None = None
    """[B] int64 positions of the chunks' first tokens in a prefill group read in place
    (``native.prefill_attention``); None for decodes and on the gather path."""

    def queries(self, q: Tensor) -> Tensor:
        """This group's rows of the step's queries ``q`` ([T, H, d]), padded to its longest
        chunk: [B, H, q_max, d]."""
        qg = q[self.row_start : self.row_end]
        if self.q_index is not None:
            qg = qg.index_select(0, self.q_index)
        return qg.view(self.num_seqs, self.q_max, *q.shape[1:]).transpose(1, 2)

    def outputs(self, out: Tensor) -> Tensor:
        """The real tokens' rows of a padded attention output [B, H, q_max, d]:
        [row_end - row_start, H * d]."""
        out = out.transpose(1, 2).reshape(self.num_seqs * self.q_max, -1)
        return out if self.out_index is None else out.index_select(0, self.out_index)


@dataclass
class AttentionMetadata:
    """Index tensors of one step, shared by all layers (see the module docstring)."""

    slot_mapping: Tensor
    """[T] int64: cache slot of each new token."""
    groups: list[AttentionGroup]
    num_positions: int
    """One more than the step's largest position (a host int): how far tables indexed by
    position (the model's RoPE) must reach, known without reading the positions back."""
    flex_masks: list[BlockMask] | None = None
    """One FlexAttention block mask per group when the step reads the blocks in place
    (``flex.flex_paged_attention``); None on the gather path."""


def build_metadata(
    *,
    starts: Sequence[int],
    lengths: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    flex_pool_blocks: int | None = None,
    native: bool = False,
) -> tuple[AttentionMetadata, Tensor]:
    """Metadata and the [T] positions of a step whose requests compute tokens
    ``[starts[i], starts[i] + lengths[i])`` with the given block tables.

    The first ``num_decodes`` requests have one token each; requests of each kind should be
    sorted by context length (``start + length``) so that groups pad little. With
    ``flex_pool_blocks`` (the pool's block count) the metadata also holds the block masks
    that read the blocks in place (``flex.py``). With ``native`` the decodes form one group
    and the prefill chunks another, each read in place by kvloop's CPU kernels
    (``native.decode_attention``, ``native.prefill_attention``: no padding to pay for, so no
    split and no mask)."""
    n_req = len(starts)
    if native and num_decodes == n_req and device.type == "cpu":
        return _native_decode_metadata(starts, block_tables, block_size)
    ctx_l = [s + n for s, n in zip(starts, lengths, strict=True)]
    # NOTE: the index arithmetic runs in numpy: a handful of tiny torch ops cost ~280 us a
    # decode step on CPU (~10 us each), the same in numpy ~30 us; torch views share it after.
    starts_a = np.asarray(starts, dtype=np.int64)
    lens_a = np.asarray(lengths, dtype=np.int64)
    # Positions: start of the token's request + offset within its chunk.
    req_of_tok = np.repeat(np.arange(n_req), lens_a)
    first_tok = np.cumsum(lens_a) - lens_a
    positions_a = starts_a[req_of_tok] + np.arange(len(req_of_tok)) - first_tok[req_of_tok]
    # Block tables, padded with block 0 (its slots are masked).
    max_blocks = -(-max(ctx_l) // block_size)
    table_a = np.zeros((n_req, max_blocks), dtype=np.int64)
    for i, (blocks, c) in enumerate(zip(block_tables, ctx_l, strict=True)):
        need = -(-c // block_size)
        table_a[i, :need] = blocks[:need]
    slots_a = table_a[req_of_tok, positions_a // block_size] * block_size
    slots_a += positions_a % block_size
    starts_t, lens_t, table = (torch.from_numpy(a) for a in (starts_a, lens_a, table_a))
    positions, slots = torch.from_numpy(positions_a), torch.from_numpy(slots_a)
    # NOTE: the in-place path masks inside its kernel: no additive masks to build.
    masks = flex_pool_blocks is None
    build = _GroupBuilder(
        table, starts_t, lens_t, first_tok.tolist(), ctx_l, block_size, dtype, masks
    )
    if native:
        if device.type != "cpu":
            raise ValueError(f"native attention reads the cache on CPU only (device {device})")
        groups = [build.native_decodes(num_decodes)] if num_decodes else []
        if n_req > num_decodes:
            groups.append(build.native_prefills(num_decodes, n_req))
    else:
        groups = [build.decodes(lo, hi) for lo, hi in _split(ctx_l, [1] * num_decodes, 0, 0)]
        prefill_spans = _split(ctx_l, list(lengths[num_decodes:]), num_decodes, _PAIR_COST)
        groups += [build.prefills(lo, hi) for lo, hi in prefill_spans]
    meta = AttentionMetadata(slot_mapping=slots, groups=groups,
                             num_positions=int(positions_a.max()) + 1)
    if device.type != "cpu":
        meta = _to_device(meta, device)
        positions = positions.to(device, non_blocking=True)
    if flex_pool_blocks is not None:
        meta.flex_masks = block_masks(
            table, starts_t, lens_t, ctx_l, groups, block_size, flex_pool_blocks, device
        )
    return meta, positions


def _native_decode_metadata(
    starts: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> tuple[AttentionMetadata, Tensor]:
    """``build_metadata`` of a step of decodes only (one token each, at ``starts``) read in
    place by kvloop's kernel: the same tensors from list arithmetic.

    NOTE: a decode step's commonest case. numpy's index arithmetic cost ~0.16 ms of it at
    one sequence (a dozen array ops of a few µs each, slower with the code cold after the
    step's weights streamed through the caches); here each tensor is one ``long_tensor``."""
    width = max(starts) // block_size + 1  # blocks of the longest context (start + 1 slots)
    table: list[int] = []  # NOTE: [n * width], each row padded with block 0 as the table
    slots: list[int] = []
    for start, blocks in zip(starts, block_tables, strict=True):
        need = start // block_size + 1
        if len(blocks) < need:
            raise ValueError(f"a block table holds {len(blocks)} blocks; position {start} "
                             f"needs {need}")
        slots.append(blocks[need - 1] * block_size + start % block_size)
        table.extend(blocks[:need])
        table.extend([0] * (width - need))
    n = len(starts)
    lens = long_tensor([s + 1 for s in starts])
    group = AttentionGroup(0, n, n, long_tensor(table), None, context_lens=lens)
    meta = AttentionMetadata(slot_mapping=long_tensor(slots), groups=[group],
                             num_positions=max(starts) + 1)
    return meta, long_tensor(starts)


def long_tensor(values: Sequence[int]) -> Tensor:
    """An int64 CPU tensor of ``values`` (NOTE: ``np.array`` + ``torch.from_numpy``, ~5 µs
    on CPU where ``torch.tensor`` of a list takes ~10)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _split(
    ctx: Sequence[int], q_lens: Sequence[int], offset: int, pair_cost: float
) -> list[tuple[int, int]]:
    """Split requests ``[offset, offset + len(q_lens))`` (sorted by context) into spans
    where that lowers the estimated cost (module docstring)."""

    def cost(lo: int, hi: int, q_max: int) -> float:
        return (hi - lo) * ctx[hi - 1] * (1 + pair_cost * q_max) + _GROUP_OVERHEAD

    def best_split(lo: int, hi: int) -> int | None:
        suffix_q = [0] * (hi - lo + 1)  # suffix_q[k - lo]: longest chunk in [k, hi)
        for k in range(hi - 1, lo - 1, -1):
            suffix_q[k - lo] = max(suffix_q[k - lo + 1], q_lens[k - offset])
        best, best_k, prefix_q = cost(lo, hi, suffix_q[0]), None, 0
        for k in range(lo + 1, hi):
            prefix_q = max(prefix_q, q_lens[k - 1 - offset])
            c = cost(lo, k, prefix_q) + cost(k, hi, suffix_q[k - lo])
            if c < best:
                best, best_k = c, k
        return best_k

    spans = [(offset, offset + len(q_lens))] if q_lens else []
    for _ in range(_MAX_SPLITS):
        by_area = sorted(enumerate(spans), key=lambda e: (e[1][0] - e[1][1]) * ctx[e[1][1] - 1])
        for i, (lo, hi) in by_area:
            k = best_split(lo, hi)
            if k is not None:
                spans[i : i + 1] = [(lo, k), (k, hi)]
                break
        else:
            break
    return spans


@dataclass
class _GroupBuilder:
    table: Tensor
    starts: Tensor
    lens: Tensor
    first_tok: list[int]
    ctx: list[int]
    block_size: int
    dtype: torch.dtype
    masks: bool
    """Build the additive masks (the gather path's); False leaves ``mask`` None."""

    def _blocks(self, lo: int, hi: int) -> tuple[Tensor, int]:
        nblk = -(-max(self.ctx[lo:hi]) // self.block_size)
        # NOTE: contiguous, so that ``blocks.view(num_seqs, -1)`` has unit stride between a
        # table's entries (kvloop's kernels require it): a one-block slice of a wider table
        # would otherwise view as [n, 1] with the table's row stride in both dimensions.
        return self.table[lo:hi, :nblk].contiguous().view(-1), nblk * self.block_size

    def decodes(self, lo: int, hi: int) -> AttentionGroup:
        blocks, width = self._blocks(lo, hi)
        mask = None
        if self.masks and min(self.ctx[lo:hi]) < width:
            ctx = torch.tensor(self.ctx[lo:hi])
            allowed = torch.arange(width)[None, :] < ctx[:, None]
            mask = _additive(allowed.view(hi - lo, 1, 1, width), self.dtype)
        return AttentionGroup(lo, hi, hi - lo, blocks, mask)

    def native_decodes(self, n: int) -> AttentionGroup:
        blocks, _ = self._blocks(0, n)
        return AttentionGroup(0, n, n, blocks, None, context_lens=torch.tensor(self.ctx[:n]))

    def native_prefills(self, lo: int, hi: int) -> AttentionGroup:
        blocks, _ = self._blocks(lo, hi)
        row_start = self.first_tok[lo]
        row_end = self.first_tok[hi - 1] + int(self.lens[hi - 1])
        q_max = int(self.lens[lo:hi].max())
        return AttentionGroup(row_start, row_end, hi - lo, blocks, None, q_max,
                              context_lens=torch.tensor(self.ctx[lo:hi]),
                              starts=self.starts[lo:hi].contiguous())

    def prefills(self, lo: int, hi: int) -> AttentionGroup:
        blocks, width = self._blocks(lo, hi)
        lens = self.lens[lo:hi]
        q_max = int(lens.max())
        offs = torch.arange(q_max)
        # Padded query rows repeat their chunk's last token (valid keys, output dropped).
        local = torch.minimum(offs[None, :], (lens - 1)[:, None])
        starts = self.starts[lo:hi]
        row_start = self.first_tok[lo]
        row_end = self.first_tok[hi - 1] + int(lens[-1])
        group = AttentionGroup(row_start, row_end, hi - lo, blocks, None, q_max)
        if int(starts.max()) == 0:
            group.causal = True
        elif self.masks:
            q_pos = starts[:, None] + local
            allowed = (torch.arange(width)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
            group.mask = _additive(allowed, self.dtype)
        if int(lens.min()) < q_max:
            first = torch.tensor(self.first_tok[lo:hi]) - row_start
            group.q_index = (first[:, None] + local).reshape(-1)
            group.out_index = (offs[None, :] < lens[:, None]).reshape(-1).nonzero().squeeze(1)
        return group


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A 0 / -inf mask: SDPA would otherwise convert a bool mask again in every layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    meta.slot_mapping = meta.slot_mapping.to(device, non_blocking=True)
    for g in meta.groups:
        g.blocks = g.blocks.to(device, non_blocking=True)
        g.mask, g.q_index, g.out_index = move(g.mask), move(g.q_index), move(g.out_index)
        g.context_lens, g.starts = move(g.context_lens), move(g.starts)
    return meta


def write_kv(cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store the new tokens' K and V ([T, kv, d]) into one layer's cache
    ([2, num_blocks, block_size, kv, d]) at their slots."""
    flat = cache.view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _gather(cache: Tensor, blocks: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """K and V of the given blocks as [B, kv, L, d] (strided views of a gathered copy)."""
    # NOTE: one index_select per K and V along their leading (block) dim copies whole
    # contiguous blocks; it is about twice as fast as one select along dim 1 of both.
    shape = (batch, -1, *cache.shape[-2:])
    k = cache[0].index_select(0, blocks).view(shape).transpose(1, 2)
    v = cache[1].index_select(0, blocks).view(shape).transpose(1, 2)
    return k, v


def paged_attention(q: Tensor, cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Attention of the step's queries ``q`` ([T, H, d]) over their paged context in one
    layer's ``cache``; returns [T, H * d]. The new tokens' K/V must already be written."""
    _, num_heads, head_dim = q.shape
    num_kv = cache.shape[-2]
    rep = num_heads // num_kv
    parts: list[Tensor] = []
    for g in meta.groups:
        b = g.num_seqs
        qg = q[g.row_start : g.row_end]
        if g.context_lens is not None:
            out = q.new_empty(qg.shape[0], num_heads * head_dim)
            table = g.blocks.view(b, -1)
            if g.starts is None:
                native.call("decode_attention", qg, cache, table, g.context_lens, scale, out)
            else:
                native.call("prefill_attention", qg, cache, table, g.starts, g.context_lens,
                            scale, out)
            parts.append(out)
            continue
        k, v = _gather(cache, g.blocks, b)
        # NOTE: one-token prompts from position 0 (causal) see only their first slot: the
        # decode branch would attend every gathered slot, padding included.
        if g.q_max == 1 and not g.causal:
            # NOTE: query head h uses KV head h // rep (transformers' repeat_kv order), so
            # the heads sharing a KV head become `rep` query rows of it.
            qg = qg.view(b, num_kv, rep, head_dim)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
            parts.append(out.reshape(b, num_heads * head_dim))
            continue
        if g.causal:  # square scores: every backend's is_causal agrees on them
            k, v = k[:, :, : g.q_max], v[:, :, : g.q_max]
        out = F.scaled_dot_product_attention(
            g.queries(q), k, v, attn_mask=g.mask, is_causal=g.causal, scale=scale,
            enable_gqa=rep > 1,
        )
        parts.append(g.outputs(out))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
