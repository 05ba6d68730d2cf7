"""Device KV blocks: ref counts, an O(1) LRU free queue, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    """One fixed-size slab of KV cache, identified by ``block_id``."""

    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        """Set while the block is registered in the prefix cache under this hash."""
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed),
    append at the tail, and remove from the middle, all in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take the ``n`` least recently freed blocks, unlinked in one splice."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        block = self._head.next
        for _ in range(n):
            assert block is not None and block is not self._tail
            nxt = block.next
            block.prev = block.next = None
            out.append(block)
            block = nxt
        assert block is not None
        self._head.next = block
        block.prev = self._head
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """All device blocks.

    NOTE: a block is either free (ref_cnt 0, in the free queue) or owned (ref_cnt equals the
    number of requests holding it, not in the queue). A free block may keep its hash: it is
    a cached free block that a prefix hit can revive, evicted lazily (its hash dropped) only
    when ``get_new_blocks`` hands it out again, in LRU order.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        """Prefix-cache map: block hash -> the block holding that prefix's KV."""
        self.num_evictions = 0
        self.evicted: list[tuple[bytes, int]] | None = None
        """When a list (a host tier listens): (hash, block id) of each block evicted from
        the prefix cache, in order, until the listener drains it."""
        self.registered: list[KVBlock] | None = None
        """When a list (a write-through host tier listens): each block newly cached."""
        self.protected: set[bytes] = set()
        """Hashes a waiting request is about to hit: evicted only when no other free block
        is left (queue-aware eviction; empty: plain LRU)."""
        self.num_protected_skips = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (cached free blocks count as free)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks (ref_cnt 1), evicting their cached hashes."""
        out = self._pick_protected(n) if self.protected else self.free_queue.popleft_n(n)
        cached = self.cached
        for block in out:
            h = block.block_hash
            if h is not None:
                if cached.get(h) is block:
                    del cached[h]
                block.block_hash = None
                self.num_evictions += 1
                if self.evicted is not None:
                    self.evicted.append((h, block.block_id))
            block.ref_cnt = 1
        return out

    def _pick_protected(self, n: int) -> list[KVBlock]:
        """The ``n`` least recently freed blocks, passing over protected ones while others
        are left. NOTE: bounded: it walks at most ``n`` + len(protected) queue entries."""
        queue, protected = self.free_queue, self.protected
        if n > queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {queue.num_free} free")
        out: list[KVBlock] = []
        kept: list[KVBlock] = []
        budget = n + len(protected)
        for block in queue:
            if len(out) == n or budget <= 0:
                break
            budget -= 1
            if block.block_hash is not None and block.block_hash in protected:
                kept.append(block)
            else:
                out.append(block)
        if len(out) < n:
            # NOTE: not enough unprotected blocks in reach: LRU order among the rest.
            chosen = {b.block_id for b in out}
            for block in queue:
                if len(out) == n:
                    break
                if block.block_id not in chosen:
                    out.append(block)
        else:
            self.num_protected_skips += len(kept)
        for block in out:
            queue.remove(block)
        return out

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's prefix-cache entry (its KV may never have been written)."""
        h = block.block_hash
        if h is not None:
            if self.cached.get(h) is block:
                del self.cached[h]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each block, reviving cached free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block; blocks reaching 0 join the free queue's tail in
        the given order (so pass the ones to evict first, first)."""
        queue = self.free_queue
        tail = queue._tail
        freed = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                # NOTE: ``FreeBlockQueue.append`` inlined (a finish frees all its blocks)
                last = tail.prev
                assert last is not None
                last.next = block
                block.prev = last
                block.next = tail
                tail.prev = block
                freed += 1
        queue.num_free += freed

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its prefix hash (first writer wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
            if self.registered is not None:
                self.registered.append(block)

    def check_invariants(self, owners: dict[int, int]) -> None:
        """Assert pool consistency. ``owners`` maps block_id -> number of owning requests."""
        in_queue = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.num_free, "free count drifted"
        for block in self.blocks:
            n = owners.get(block.block_id, 0)
            assert block.ref_cnt == n, f"{block} has {n} owners"
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), (
                f"{block} must be free xor owned"
            )
        assert len(in_queue) + sum(1 for b in self.blocks if b.ref_cnt) == self.num_blocks
        for h, block in self.cached.items():
            assert block.block_hash == h, f"hash {h} maps to reused {block}"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self.cached), "a block keeps a hash the map no longer has"
