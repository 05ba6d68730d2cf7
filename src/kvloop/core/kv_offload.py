"""The prefix cache's host tier and queue-aware eviction, as the KV manager uses them.

Part of ``KVCacheManager`` (a mixin: the state is the manager's). A lookup continues the
device prefix hits into the host tier along the same chained hashes; whether those host
blocks are loaded or recomputed is decided per request by ``LoadCosts``. The transfers a
step needs (device -> host stores, host -> device loads) collect here and go out with the
step's ``SchedulerOutput``.

NOTE: ordering contract with the executors (``SchedulerOutput``): stores and swap-outs
(device -> host) run before swap-ins and loads (host -> device), which run before the
forward pass. So a store reads a device block before anything of its step overwrites it,
and a load writes its device block before any request of the step attends over it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloop.core.host_tier import HostTier

if TYPE_CHECKING:
    from kvloop.config import CacheConfig
    from kvloop.core.block_pool import BlockPool
    from kvloop.core.prefix_hash import HashMemo
    from kvloop.core.request import Request


class HostHit:
    """A prefix block found in the host tier: loaded into a fresh device block on admission.

    NOTE: ``ref_cnt`` 1 makes it count as a hit that revives no cached free device block."""

    __slots__ = ("block_hash", "host_block")
    ref_cnt = 1

    def __init__(self, block_hash: bytes, host_block: int) -> None:
        self.block_hash = block_hash
        self.host_block = host_block


@dataclass(frozen=True)
class LoadCosts:
    """What loading and recomputing prefix blocks cost, for the per-request choice."""

    policy: str = "auto"
    """``auto`` (the cheaper one), ``load`` (always) or ``recompute`` (never load)."""
    load_s_per_block: float = 0.0
    load_latency_s: float = 0.0
    recompute_s_per_token: float = 0.0
    """0: unknown, so ``auto`` loads."""

    def load(self, num_blocks: int, block_size: int) -> bool:
        """Whether loading ``num_blocks`` host blocks beats recomputing their tokens."""
        if self.policy != "auto":
            return self.policy == "load"
        if self.recompute_s_per_token <= 0:
            return True
        load_s = self.load_latency_s + num_blocks * self.load_s_per_block
        return load_s <= num_blocks * block_size * self.recompute_s_per_token


class KVOffload:
    """Host-tier lookups, stores, loads and queue-aware protection for ``KVCacheManager``."""

    pool: BlockPool
    host: HostTier
    block_size: int
    enable_caching: bool
    _hashes: HashMemo

    def _init_offload(self, cfg: CacheConfig) -> None:
        self.host_prefix = cfg.kv_offload_blocks > 0 and cfg.enable_prefix_caching
        """Whether the prefix cache has a host tier (no prefix cache: no tier)."""
        self.host = HostTier(cfg.num_cpu_blocks, cfg.kv_offload_blocks if self.host_prefix
                             else 0)
        self.queue_aware = cfg.kv_eviction == "queue-aware" and cfg.enable_prefix_caching
        self.lookahead = cfg.kv_eviction_lookahead
        self.plain_lru = not (self.host_prefix or self.queue_aware)
        """True when eviction is the device pool's plain LRU and nothing is offloaded: what
        fast-forward's proof assumes."""
        self.costs = LoadCosts(cfg.kv_offload_load, cfg.kv_load_s_per_block,
                               cfg.kv_load_latency_s, cfg.kv_recompute_s_per_token)
        self._loads: list[tuple[int, int]] = []
        self._stores: list[tuple[int, int]] = []
        self._loads_inflight: list[tuple[int, int, bytes]] = []
        self._loads_pending: list[tuple[int, int, bytes]] = []
        self._stores_inflight: list[tuple[int, int]] = []
        self._choices: dict[str, tuple[str, int]] = {}
        """Per looked-up request: the load-or-recompute choice for its host hits."""
        self.step_choices: list[tuple[str, str, int]] = []
        """(request_id, ``load`` or ``recompute``, host blocks) of this step's admissions."""
        if self.host_prefix:
            self.pool.evicted = []
            if cfg.kv_offload_write_policy == "write_through":
                self.pool.registered = []

    # -- lookups -------------------------------------------------------------------------
    def _host_hits(self, request: Request, hashes: list[bytes], start: int, limit: int
                   ) -> list[HostHit]:
        """Continue a lookup from block ``start`` in the host tier; decide load or recompute.

        NOTE: the host blocks found are pinned for this step and the next, so no store or
        swap can take them over between the lookup and the admission's load."""
        self._drain()
        host = self.host
        found: list[HostHit] = []
        for h in hashes[start:limit]:
            hb = host.lookup(h)
            if hb is None:
                break
            found.append(HostHit(h, hb))
        if not found:
            self._choices.pop(request.request_id, None)
            return found
        if not self.costs.load(len(found), self.block_size):
            self._choices[request.request_id] = ("recompute", len(found))
            return []
        self._choices[request.request_id] = ("load", len(found))
        host.pending_pins.update(f.host_block for f in found)
        return found

    def _load_hits(self, request: Request, hits: list, num_device: int) -> list:
        """Fresh device blocks for the host hits among ``hits`` (after ``num_device`` device
        ones), registered under their hashes with a load queued for each."""
        host, pool = self.host, self.pool
        todo = hits[num_device:]
        for hit in todo:
            host.pin_for_load(hit.block_hash)
        blocks = pool.get_new_blocks(len(todo))
        for hit, block in zip(todo, blocks, strict=True):
            pool.cache_block(block, hit.block_hash)
            self._loads_pending.append((hit.host_block, block.block_id, hit.block_hash))
        host.stats.host_hit_blocks += len(todo)
        host.stats.blocks_loaded += len(todo)
        return blocks

    def _note_admission(self, request: Request, num_device: int) -> None:
        st = self.host.stats
        st.device_hit_blocks += num_device
        choice = self._choices.pop(request.request_id, None)
        if choice is not None:
            self.step_choices.append((request.request_id, *choice))
            if choice[0] == "recompute":
                st.host_recomputed_blocks += choice[1]

    # -- stores --------------------------------------------------------------------------
    def _drain(self) -> None:
        """Queue stores for blocks the device cache registered (write-through) or evicted
        (both policies) since the last drain."""
        pool, host, stores = self.pool, self.host, self._stores
        registered = pool.registered
        if registered:
            for block in registered:
                h = block.block_hash
                if h is not None:  # NOTE: else evicted since: the eviction list has it
                    hb = host.store(h)
                    if hb is not None:
                        stores.append((block.block_id, hb))
            registered.clear()
        evicted = pool.evicted
        if evicted:
            for h, block_id in evicted:
                hb = host.store(h)
                if hb is not None:
                    stores.append((block_id, hb))
            evicted.clear()

    # -- steps ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The previous step ran: its pins end and its deferred releases are free."""
        self.host.begin_step()
        self._loads_inflight = []
        self._stores_inflight = []

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                      list[tuple[str, str, int]]]:
        """This step's (host, device) loads, (device, host) stores and load-or-recompute
        choices, handed over with its output."""
        if not self.host_prefix:
            return [], [], []
        self._drain()
        loads = [(hb, d) for hb, d, _ in self._loads_pending]
        stores = self._stores
        self._loads_inflight, self._loads_pending = self._loads_pending, []
        self._stores_inflight, self._stores = stores, []
        self.host.hand_over()
        choices, self.step_choices = self.step_choices, []
        return loads, stores, choices

    def abandon_transfers(self) -> None:
        """The step failed (or was never handed over): its loads and stores may not have
        run, so the device blocks loaded into and the host blocks stored into hold no KV
        worth finding. Drop their cache entries (the blocks stay with their owners)."""
        if not self.host_prefix:
            return
        self._drain()
        blocks = self.pool.blocks
        for _, d, h in self._loads_inflight + self._loads_pending:
            if blocks[d].block_hash == h:
                self.pool.uncache(blocks[d])
        for _, hb in self._stores_inflight + self._stores:
            self.host.forget(hb)
        self._loads_inflight, self._loads_pending = [], []
        self._stores_inflight, self._stores = [], []
        self.host.pending_pins = set()
        self.host.inflight_pins = set()

    # -- queue-aware eviction ------------------------------------------------------------
    def protect(self, waiting: Iterable[Request]) -> None:
        """Protect from eviction the cached device blocks the first ``lookahead`` waiting
        requests (in admission order) would hit. NOTE: bounded work: those requests' cached
        prefixes, hashed once per request (memo)."""
        if not self.queue_aware:
            return
        pool, bs, memo = self.pool, self.block_size, self._hashes
        cached, host = pool.cached, self.host
        protected: set[bytes] = set()
        for req in itertools.islice(waiting, self.lookahead):
            hashes = req.update_block_hashes(bs, memo)
            for h in hashes[:(req.num_tokens - 1) // bs]:
                if h in cached:
                    protected.add(h)
                elif host.lookup(h) is None:
                    break
        pool.protected = protected
