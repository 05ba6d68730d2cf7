"""Host memory behind the device pool: swap space and the prefix cache's second tier.

One pool of host blocks serves two users. Swap preemption takes blocks for a victim's whole
table and gives them back when the victim is swapped in or finishes. The prefix tier keeps
full blocks evicted from (write-back) or registered in (write-through) the device prefix
cache, under the same chained hash, in its own LRU order and up to its own limit, so a
later request whose prefix left the device loads it back instead of recomputing it.

NOTE: the two users never corrupt each other:

- a swap takes free blocks first, then reclaims the prefix tier's least recently used
  blocks (the prefix tier holds copies, a swapped request holds the only copy of its KV);
  the prefix tier never takes a block a swapped request holds;
- a host block a transfer of the step being built or of the step in flight reads or
  writes is pinned: neither user can take it over until that step ran (``begin_step``);
- host blocks a swap-in releases stay unusable until that step ran too, so a store of the
  same step (device -> host, executed first) cannot overwrite them before they are read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostTierStats:
    """Running totals of the prefix cache's host tier (blocks; bytes are blocks times the
    block's size in bytes, which the executor knows)."""

    device_hit_blocks: int = 0
    """Blocks admissions found in the device prefix cache."""
    host_hit_blocks: int = 0
    """Blocks admissions loaded back from the host tier."""
    host_recomputed_blocks: int = 0
    """Blocks admissions found in the host tier and chose to recompute (cheaper)."""
    blocks_stored: int = 0
    """Blocks copied device -> host into the prefix tier."""
    blocks_loaded: int = 0
    """Blocks copied host -> device for prefix hits."""
    host_evictions: int = 0
    """Prefix-tier blocks dropped for room (its LRU, or reclaimed by swap)."""


class HostTier:
    """The host block pool: a free list shared with swap, and the prefix tier's LRU map."""

    def __init__(self, num_swap_blocks: int, num_prefix_blocks: int) -> None:
        self.num_blocks = num_swap_blocks + num_prefix_blocks
        self.prefix_limit = num_prefix_blocks
        """Most blocks the prefix tier holds at once."""
        # NOTE: pop from the end, so ids are handed out 0, 1, 2, ... as the swap tier
        # always did.
        self.free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.cached: OrderedDict[bytes, int] = OrderedDict()
        """Prefix tier: block hash -> host block, least recently used first."""
        self._hash_of: dict[int, bytes] = {}
        self.pending_pins: set[int] = set()
        """Host blocks the transfers of the step being built touch."""
        self.inflight_pins: set[int] = set()
        """Host blocks the transfers of the step handed to the executor touch."""
        self.releasing: list[int] = []
        """Host blocks released by swap-ins of the step in flight (free once it ran)."""
        self.stats = HostTierStats()

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def num_reclaimable(self) -> int:
        """Prefix-tier blocks a swap could take over now (those no transfer pins)."""
        pins = self.pending_pins | self.inflight_pins
        if not pins:
            return len(self.cached)
        return sum(1 for h in self.cached.values() if h not in pins)

    def _pinned(self, host_block: int) -> bool:
        return host_block in self.pending_pins or host_block in self.inflight_pins

    # -- swap ----------------------------------------------------------------------------
    def can_take(self, n: int) -> bool:
        """Whether a swap of ``n`` blocks fits (free blocks, then reclaimed prefix ones)."""
        free = len(self.free)
        return n <= free or (self.prefix_limit > 0 and n <= free + self.num_reclaimable())

    def take(self, n: int) -> list[int]:
        """``n`` host blocks for a swap: free ones first, then the prefix tier's LRU."""
        if len(self.free) < n:
            self._reclaim(n - len(self.free))
        free = self.free
        return [free.pop() for _ in range(n)]

    def release(self, blocks: list[int], *, deferred: bool = False) -> None:
        """Give swap blocks back; ``deferred``: only once the step in flight ran."""
        (self.releasing if deferred else self.free).extend(blocks)

    def _reclaim(self, n: int) -> None:
        for h, host in list(self.cached.items()):
            if n <= 0:
                break
            if not self._pinned(host):
                self._drop(h)
                n -= 1
        if n > 0:
            raise RuntimeError(f"host tier cannot free {n} more blocks")

    def _drop(self, block_hash: bytes) -> None:
        host = self.cached.pop(block_hash)
        del self._hash_of[host]
        self.free.append(host)
        self.stats.host_evictions += 1

    # -- prefix tier ---------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash``'s KV, or None (no LRU change)."""
        return self.cached.get(block_hash)

    def pin_for_load(self, block_hash: bytes) -> int:
        """Mark a hit as used by a load of this step: most recently used, and pinned."""
        host = self.cached[block_hash]
        self.cached.move_to_end(block_hash)
        self.pending_pins.add(host)
        return host

    def store(self, block_hash: bytes) -> int | None:
        """A host block to copy ``block_hash``'s device block into, or None: already held
        (then only marked recently used) or no room (every candidate is pinned)."""
        if self.prefix_limit <= 0:
            return None
        cached = self.cached
        if block_hash in cached:
            cached.move_to_end(block_hash)
            return None
        if len(cached) >= self.prefix_limit or not self.free:
            victim = next((h for h, host in cached.items() if not self._pinned(host)), None)
            if victim is None:
                return None
            self._drop(victim)
        if not self.free:
            return None
        host = self.free.pop()
        cached[block_hash] = host
        self._hash_of[host] = block_hash
        self.pending_pins.add(host)
        self.stats.blocks_stored += 1
        return host

    def forget(self, host_block: int) -> None:
        """Drop a prefix-tier block whose store may never have run (a failed step)."""
        h = self._hash_of.get(host_block)
        if h is not None:
            self._drop(h)
            self.stats.host_evictions -= 1  # NOTE: not an eviction, an undone store
            self.stats.blocks_stored -= 1

    # -- steps ---------------------------------------------------------------------------
    def hand_over(self) -> None:
        """The transfers built so far go to the executor with this step."""
        self.inflight_pins = self.pending_pins
        self.pending_pins = set()

    def begin_step(self) -> None:
        """The step in flight ran: its pins and deferred releases end."""
        self.inflight_pins = set()
        if self.releasing:
            self.free.extend(self.releasing)
            self.releasing = []

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self, swapped: list[int]) -> None:
        """Assert every host block is exactly one of: free, releasing, a swapped request's
        (``swapped``), a prefix-tier block."""
        prefix = list(self.cached.values())
        every = self.free + self.releasing + swapped + prefix
        assert len(every) == self.num_blocks, (
            f"host blocks leaked or doubled: {len(every)} of {self.num_blocks}")
        assert len(set(every)) == self.num_blocks, "a host block has two owners"
        assert len(prefix) <= self.prefix_limit, "the prefix tier is over its limit"
        assert {v: k for k, v in self.cached.items()} == self._hash_of, "host map drifted"
