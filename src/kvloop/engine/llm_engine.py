"""``LLMEngine``: the one loop the offline API and the server share.

``step()`` is the whole engine in three moves, as in nano-vllm: schedule, execute,
post-process (detokenize, stop strings, outputs). The executor is the real model runner
or the simulator; the engine does not care which.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvloop.core.interface import Executor
from kvloop.core.request import Request, RequestStatus
from kvloop.core.scheduler import Scheduler
from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.engine.outputs import RequestMetrics, RequestOutput
from kvloop.sampling_params import SamplingParams

logger = logging.getLogger("kvloop.engine")


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of one request: its detokenizer and what was already reported."""

    request: Request
    prompt: str | None
    detokenizer: Any | None
    num_reported: int = 0
    pieces: list[str] = field(default_factory=list)
    """Text deltas so far (joined once, in the final output)."""
    logprobs: list[dict[int, float]] | None = None
    stopped_by_string: bool = False


class LLMEngine:
    """Adds requests, runs steps, and turns scheduler progress into ``RequestOutput``s."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._logged_failure = False

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_args(cls, args: EngineArgs, *, recorder: StepRecorder | None = None) -> LLMEngine:
        """A real engine: resolve the model, load tokenizer and weights, size the KV cache."""
        from kvloop.engine.model_source import resolve_model
        from kvloop.engine.tokenizer import Tokenizer
        from kvloop.executor.torch import TorchModelRunner

        path = resolve_model(args.model)
        tokenizer = Tokenizer(path)
        runner = TorchModelRunner(
            str(path),
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            swap_space_bytes=int(args.swap_space * (1 << 30)),
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            seed=args.seed,
        )
        mc = runner.model_config
        max_len = runner.max_model_len  # the model's limit (sliding window included)
        scheduler = Scheduler(
            args.scheduler_config(max_len),
            args.cache_config(runner.num_gpu_blocks, runner.num_cpu_blocks),
            recorder=recorder,
        )
        eos = frozenset(mc.eos_token_ids) | tokenizer.eos_token_ids
        return cls(
            scheduler, runner, tokenizer=tokenizer, eos_token_ids=eos, vocab_size=mc.vocab_size
        )

    # -- requests --------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or ids (ValueError naming ``prompt``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids: this engine has no tokenizer")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be integers")
            if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` (naming the field) for a request the engine can never run."""
        params.validate()
        cfg = self.scheduler.config
        n = len(prompt_ids)
        if n >= cfg.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, the model takes at most {cfg.max_model_len - 1} "
                f"(max_model_len {cfg.max_model_len})"
            )
        if n + params.max_tokens > cfg.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} + prompt {n} tokens exceeds max_model_len "
                f"{cfg.max_model_len}"
            )
        kv = self.scheduler.kv
        if kv.blocks_needed(n + params.max_tokens) > kv.num_gpu_blocks:
            raise ValueError(
                f"max_tokens {params.max_tokens} + prompt {n} tokens needs more KV blocks "
                f"than the cache has ({kv.num_gpu_blocks} of {kv.block_size} tokens)"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Invalid input raises ValueError
        and leaves the engine untouched."""
        params = params if params is not None else SamplingParams()
        rid = request_id if request_id is not None else self.new_request_id()
        if rid in self._tracked:
            raise ValueError(f"request_id {rid!r} is already in use")
        ids = self.encode(prompt)
        self.check_request(ids, params)
        request = Request(
            rid,
            ids,
            params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
        )
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(ids, params)
        self.scheduler.add_request(request)
        self._tracked[rid] = _Tracked(
            request,
            prompt if isinstance(prompt, str) else None,
            detok,
            logprobs=[] if params.logprobs is not None else None,
        )
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state; its blocks return to the pool at once."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        return self._final(tracked, [], "", None)

    def snapshot(self, request_id: str) -> RequestOutput | None:
        """The cumulative state of an unfinished request (None if unknown): what a caller
        gets only on request, since steps report deltas."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        return self._final(tracked, [], "", None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that progressed or finished."""
        out = self.scheduler.schedule()
        try:
            result = self.executor.execute(out)
        except Exception as exc:
            if not self._logged_failure:
                logger.exception("model step failed; failing the requests of that step")
                self._logged_failure = True
            failed = self.scheduler.abandon_step(out, f"model step failed: {exc!r}")
            tracked = self._tracked
            return [self._progress(tracked[r.request_id], r, None)
                    for r in failed if r.request_id in tracked]
        touched = self.scheduler.update_from_output(out, result)
        logprobs = result.logprobs
        tracked = self._tracked
        progress = self._progress
        outputs = []
        for req in touched:
            t = tracked.get(req.request_id)
            if t is not None:
                outputs.append(progress(t, req, logprobs.get(req.request_id) if logprobs else None))
        return outputs

    def _progress(
        self, tracked: _Tracked, req: Request, new_logprobs: list[dict[int, float]] | None
    ) -> RequestOutput:
        ids = req.output_token_ids
        new_ids = ids[tracked.num_reported:]
        tracked.num_reported = len(ids)
        delta = ""
        detok = tracked.detokenizer
        if detok is not None:
            delta, stop_hit = detok.add(new_ids)
            if stop_hit and not req.is_finished:
                tracked.stopped_by_string = True
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished and not tracked.stopped_by_string:
                delta += detok.flush()
            if delta:
                tracked.pieces.append(delta)
        if tracked.logprobs is not None:
            new_logprobs = list(new_logprobs or ())
            tracked.logprobs.extend(new_logprobs)
        if req.is_finished:
            del self._tracked[req.request_id]
            return self._final(tracked, new_ids, delta, new_logprobs)
        return RequestOutput(req.request_id, new_ids, delta, new_logprobs,
                             req.num_prompt_tokens, len(ids), False)

    def _final(
        self,
        tracked: _Tracked,
        new_ids: list[int],
        delta: str,
        new_logprobs: list[dict[int, float]] | None,
    ) -> RequestOutput:
        """An output with the cumulative fields filled (a finished request, a snapshot)."""
        req = tracked.request
        reason = req.finish_reason
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=delta,
            new_logprobs=new_logprobs if tracked.logprobs is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            finished=req.is_finished,
            finish_reason=reason.value if reason is not None else None,
            error=req.error,
            prompt=tracked.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            text="".join(tracked.pieces),
            token_ids=list(req.output_token_ids),
            logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
            metrics=RequestMetrics.of(req),
        )
