"""The scheduler's view of KV memory: per-request block tables, prefix lookups, swapping.

It hides the block pool: the scheduler asks "can this request get slots for n more
tokens?" and receives block ids; it never touches blocks, ref counts or block tables, and
it reports progress (``commit_computed``) without deciding what gets cached.
"""

from __future__ import annotations

from kvloop.config import CacheConfig
from kvloop.core.block_pool import BlockPool, KVBlock
from kvloop.core.kv_offload import HostHit, KVOffload
from kvloop.core.prefix_hash import HashMemo
from kvloop.core.request import Request


class KVCacheManager(KVOffload):
    """Paged KV allocation for requests, with prefix caching and a host tier shared by swap
    preemption and (optionally) the prefix cache's second level (``kv_offload``)."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.num_gpu_blocks = cache_config.num_gpu_blocks
        self.num_cpu_blocks = cache_config.num_cpu_blocks + (
            cache_config.kv_offload_blocks if cache_config.enable_prefix_caching else 0)
        """Host blocks in all: swap space plus the prefix cache's host tier."""
        self.enable_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_gpu_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        """Device block table per running request, in token order."""
        self._num_registered: dict[str, int] = {}
        """How many leading blocks of each request were offered to the prefix cache."""
        self.swapped_blocks: dict[str, list[int]] = {}
        """Host block table per swapped-out request."""
        self._hashes = HashMemo()
        """Hashes computed before, for requests that repeat a prompt or its outputs."""
        self._init_offload(cache_config)

    @property
    def cpu_free(self) -> list[int]:
        """Free host blocks."""
        return self.host.free

    # -- sizes -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.host.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_freeable_blocks(self, request: Request) -> int:
        """Device blocks that preempting ``request`` would free (those it alone holds)."""
        return sum(1 for b in self.req_blocks.get(request.request_id, ()) if b.ref_cnt == 1)

    def num_blocks_short(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks missing for ``num_new_tokens`` more slots of a running request."""
        have = len(self.req_blocks.get(request.request_id, ()))
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        return max(0, need - self.pool.free_queue.num_free)

    def device_owners(self) -> set[str]:
        """Requests holding device blocks."""
        return set(self.req_blocks)

    def host_owners(self) -> set[str]:
        """Requests holding host (swap) blocks."""
        return set(self.swapped_blocks)

    # -- prefix cache ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding the longest known prefix of the request's tokens.

        NOTE: the last known token is never served from cache: it must be computed to
        produce the logits of the next token. The scheduler counts queries and hits when
        it admits the request (a lookup that is not admitted is not counted).
        """
        if not self.enable_caching:
            return []
        hashes = request.update_block_hashes(self.block_size, self._hashes)
        limit = (request.num_tokens - 1) // self.block_size
        cached = self.pool.cached
        hits: list[KVBlock] = []
        for h in hashes[:limit]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        if self.host_prefix and len(hits) < limit:
            # NOTE: the chain goes on in the host tier (``HostHit``s after the device hits)
            hits.extend(self._host_hits(request, hashes, len(hits), limit))  # type: ignore
        return hits

    def commit_computed(self, requests: list[Request]) -> None:
        """After a step: offer the blocks these requests filled to the prefix cache.

        NOTE: a block is cached only once every token in it is computed, so a hit never
        serves KV that was not written."""
        if not self.enable_caching:
            return
        block_size = self.block_size
        registered = self._num_registered
        cache_block = self.pool.cache_block
        memo = self._hashes
        for request in requests:
            num_full = request.num_computed_tokens // block_size
            rid = request.request_id
            done = registered[rid]
            if num_full <= done:
                continue
            hashes = request.update_block_hashes(block_size, memo)
            blocks = self.req_blocks[rid]
            if num_full == done + 1:
                cache_block(blocks[done], hashes[done])  # NOTE: the common case: one block
            else:
                for i in range(done, num_full):
                    cache_block(blocks[i], hashes[i])
            registered[rid] = num_full

    def commit_one_token(self, requests: list[Request]) -> None:
        """``commit_computed`` for requests that each computed at most one token since the
        last commit (the others were committed already): only those now at a block boundary
        can have filled a block."""
        if self.enable_caching:
            block_size = self.block_size
            self.commit_filled([r for r in requests if r.num_computed_tokens % block_size == 0])

    def commit_filled(self, requests: list[Request]) -> None:
        """``commit_computed`` for requests at a block boundary that each computed one token
        since the last commit. NOTE: the decode steady state, one block each, inlined: a
        request past its prompt whose hashes and registrations stop just before the block it
        filled has that one block hashed (``update_block_hashes``' single-block case) and
        offered; any other goes through ``commit_computed``, in turn."""
        if not self.enable_caching:
            return
        block_size = self.block_size
        registered, tables, memo = self._num_registered, self.req_blocks, self._hashes
        cache_block = self.pool.cache_block
        for r in requests:
            rid = r.request_id
            k = registered[rid]
            hashes = r.block_hashes
            start = k * block_size
            num_prompt = r.num_prompt_tokens
            if (k and len(hashes) == k and start >= num_prompt
                    and r.num_computed_tokens == start + block_size
                    and (num_prompt + len(r.output_token_ids)) // block_size == k + 1):
                first = start - num_prompt
                h = memo.block(hashes[k - 1], r.output_token_ids[first:first + block_size])
                hashes.append(h)
                cache_block(tables[rid][k], h)
                registered[rid] = k + 1
            else:
                self.commit_computed([r])

    def commit_lagging_block(self, request: Request, num_filled: int,
                             tokens: tuple[int, ...]) -> bool:
        """``commit_filled`` for a decoding request whose computed tokens just filled its
        ``num_filled``-th block, of ``tokens``, some of which may not be in its outputs yet
        (sampled in a fast-forward, which appends them later). Does it and returns True
        when that block is the one after those its hashes and registrations cover, holds
        output tokens only and agrees with the outputs it overlaps; else returns False,
        doing nothing.

        NOTE: the hash goes onto ``block_hashes`` ahead of the outputs: ``update_block_hashes``
        only extends the list, so it computes nothing more once the outputs catch up (with
        blocks of more than one token, stepping's list then ends at this block too)."""
        if not self.enable_caching:
            return True
        k = num_filled - 1
        rid = request.request_id
        hashes = request.block_hashes
        block_size = self.block_size
        first = k * block_size - request.num_prompt_tokens
        if (block_size == 1 or not k or first < 0 or len(hashes) != k
                or self._num_registered[rid] != k):
            return False
        outputs = request.output_token_ids
        known = len(outputs) - first
        if known > 0 and outputs[first:first + block_size] != list(tokens[:known]):
            return False
        h = self._hashes.block(hashes[k - 1], tokens)
        hashes.append(h)
        self.pool.cache_block(self.req_blocks[rid][k], h)
        self._num_registered[rid] = num_filled
        return True

    # -- allocation ------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` after the computed ones; return the ids of the
        blocks added to the request's table (prefix hits first), or None if they do not fit.

        ``computed_blocks`` (prefix hits) are only given at admission, when the request has
        no table yet and ``request.num_computed_tokens`` already counts them.
        """
        blocks = self.req_blocks.get(request.request_id)
        have = len(blocks) if blocks is not None else 0
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if need <= have and not computed_blocks:
            return []  # NOTE: the decode fast path: the new slots are in the last block
        rid = request.request_id
        hits = computed_blocks or ()
        need -= have + len(hits)
        # Cached free blocks revived by a hit leave the free queue too.
        revive = sum(1 for b in hits if b.ref_cnt == 0)
        num_device = len(hits)
        if self.host_prefix:
            num_device -= sum(1 for b in hits if type(b) is HostHit)
        # NOTE: a host hit takes a fresh device block to load into.
        if max(need, 0) + revive + len(hits) - num_device > self.pool.free_queue.num_free:
            return None
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            # NOTE: every request with a device table has an entry (commit_computed).
            self._num_registered[rid] = len(hits)
            if self.host_prefix:
                self._note_admission(request, num_device)
        new: list[KVBlock] = []
        if hits:
            device = hits if num_device == len(hits) else hits[:num_device]
            self.pool.touch(device)  # NOTE: first: loads must not evict these hits
            new.extend(device)
            if num_device < len(hits):
                new.extend(self._load_hits(request, list(hits), num_device))
        if need > 0:
            new.extend(self.pool.get_new_blocks(need))
        blocks.extend(new)
        return [b.block_id for b in new]

    def allocate_decodes(self, requests: list[Request]) -> tuple[int, dict[str, list[int]]]:
        """One more slot for each of the leading ``requests`` (all running, with a table),
        in order, up to the first that would find no free block: what ``allocate_slots(r,
        1)`` does for each in turn until one returns None. Returns how many got their slot,
        and the new block ids of those that needed one."""
        tables, block_size = self.req_blocks, self.block_size
        full = [i for i, r in enumerate(requests)
                if len(tables[r.request_id]) * block_size <= r.num_computed_tokens]
        count = len(requests)
        free = self.pool.free_queue.num_free
        if len(full) > free:
            count = full[free]  # NOTE: the first to find no block; those before it fit
            del full[free:]
        if not full:
            return count, {}
        ids = [requests[i].request_id for i in full]
        return count, {rid: [b.block_id] for rid, b in zip(ids, self.append_blocks(ids),
                                                           strict=True)}

    def append_blocks(self, request_ids: list[str]) -> list[KVBlock]:
        """One new block at the end of each request's table, taken in order (the caller
        checked that enough are free); returns them."""
        tables = self.req_blocks
        blocks = self.pool.get_new_blocks(len(request_ids))
        for rid, block in zip(request_ids, blocks, strict=True):
            tables[rid].append(block)
        return blocks

    def fork(self, parent: Request, children: list[Request]) -> list[tuple[int, int]] | None:
        """Give each child the parent's computed KV: its full blocks shared (ref counts),
        its partial last block copied into a new block. Returns the (source, destination)
        copies, or None, changing nothing, if the free blocks do not cover the copies and
        one more slot for every sequence."""
        rid = parent.request_id
        blocks = self.req_blocks[rid]
        computed = parent.num_computed_tokens
        num_full, partial = divmod(computed, self.block_size)
        # NOTE: each child takes one new block: its copy of the partial block (which has a
        # free slot for the next token) or, at a block boundary, a block for that token;
        # the parent may need one too. Checked up front so that a fork never half-happens.
        parent_need = max(0, -(-(computed + 1) // self.block_size) - len(blocks))
        if len(children) + parent_need > self.pool.free_queue.num_free:
            return None
        shared = blocks[:num_full]
        copies = []
        registered = min(self._num_registered[rid], num_full)
        for child in children:
            self.pool.touch(shared)
            table = list(shared)
            if partial:
                (new,) = self.pool.get_new_blocks(1)
                copies.append((blocks[num_full].block_id, new.block_id))
                table.append(new)
            self.req_blocks[child.request_id] = table
            self._num_registered[child.request_id] = registered
        return copies

    def free(self, request: Request) -> None:
        """Release the request's device blocks (tail first, so shared prefixes stay cached
        longest) and any host blocks it holds."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self._num_registered.pop(rid, None)
        if self._choices:
            self._choices.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        host = self.swapped_blocks.pop(rid, None)
        if host:
            self.host.release(host)

    # -- swapping --------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.host.can_take(len(self.req_blocks.get(request.request_id, ())))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host tier; return (device, host) copy pairs.

        The device blocks are released; their prefix hashes stay cached until evicted.
        """
        rid = request.request_id
        if not self.host.can_take(len(self.req_blocks[rid])):
            raise RuntimeError(f"host tier cannot hold {rid}")
        blocks = self.req_blocks.pop(rid)
        self._num_registered.pop(rid, None)
        host = self.host.take(len(blocks))
        self.swapped_blocks[rid] = host
        pairs = [(b.block_id, h) for b, h in zip(blocks, host, strict=True)]
        self.pool.free_blocks(reversed(blocks))
        return pairs

    def drop_swapped(self, request: Request) -> int:
        """Forget a swapped-out request's host copy (a failed step may never have written
        it); returns how many host blocks were released."""
        host = self.swapped_blocks.pop(request.request_id)
        self.host.release(host)
        return len(host)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        host = self.swapped_blocks.get(request.request_id, ())
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(total, len(host)) <= self.pool.free_queue.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back into fresh device blocks; (host, device) pairs."""
        rid = request.request_id
        if len(self.swapped_blocks[rid]) > self.pool.free_queue.num_free:
            raise RuntimeError(f"not enough free device blocks to swap {rid} in")
        host = self.swapped_blocks.pop(rid)
        blocks = self.pool.get_new_blocks(len(host))
        self.req_blocks[rid] = blocks
        self._num_registered[rid] = 0
        # NOTE: with a prefix host tier, a store of this step could take these blocks
        # before the swap-in read them: they are free once the step ran.
        self.host.release(host, deferred=self.host_prefix)
        return [(h, b.block_id) for h, b in zip(host, blocks, strict=True)]

    # -- checks ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool and both tiers are consistent with the block tables."""
        owners: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        self.pool.check_invariants(owners)
        host = [h for t in self.swapped_blocks.values() for h in t]
        self.host.check_invariants(host)
        assert not set(self.req_blocks) & set(self.swapped_blocks), "request on both tiers"
