"""The host block pool as a state machine: swap and the prefix tier never take each other's
blocks, pinned blocks keep their KV until their step ran, deferred releases stay unused."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvloop.core.host_tier import HostTier


class HostPool(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = HostTier(num_swap_blocks=3, num_prefix_blocks=5)
        self.content: dict[int, object] = {}
        """Host block -> what was last written into it."""
        self.swaps: dict[int, list[int]] = {}
        self.pinned: dict[int, bytes] = {}
        """Host block -> the hash a load or store of an unfinished step relies on."""
        self.pending: dict[int, bytes] = {}
        self.releasing: set[int] = set()
        self.next_swap = 0

    def _fresh(self, blocks: list[int]) -> None:
        for hb in blocks:
            assert hb not in self.pinned and hb not in self.pending, "a pinned block taken"
            assert hb not in self.releasing, "a block released by a swap-in reused early"
            for other in self.swaps.values():
                assert hb not in other, "a swapped request's block taken"

    @rule(h=st.integers(0, 9))
    def store(self, h: int) -> None:
        key = bytes([h])
        hb = self.t.store(key)
        if hb is not None:
            self._fresh([hb])
            self.content[hb] = key
            self.pending[hb] = key

    @rule(h=st.integers(0, 9))
    def load(self, h: int) -> None:
        key = bytes([h])
        if self.t.lookup(key) is not None:
            hb = self.t.pin_for_load(key)
            assert self.content[hb] == key
            self.pending[hb] = key

    @rule(n=st.integers(1, 4))
    def swap_out(self, n: int) -> None:
        if self.t.can_take(n):
            blocks = self.t.take(n)
            self._fresh(blocks)
            self.swaps[self.next_swap] = blocks
            for hb in blocks:
                self.content[hb] = ("swap", self.next_swap)
            self.next_swap += 1

    @precondition(lambda self: self.swaps)
    @rule(data=st.data(), deferred=st.booleans())
    def swap_in_or_finish(self, data: st.DataObject, deferred: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swaps)))
        blocks = self.swaps.pop(sid)
        for hb in blocks:
            assert self.content[hb] == ("swap", sid), "a swapped request's KV overwritten"
        self.t.release(blocks, deferred=deferred)
        if deferred:
            self.releasing.update(blocks)

    @rule()
    def hand_over(self) -> None:
        self.t.hand_over()
        self.pinned = self.pending
        self.pending = {}

    @rule()
    def step_ran(self) -> None:
        self.t.begin_step()
        self.pinned = {}
        self.releasing = set()

    @invariant()
    def consistent(self) -> None:
        self.t.check_invariants([hb for b in self.swaps.values() for hb in b])
        for key, hb in self.t.cached.items():
            assert self.content[hb] == key, "a prefix block's KV overwritten"
        for hb, key in {**self.pinned, **self.pending}.items():
            assert self.t.cached.get(key) == hb, "a pinned prefix block lost"


HostPool.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestHostPool = HostPool.TestCase
