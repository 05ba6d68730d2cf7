"""One engine's step end times, for summarising the simulator's requests per step.

In the simulator every token is stamped with the end of the step that sampled it, so a
request that got a token in each of a run of consecutive steps has exactly those steps'
end times as its token times. Its inter-token latencies there are the gaps between those
steps, and the summary counts them per step (how many requests' runs cover each gap)
instead of per token: the same figures, without touching each of millions of tokens.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

__all__ = ["StepTimeline"]


class StepTimeline:
    """The end times of one engine's steps, strictly increasing.

    NOTE: only valid for requests every token time of which is one of ``ends`` (the
    simulator stamps tokens with their step's end): ``runs`` relies on it."""

    def __init__(self, ends: Sequence[float]) -> None:
        self.ends = list(ends)
        self.gaps = list(map(operator.sub, self.ends[1:], self.ends))
        """``gaps[k]``: from the end of step k to the end of step k + 1."""
        increasing = all(g > 0 for g in self.gaps)
        # NOTE: with a repeated end time an index would be ambiguous: no spans then.
        self._index = {t: k for k, t in enumerate(self.ends)} if increasing else {}

    def runs(self, times: Sequence[float]) -> list[tuple[int, int]] | None:
        """``times`` (a request's token times, strictly increasing, each a step end) as
        runs of consecutive steps: (first step, how many) each, in order; None when
        ``times[0]`` or a run's first time is not a step end here.

        NOTE: with every time a step end, ``step(times[m]) - m`` never falls as m grows,
        so the end of each run is found by bisection: a handful of lookups per run, not
        one per token."""
        ends, index, n = self.ends, self._index, len(times)
        out: list[tuple[int, int]] = []
        k = 0
        while k < n:
            i = index.get(times[k])
            if i is None:
                return None
            shift = i - k  # in this run, times[m] is ends[m + shift]
            last = n - 1
            if not (last + shift < len(ends) and ends[last + shift] == times[last]):
                lo, hi = k, min(last, len(ends) - 1 - shift)  # times[lo] is in the run
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ends[mid + shift] == times[mid]:
                        lo = mid
                    else:
                        hi = mid - 1
                last = lo
            out.append((i, last - k + 1))
            k = last + 1
        return out

    def jumps(self, runs: Sequence[tuple[int, int]]) -> list[float]:
        """The gaps between consecutive ``runs`` (last step of one to first of the next)."""
        ends = self.ends
        return [ends[b] - ends[a + n - 1] for (a, n), (b, _) in itertools.pairwise(runs)]

    def pieces(self, runs: Sequence[tuple[int, int]]) -> list[tuple[int, float]]:
        """(token count, longest gap between its tokens; 0 for one) of each of ``runs``."""
        gaps = self.gaps
        return [(count, max(gaps[first:first + count - 1]) if count > 1 else 0.0)
                for first, count in runs]

    def gap_counts(self, runs: Sequence[tuple[int, int]]) -> list[tuple[float, int]]:
        """(gap, how many of ``runs`` cover it) for every gap a run covers; a run (first,
        count) covers the ``count - 1`` gaps between its steps."""
        change = [0] * (len(self.ends) + 1)
        for first, count in runs:
            change[first] += 1
            change[first + count - 1] -= 1
        out: list[tuple[float, int]] = []
        covered = 0
        for k, gap in enumerate(self.gaps):
            covered += change[k]
            if covered:
                out.append((gap, covered))
        return out
