"""Applying a step's results: the second half of the loop, ``update_from_output``.

Part of ``Scheduler`` (its state: ``kvloop.core.state.SchedulerState``). In this order: progress and
sampled tokens per scheduled request (``_apply_tokens``), the blocks they filled offered to
the prefix cache (``_commit_chunks``, then ``commit_one_token``), finished requests
released (``_finish_all``), the step counted (``_count_step``) and recorded. Fast-forward
(``kvloop.core.fast_forward``) runs the same pieces, in the same order, for the requests
it does not advance in bulk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvloop.core.interface import ModelRunnerOutput, SchedulerOutput
from kvloop.core.request import Request, RequestStatus
from kvloop.core.state import SchedulerState
from kvloop.core.step import build_step_record

_RUNNING = RequestStatus.RUNNING
Finished = list[tuple[Request, RequestStatus]]


class StepResults(SchedulerState):
    """``update_from_output`` and its pieces, for ``Scheduler``."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a step's results: advance progress, append tokens, finish requests.

        Returns the requests that received tokens or finished in this step.
        """
        b = self._step
        if b is None:
            raise RuntimeError("update_from_output() without a scheduled step")
        # NOTE: the step stays pending until its results are applied: if this raises
        # half-way, ``abandon_step`` can still fail its requests (``step_pending``).
        if self.policy.on_step is not None:
            self.policy.on_step(scheduler_output, self.requests, b.start_time)
        now = self.clock()
        touched, chunked, finished, gen_tokens = self._apply_tokens(
            scheduler_output.num_scheduled_tokens.items(), runner_output.sampled_token_ids,
            runner_output.errors, now)
        # NOTE: before finished requests release their blocks, so their prompts stay cached.
        if chunked:
            self._commit_chunks(chunked)
        self.kv.commit_one_token(touched)
        if finished:
            self._finish_all(finished)
        num_decodes = len(scheduler_output.num_scheduled_tokens) - len(b.prefill_kinds)
        self._count_step(gen_tokens, scheduler_output.total_num_scheduled_tokens - num_decodes)
        self._step = None
        if self.recorder is not None:
            kv = self.kv
            sampled = [r.request_id for r in touched if r.status != RequestStatus.FINISHED_ERROR]
            arrived, self._arrived = self._arrived, []
            info, self._arrived_info = self._arrived_info, {}
            b.finished, self._finished_log = self._finished_log, []
            counts = (kv.num_used_blocks, kv.num_gpu_blocks, len(self.running),
                      len(self.waiting), len(self.swapped))
            extra = (kv.block_size, len(kv.pool.cached), kv.num_cpu_blocks - kv.num_free_cpu_blocks,
                     kv.num_cpu_blocks)
            self.recorder.add(build_step_record(
                b, scheduler_output, runner_output, now, arrived, sampled, counts, info, extra))
        self.step_index += 1
        return touched

    def _apply_tokens(
        self, scheduled: Iterable[tuple[str, int]], sampled: Mapping[str, Sequence[int]],
        errors: Mapping[str, str] | None, now: float,
    ) -> tuple[list[Request], list[Request], Finished, int]:
        """Advance each scheduled request by its tokens and append what it sampled.
        Returns (touched: sampled or failed, chunked: computed prompt tokens, finished,
        tokens generated), each list in scheduling order."""
        requests = self.requests
        touched: list[Request] = []
        chunked: list[Request] = []
        finished: Finished = []
        gen_tokens = 0
        for rid, n in scheduled:
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # aborted between schedule() and now
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if n > 1:
                chunked.append(req)
            outputs = req.output_token_ids
            if computed < req.num_prompt_tokens + len(outputs):
                if n == 1:
                    chunked.append(req)  # a one-token prefill chunk
                continue
            tokens = sampled.get(rid)
            if not tokens:
                req.error = ((errors.get(rid) if errors else None)
                             or "the executor returned no token for a completed step")
                finished.append((req, RequestStatus.FINISHED_ERROR))
                touched.append(req)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            touched.append(req)
            params = req.sampling_params
            if len(tokens) == 1:  # NOTE: the common case, the loop below unrolled
                t = tokens[0]
                outputs.append(t)
                req.token_times.append(now)
                gen_tokens += 1
                if t in req.stop_ids and len(outputs) > params.min_tokens:
                    finished.append((req, RequestStatus.FINISHED_STOPPED))
                elif len(outputs) >= params.max_tokens:
                    finished.append((req, RequestStatus.FINISHED_LENGTH))
                continue
            stop_ids = req.stop_ids
            max_tokens = params.max_tokens
            for t in tokens:
                outputs.append(t)
                req.token_times.append(now)
                gen_tokens += 1
                # NOTE: a stop id before min_tokens (an executor that does not mask) is kept.
                if t in stop_ids and len(outputs) > params.min_tokens:
                    finished.append((req, RequestStatus.FINISHED_STOPPED))
                    break
                # NOTE: prompt + max_tokens <= max_model_len was checked on arrival, so
                # max_tokens is the only length limit left to test.
                if len(outputs) >= max_tokens:
                    finished.append((req, RequestStatus.FINISHED_LENGTH))
                    break
        return touched, chunked, finished, gen_tokens

    def _commit_chunks(self, chunked: list[Request]) -> None:
        """Offer the blocks the prompt chunks filled to the prefix cache; requests whose
        prefill is done leave ``_prefilling``."""
        self.kv.commit_computed(chunked)
        prefilling = self._prefilling
        for req in chunked:
            # NOTE: ``_num_partial`` prunes the set too; pruning here keeps walking it cheap.
            if req.num_computed_tokens >= req.prefill_end:
                prefilling.discard(req.request_id)

    def _finish_all(self, finished: Finished) -> None:
        """Take the finished requests off the running list, then release each in order."""
        if len(finished) <= 8:
            for req, _ in finished:
                self.running.remove(req)
        else:
            done = {id(r) for r, _ in finished}
            self.running = [r for r in self.running if id(r) not in done]
        for req, status in finished:
            self._finish(req, status)

    def _count_step(self, gen_tokens: int, prompt_tokens: int) -> None:
        """Add a step's tokens and KV usage (after its finishes) to the totals."""
        stats = self.stats
        stats.num_steps += 1
        stats.num_generation_tokens += gen_tokens
        stats.num_prompt_tokens += prompt_tokens
        usage = self.kv.usage
        stats.kv_usage_sum += usage
        if usage > stats.kv_usage_peak:
            stats.kv_usage_peak = usage
