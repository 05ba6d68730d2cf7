"""Fast-forward: runs of steps in which the running requests only decode, applied in bulk.

Part of ``Scheduler`` (its state: ``kvloop.core.state.SchedulerState``). The simulator spends most
of its steps with a steady batch: every running request decodes one token, and stepping
costs O(running) a step. ``fast_forward_decodes`` applies such steps with each decoding
request brought up to date lazily (``_Decoders``: when it fills a block that is offered
to the prefix cache, when it finishes, when something must read it, and at the end), so
a step costs O(1) plus the requests crossing a block boundary or finishing in it.

Every step is still the scheduler's decision:

- the running pass is the bulk path of ``_schedule_running``, which applies when every
  running request decodes, the budget covers them and the free blocks cover those at a
  block boundary (checked before each step; otherwise the run stops there);
- the other passes are the scheduler's own (``_passes[1:]``), run on the exact state, with
  the decodes charged to the step, whenever requests wait; or, where they are certain to
  admit nothing, skipped, with their side effects replayed (``_WaitingGate``);
- results go through ``StepResults``' pieces in ``update_from_output``'s order, for the
  requests admitted in the step; the decodes' tokens, block commits and finishes are
  applied in bulk in their place of that order.

So blocks (ids, LRU order, evictions), prefix-cache registrations, tokens, timestamps,
finishes, statistics and step indices are those of stepping, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvloop.core.admission_room import HEADROOM_TOKENS, pending_prompt_blocks
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import StepBuilder
from kvloop.core.waiting_gate import WaitingGate

if TYPE_CHECKING:
    from kvloop.core.kv_cache_manager import KVCacheManager

_RUNNING = RequestStatus.RUNNING
_LENGTH = RequestStatus.FINISHED_LENGTH

StepRun = Callable[[int, int, list[tuple[int, int]]], object]
"""Runs one step: ``(num_decodes, decode_context, chunks)`` as ``SimulatedExecutor`` derives
them from a ``SchedulerOutput`` (requests computing one token, Σ of their contexts including
it, and (c, p) of the others in the order of ``new_requests``). It leaves the scheduler's
clock at the step's end."""


class FastForward(SchedulerState):
    """``fast_forward_decodes`` for ``Scheduler``."""

    def fast_forward_decodes(self, execute: StepRun, between: Callable[[], bool], *,
                             token_id: int) -> int:
        """Run the coming steps while the running requests only decode, each step exactly
        as ``schedule()``, the executor (``execute``, ``token_id`` sampled for every
        request) and ``update_from_output`` would. Returns how many steps ran (0: the next
        step must be run the usual way).

        ``between()`` is called before each step after the first, for what happens at a
        step's end outside the scheduler (requests join); False stops the run there, with
        nothing changed. Requests that join may be admitted (under a policy that never
        preempts for them, scheduling decode-first) or wait. No step runs while a step is
        pending or a recorder is attached (each step must then be recorded).
        """
        if not self._may_fast_forward():
            return 0
        kv, cfg = self.kv, self.config
        budget = cfg.max_num_batched_tokens
        tables, bs = kv.req_blocks, kv.block_size
        if len(self.running) > budget or kv.num_free_blocks < sum(
                1 for r in self.running if len(tables[r.request_id]) * bs <= r.num_computed_tokens):
            return 0  # NOTE: the first step's decodes do not fit (checked before the setup)
        dec = _Decoders(bs, kv.enable_caching, token_id)
        if not dec.join_all(self.running, tables, 0):
            return 0
        admits = cfg.scheduling_order == "decode-first" and not self.policy.preempts_running
        free_queue, waiting, clock, stats = kv.pool.free_queue, self.waiting, self.clock, self.stats
        alloc, alive, filling, finishing = dec.alloc, dec.alive, dec.filling, dec.finishing
        times = dec.times
        gate: WaitingGate | None = None
        step = 0
        while True:
            j = step + 1
            cls = alloc[j % bs]
            needs = [i for i, first in cls if alive[i] and j >= first] if cls else []
            if dec.live > budget or len(needs) > free_queue.num_free:
                break  # NOTE: some decode would not fit: the scheduler decides
            if step and not between():
                break
            if not dec.live:
                break  # NOTE: so that no step is empty (an empty step leaves the engine idle)
            admit = False
            if not len(waiting):
                gate = None
            else:
                if gate is None or gate.num_waiting != len(waiting) or gate.step != step:
                    gate = WaitingGate.make(self, dec, j)
                if gate is not None and gate.admits_nothing(j, free_queue.num_free - len(needs)):
                    pass
                elif admits:
                    admit, gate = True, None
                else:
                    break
            # NOTE: from here on step j happens.
            step = j
            self._finished_ids = []
            if gate is not None and not gate.decode_first:
                gate.examine()  # prefill-first: the waiting pass comes before the decodes
            if needs:
                kv.append_blocks([dec.reqs[i].request_id for i in needs])
            n_dec = dec.live
            if admit:
                self._admission_step(dec, j, token_id, execute)
            else:
                if gate is not None and gate.decode_first:
                    gate.examine()
                execute(n_dec, dec.context + n_dec * j, [])
                times.append(clock())
                if filling is not None and filling[j % bs]:
                    dec.commit(j, kv)
                    if gate is not None:
                        gate.after_commits()
                if j in finishing:
                    self._finish_all([(r, _LENGTH) for r in dec.finish(j)])
                    gate = None
                # NOTE: ``_count_step(n_dec, 0)`` inlined (no prompt tokens)
                stats.num_steps += 1
                stats.num_generation_tokens += n_dec
                usage = kv.usage
                stats.kv_usage_sum += usage
                if usage > stats.kv_usage_peak:
                    stats.kv_usage_peak = usage
                self.step_index += 1
            if gate is not None and gate.stop:
                gate = None
            if dec.stopped:
                break
            if len(dec.reqs) > 2 * dec.live + 64:
                dec.compact()
                finishing = dec.finishing
        dec.sync(step)
        return step

    def _admission_step(self, dec: _Decoders, step: int, token_id: int,
                        execute: StepRun) -> None:
        """Apply a step whose waiting pass runs (requests wait that may be admitted): the
        scheduler's passes after the running one, the executor, then the results in
        ``update_from_output``'s order, the decodes' in bulk in their place."""
        kv, cfg = self.kv, self.config
        n_dec = dec.live
        if not self._progress_unread(kv.num_free_blocks):
            dec.sync(step - 1)
        b = StepBuilder(cfg.max_num_batched_tokens, self.clock())
        # NOTE: the decodes are charged to the budget, as the running pass's bulk path
        # does, but not listed in the step: the passes after it read the scheduled requests
        # only for those with prompt tokens left (``_num_partial``), which decodes are not.
        b.budget -= n_dec
        for schedule_pass in self._passes[1:]:
            schedule_pass(b)
        if b.preempted or b.swap_in or b.swap_out:
            raise RuntimeError("fast-forward: a pass preempted or swapped (policy not allowed)")
        self._commit_admissions(b)
        fresh = self.running[n_dec:]
        new = {**b.admitted, **b.forked} if b.forked else b.admitted
        decodes, context, chunks = n_dec, dec.context + n_dec * step, []
        scheduled = b.scheduled
        for rid, p in new.items():
            c = scheduled[rid]
            if c == 1:
                decodes += 1
                context += p + 1
            else:
                chunks.append((c, p))
        execute(decodes, context, chunks)
        now = self.clock()
        dec.times.append(now)
        touched, chunked, finished, generated = self._apply_tokens(
            scheduled.items(), dict.fromkeys(new, (token_id,)), None, now)
        if chunked:
            self._commit_chunks(chunked)
        dec.commit(step, kv)
        if touched:
            kv.commit_one_token(touched)
        done = dec.finish(step)
        if done or finished:
            self._finish_all([(r, _LENGTH) for r in done] + finished)
        # NOTE: as ``update_from_output`` counts them, with the decodes in the step (the
        # budget spent counts them already)
        num_decodes = n_dec + len(scheduled) - len(b.prefill_kinds)
        self._count_step(n_dec + generated, (b.token_budget - b.budget) - num_decodes)
        self.step_index += 1
        for r in fresh:  # NOTE: in running order, as the decodes are kept
            if r.status is _RUNNING and not (_decodes(r) and dec.join(r, kv.req_blocks, step)):
                dec.stopped = True  # a prompt goes on in chunks (or stops on the token)

    def _progress_unread(self, free_blocks: int) -> bool:
        """Whether the waiting pass about to run with ``free_blocks`` cannot read how far
        the running requests got (so the lazily kept decodes need not be brought up to
        date for it).

        NOTE: of the running requests, the waiting pass reads their number, their priorities
        (to preempt, which fast-forward rules out) and, only through
        ``admission_room._headroom``, their outputs: when the blocks left after a prompt
        fall short of the headroom bound of ``HEADROOM_TOKENS`` a request. The pass admits
        at most ``admits`` requests (a seat each); each examined request's blocks left are
        at least the free blocks less the running prompts' pending blocks, less its own
        prompt (at most ``max_model_len``), less what each admission before it took and left
        pending (two prompts, and a block per forked sibling); the bound grows by
        ``HEADROOM_TOKENS`` an admission. If the least blocks left still cover the largest
        bound, the outputs are never read."""
        cfg, kv = self.config, self.kv
        if not cfg.cost_aware_preemption:
            return True  # NOTE: no headroom is kept
        running = len(self.running)
        admits = max(0, min(cfg.max_num_seqs - running - sum(self._unforked.values()),
                            len(self.waiting)))
        prompt = kv.blocks_needed(cfg.max_model_len)
        least = (free_blocks - pending_prompt_blocks(self) - prompt
                 - admits * (2 * prompt + cfg.max_num_seqs))
        return least >= kv.blocks_needed(HEADROOM_TOKENS * (running + admits))

    def _may_fast_forward(self) -> bool:
        """Whether the next step's running pass is certain to be the decodes' bulk path,
        as far as the state and the policy go (the blocks are checked with the steps).

        NOTE: relies on the invariant ``check_invariants`` asserts after every step: a
        running request not in ``_prefilling`` has no prompt tokens left, so it decodes.
        And on plain LRU eviction with no host tier (``KVCacheManager.plain_lru``): the
        proof replays evictions and registrations, not stores, loads or protection."""
        if (self._step is not None or self.recorder is not None or self.swapped
                or self._unforked or not self.running or not self.kv.plain_lru):
            return False
        policy = self.policy
        if policy.token_cap is not None or policy.on_step is not None:
            return False  # NOTE: a per-step hook may change the budget or the order
        requests = self.requests
        return all(_decodes(requests[rid]) for rid in self._prefilling)


def _decodes(r: Request) -> bool:
    """It has produced tokens and has exactly one token to compute: the next."""
    return bool(r.output_token_ids) and r.num_computed_tokens == r.num_tokens - 1


class _Decoders:
    """The decoding requests of a fast-forward run, in running order, each brought up to
    date only when needed.

    Request ``i`` joined exact as of the end of step ``done[i]`` (``timed[i]`` for its
    token times); in each step after that it computes one token and samples ``token_id``.
    Steps are numbered from the run's first (1); ``times[t - 1]`` is the end of step ``t``.
    """

    def __init__(self, block_size: int, caching: bool, token_id: int) -> None:
        self.bs = block_size
        self.token_id = token_id
        self.reqs: list[Request] = []
        self.base: list[int] = []
        """Computed tokens at joining, less the step joined: + j - 1 is the context before
        step j."""
        self.done: list[int] = []
        """The step up to which each one's tokens and progress are applied."""
        self.timed: list[int] = []
        """The step up to which each one's token times are applied."""
        self.alive: list[bool] = []
        self.last: list[int] = []
        """The step in which each samples its last token (max_tokens)."""
        self.alloc: list[list[tuple[int, int]]] = [[] for _ in range(block_size)]
        """By step % block size: (request, first such step) of those needing a new block."""
        self.filling: list[list[int]] | None = (
            [[] for _ in range(block_size)] if caching else None)
        """By step % block size: requests whose computed tokens fill a block in it."""
        self.finishing: dict[int, list[int]] = {}
        self.context = 0
        """Σ ``base`` over the live requests."""
        self.live = 0
        self.times: list[float] = []
        self.lagging = (token_id,) * block_size
        """The tokens of a block sampled wholly in the run."""
        self.stopped = False
        """Set when a request joined the running ones that does not decode next."""

    def join_all(self, reqs: list[Request], tables: dict[str, list], step: int) -> bool:
        """``join`` for each, in order, in bulk (False, joining none, if one of them stops
        on the token)."""
        token_id, bs, n, first_index = self.token_id, self.bs, len(reqs), len(self.reqs)
        if any(token_id in r.stop_ids for r in reqs):
            return False
        computed = [r.num_computed_tokens for r in reqs]
        last = [step + r.sampling_params.max_tokens - len(r.output_token_ids) for r in reqs]
        first = [step + len(tables[r.request_id]) * bs - c + 1
                 for r, c in zip(reqs, computed, strict=True)]
        self.reqs += reqs
        self.base += [c - step for c in computed]
        self.done += [step] * n
        self.timed += [step] * n
        self.alive += [True] * n
        self.last += last
        alloc = self.alloc
        for i, f in enumerate(first, first_index):
            alloc[f % bs].append((i, f))
        filling = self.filling
        if filling is not None:
            for i, c in enumerate(computed, first_index):
                filling[(step - c) % bs].append(i)
        finishing = self.finishing
        for i, f in enumerate(last, first_index):
            if f in finishing:
                finishing[f].append(i)
            else:
                finishing[f] = [i]
        self.context += sum(computed) - step * n
        self.live += n
        return True

    def join(self, r: Request, tables: dict[str, list], step: int) -> bool:
        """Add a decoding request, exact as of the end of ``step`` (False if it would stop on
        the sampled token: it is not added)."""
        if self.token_id in r.stop_ids:
            return False
        i = len(self.reqs)
        c = r.num_computed_tokens
        bs = self.bs
        self.reqs.append(r)
        self.base.append(c - step)
        self.done.append(step)
        self.timed.append(step)
        self.alive.append(True)
        first = step + len(tables[r.request_id]) * bs - c + 1
        self.alloc[first % bs].append((i, first))
        if self.filling is not None:
            self.filling[(step - c) % bs].append(i)
        last = step + r.sampling_params.max_tokens - len(r.output_token_ids)
        self.last.append(last)
        if last in self.finishing:
            self.finishing[last].append(i)
        else:
            self.finishing[last] = [i]
        self.context += c - step
        self.live += 1
        return True

    def remaining(self, step: int) -> list[int]:
        """Tokens each live request has left to sample as ``step`` is scheduled."""
        return [last - step + 1 for last, a in zip(self.last, self.alive, strict=True) if a]

    def catch_up(self, i: int, step: int) -> Request:
        """Bring request ``i`` up to the end of ``step``: tokens, progress, token times."""
        r = self.reqs[i]
        d = step - self.done[i]
        if d > 0:
            r.output_token_ids.extend([self.token_id] * d)
            r.num_computed_tokens += d
            self.done[i] = step
        t = self.timed[i]
        if t < step:
            r.token_times.extend(self.times[t:step])
            self.timed[i] = step
        return r

    def sync(self, step: int) -> None:
        """Bring every live request up to the end of ``step``."""
        if step <= 0:
            return
        tokens, times = [self.token_id] * step, self.times[:step]
        done, timed, alive = self.done, self.timed, self.alive
        for i, r in enumerate(self.reqs):
            if alive[i]:
                d = step - done[i]
                if d:
                    r.output_token_ids += tokens if d == step else tokens[:d]
                    r.num_computed_tokens += d
                    done[i] = step
                t = timed[i]
                if t < step:
                    r.token_times += times if not t else times[t:]
                    timed[i] = step

    def commit(self, step: int, kv: KVCacheManager) -> None:
        """Offer the blocks filled in ``step`` to the prefix cache, in running order: a
        block of tokens sampled since the request was last brought up to date straight
        from its known tokens (``commit_lagging_block``), any other with the request
        brought up to ``step`` (what the hashes read)."""
        if self.filling is None:
            return
        cls = self.filling[step % self.bs]
        if not cls:
            return
        alive, done, reqs, base = self.alive, self.done, self.reqs, self.base
        bs, lagging, token_id = self.bs, self.lagging, self.token_id
        for i in cls:
            if alive[i]:
                r = reqs[i]
                if kv.commit_lagging_block(r, (base[i] + step) // bs, lagging):
                    continue
                d = step - done[i]
                r.output_token_ids.extend([token_id] * d)
                r.num_computed_tokens += d
                done[i] = step
                kv.commit_filled([r])

    def finish(self, step: int) -> list[Request]:
        """The requests that sample their last token in ``step`` (brought up to it), in
        running order; they leave the run."""
        ids = self.finishing.pop(step, None)
        if not ids:
            return []
        out = []
        for i in ids:
            out.append(self.catch_up(i, step))
            self.alive[i] = False
            self.live -= 1
            self.context -= self.base[i]
        return out

    def compact(self) -> None:
        """Drop the finished requests' entries."""
        n = len(self.reqs)
        keep = [i for i in range(n) if self.alive[i]]
        index = {old: new for new, old in enumerate(keep)}
        # NOTE: in place: the fast-forward loop holds some of these lists
        for values in (self.reqs, self.base, self.done, self.timed, self.last):
            values[:] = [values[i] for i in keep]
        self.alive[:] = [True] * len(keep)
        self.alloc[:] = [[(index[i], f) for i, f in cls if i in index] for cls in self.alloc]
        if self.filling is not None:
            self.filling[:] = [[index[i] for i in cls if i in index] for cls in self.filling]
        self.finishing = {s: [index[i] for i in ids if i in index]
                          for s, ids in self.finishing.items()}
