"""``LLMEngine``: the one loop the offline API and the server share.

``step()`` is the whole engine in three moves, as in nano-vllm: schedule, execute,
post-process (detokenize, stop strings, outputs). The executor is the real model runner
or the simulator; the engine does not care which.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvloop.core.interface import Executor
from kvloop.core.loop import run_step
from kvloop.core.request import Request, RequestStatus
from kvloop.core.scheduler import Scheduler
from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.engine.intake import (
    EncodedPrompt,
    EngineLimits,
    PromptInput,
    ValidatedRequest,
    encode_prompt,
    max_token_chars,
    validate_request,
)
from kvloop.engine.outputs import RequestMetrics, RequestOutput
from kvloop.engine.stats import EngineStats
from kvloop.errors import InvalidRequestError
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
    output_id: str = ""
    """The id outputs carry: the request's, or for a sibling its group leader's."""
    index: int = 0
    """The sequence's index in its group (``RequestOutput.index``)."""


class LLMEngine:
    """Adds requests, runs steps, and turns scheduler progress into ``RequestOutput``s.

    Not thread-safe: one thread adds, aborts and steps. ``limits`` and ``validate`` are the
    exceptions (immutable data, a pure function); ``stats()`` is the snapshot to hand out.
    """

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
        """The model's ``Tokenizer``; None when the engine takes and returns token ids only."""
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        cache = scheduler.cache_config
        self.limits = EngineLimits(
            max_model_len=scheduler.config.max_model_len,
            kv_cache_tokens=cache.num_gpu_blocks * cache.block_size,
            vocab_size=vocab_size,
            max_num_seqs=scheduler.config.max_num_seqs,
            block_size=cache.block_size,
        )
        """What every request must fit (fixed at construction; safe to read from any thread)."""
        self._token_chars = max_token_chars(tokenizer) if tokenizer is not None else None
        """A text prompt longer than this many characters per token is refused unread."""
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, int] = {}
        """Requests with ``n > 1`` sequences -> n, while any of them is unfinished."""
        self._ids = itertools.count()
        self._rejected: list[str] = []
        """Requests the scheduler finished on arrival (rejected), for the next step."""
        self._logged_failure = False
        self.default_sampling: dict[str, Any] = {}
        """``SamplingParams`` fields a request's unset ones default to (the model's generation
        config, ``EngineArgs.generation_config``; empty: vLLM's neutral defaults)."""
        self.token_budget_note = f"{scheduler.config.max_num_batched_tokens} tokens per step"
        """The step's token budget and why it is what it is (for start-up lines)."""

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_args(cls, args: EngineArgs, *, recorder: StepRecorder | None = None,
                  folder: Path | None = None) -> LLMEngine:
        """A real engine: resolve the model (unless ``folder`` is its resolved folder), read
        its sampling defaults, load tokenizer (unless ``skip_tokenizer_init``) and weights,
        size the KV cache. Logs one line per phase on the ``kvloop.engine`` logger (INFO):
        converting a GGUF file (once), loading, what loaded and the KV cache it sized
        (:func:`describe_startup`)."""
        from kvloop.engine.generation_config import default_sampling_fields
        from kvloop.engine.model_source import resolve_model
        from kvloop.engine.tokenizer import load_tokenizer
        from kvloop.executor.torch import TorchModelRunner

        path = folder if folder is not None else resolve_model(args.model)
        start = time.perf_counter()
        logger.info("loading %s from %s", args.model, path)
        # NOTE: before the weights load, so that a bad generation config fails fast.
        default_sampling = default_sampling_fields(args.generation_config, path,
                                                   model=args.model)
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)
        runner = TorchModelRunner(
            str(path),
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            swap_space_bytes=int(args.swap_space * (1 << 30)),
            kv_offload_bytes=int(args.kv_offload_space * (1 << 30)),
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            # NOTE: sized for the largest default budget; the CPU one is at most that.
            max_num_batched_tokens=args.max_num_batched_tokens or 2048,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            seed=args.seed,
        )
        mc = runner.model_config
        max_len = runner.max_model_len  # the model's limit (sliding window included)
        budget, why = args.max_num_batched_tokens, "as given"
        if budget is None:
            from kvloop.executor.torch.budget import default_token_budget

            budget, why = default_token_budget(runner)
            runner.max_num_batched_tokens = budget
        scheduler = Scheduler(
            args.scheduler_config(max_len, default_budget=budget),
            args.cache_config(runner.num_gpu_blocks, runner.num_cpu_blocks,
                              runner.num_offload_blocks),
            recorder=recorder,
        )
        eos = frozenset(mc.eos_token_ids)
        if tokenizer is not None:
            eos |= tokenizer.eos_token_ids
        engine = cls(
            scheduler, runner, tokenizer=tokenizer, eos_token_ids=eos, vocab_size=mc.vocab_size
        )
        engine.token_budget_note = (
            f"{scheduler.config.max_num_batched_tokens} tokens per step ({why})")
        engine.default_sampling = default_sampling
        loaded, kv = describe_startup(engine)
        logger.info("loaded in %.1f s: %s", time.perf_counter() - start, loaded)
        logger.info("%s", kv)
        return engine

    # -- requests --------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def validate(
        self,
        prompt: PromptInput | EncodedPrompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        slo_ttft: float | None = None,
        slo_tpot: float | None = None,
    ) -> ValidatedRequest:
        """Check and encode a request against this engine's limits (``InvalidRequestError``
        naming the field). Pure: safe on any thread; the engine is not touched."""
        if not isinstance(prompt, EncodedPrompt):
            prompt = encode_prompt(prompt, self.limits, self.tokenizer,
                                   token_chars=self._token_chars)
        return validate_request(prompt, params, self.limits, tokenizer=self.tokenizer,
                                priority=priority, cache_salt=cache_salt, tenant=tenant,
                                slo_ttft=slo_ttft, slo_tpot=slo_tpot)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput | ValidatedRequest,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        slo_ttft: float | None = None,
        slo_tpot: float | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id.

        ``prompt`` is a ``ValidatedRequest`` (from ``validate``: queued as is) or a raw prompt
        (text, token ids or a vLLM prompt dict) validated here with ``params``, ``priority``,
        ``cache_salt``, ``tenant`` and the SLO targets ``slo_ttft``/``slo_tpot`` (seconds).
        Invalid input raises ``InvalidRequestError`` and leaves the engine untouched. A
        request the scheduling policy rejects (``slo`` with ``slo_overload="reject"``) ends
        with finish reason ``rejected`` and its ``error`` in a later ``step()``'s outputs.
        """
        if isinstance(prompt, ValidatedRequest):
            if (params is not None or priority != 0 or cache_salt is not None
                    or tenant is not None or slo_ttft is not None or slo_tpot is not None):
                raise TypeError("a ValidatedRequest already carries its params, priority, "
                                "cache_salt, tenant and SLO targets")
            vreq = prompt
        else:
            vreq = self.validate(prompt, params, priority=priority, cache_salt=cache_salt,
                                 tenant=tenant, slo_ttft=slo_ttft, slo_tpot=slo_tpot)
        rid = request_id if request_id is not None else self.new_request_id()
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id", "request_id must be a non-empty string")
        if rid in self._tracked:
            raise InvalidRequestError("request_id", f"request_id {rid!r} is already in use")
        params = vreq.params
        request = Request(
            rid,
            vreq.prompt_token_ids,
            params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=vreq.priority,
            cache_salt=vreq.cache_salt,
            eos_token_ids=self.eos_token_ids,
            tenant=vreq.tenant,
            slo_ttft=vreq.slo_ttft,
            slo_tpot=vreq.slo_tpot,
        )
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(vreq.prompt_token_ids, params)
        self.scheduler.add_request(request)
        rejected = request.status == RequestStatus.FINISHED_REJECTED
        if request.is_finished and not rejected:
            # NOTE: refused by the scheduler's own check (a ValidatedRequest made under other
            # limits): an error now, or it would never be reported and never finish.
            raise InvalidRequestError("max_tokens", request.error or "the request cannot run")
        self._tracked[rid] = _Tracked(
            request,
            vreq.prompt,
            detok,
            logprobs=[] if params.logprobs is not None else None,
            output_id=rid,
        )
        if params.n > 1:
            self._groups[rid] = params.n
        if rejected:  # NOTE: refused on arrival: reported by the next step, like any finish
            self._rejected.append(rid)
        return rid

    def has_request(self, request_id: str) -> bool:
        """Whether any sequence of the request is unfinished."""
        return any(k in self._tracked for k in self._member_ids(request_id))

    def _member_ids(self, request_id: str) -> list[str]:
        """The engine-side ids of a request's sequences (itself, then its siblings)."""
        n = self._groups.get(request_id, 1)
        return [request_id, *(f"{request_id}#{i}" for i in range(1, n))]

    def _track_sibling(self, req: Request) -> _Tracked | None:
        """Start tracking a sibling forked by the scheduler (None if its group is gone)."""
        group = req.group
        if group is None or req.sample_index == 0:
            return None
        leader = group.leader
        if leader.request_id not in self._groups:
            return None
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(req.prompt_token_ids, req.sampling_params)
        t = _Tracked(req, None, detok,
                     logprobs=[] if req.sampling_params.logprobs is not None else None,
                     output_id=leader.request_id, index=req.sample_index)
        lead = self._tracked.get(leader.request_id)
        if lead is not None:
            t.prompt = lead.prompt
        self._tracked[req.request_id] = t
        return t

    def _forget(self, tracked: _Tracked) -> None:
        """Stop tracking a finished sequence (and its group once every sequence is done)."""
        req = tracked.request
        self._tracked.pop(req.request_id, None)
        gid = tracked.output_id
        if gid in self._groups and not any(k in self._tracked for k in self._member_ids(gid)):
            del self._groups[gid]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state (all its sequences); its blocks return to the pool
        at once. Returns the first sequence's final output (None if unknown)."""
        first = None
        for key in self._member_ids(request_id):
            tracked = self._tracked.get(key)
            self.scheduler.abort_request(key)
            if tracked is not None:
                self._forget(tracked)
                out = self._final(tracked, [], "", None)
                first = first or out
        self._groups.pop(request_id, None)
        return first

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

    def stats(self) -> EngineStats:
        """A snapshot of queues, KV usage and the scheduler's counters (O(1); take it on the
        thread that steps the engine, then hand it anywhere)."""
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            num_swapped=len(s.swapped),
            num_unfinished=len(self._tracked),
            kv_usage=s.kv.usage,
            scheduler=EngineStats.copy_counters(s.stats),
            host_tier=replace(s.kv.host.stats) if s.kv.host_prefix else None,
            kv_block_bytes=getattr(self.executor, "block_bytes", 0),
        )

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that progressed or finished."""
        if self._rejected and not self.scheduler.has_unfinished_requests():
            outputs: list[RequestOutput] = []  # NOTE: nothing to run; report the refusals
            self._report_finished_elsewhere([], outputs)
            return outputs
        result = run_step(self.scheduler, self.executor)
        if result.error is not None and not self._logged_failure:
            logger.error("model step failed; failing the requests of that step",
                         exc_info=result.error)
            self._logged_failure = True
        runner = result.runner_output
        logprobs = runner.logprobs if runner is not None else None
        tracked = self._tracked
        progress = self._progress
        outputs = []
        for req in result.touched:  # on failure: the failed requests
            t = tracked.get(req.request_id)
            if t is None:
                t = self._track_sibling(req)
                if t is None:
                    continue
            try:
                outputs.append(progress(t, req, logprobs.get(req.request_id) if logprobs else None))
            except Exception as exc:  # e.g. detokenization: this request fails, not the step
                logger.exception("engine error on request %s; failing it", req.request_id)
                outputs.append(self._fail(t, req, f"engine error: {exc!r}"))
        self._report_finished_elsewhere(result.scheduler_output.finished_request_ids, outputs)
        return outputs

    def _report_finished_elsewhere(self, finished_ids: list[str],
                                   outputs: list[RequestOutput]) -> None:
        """Final outputs of requests the scheduler finished outside a step's results (a
        policy's rejection of a waiting request, on arrival or in ``schedule()``).

        NOTE: every finish is reported exactly once: requests the engine finishes itself
        (aborts, stop strings, errors) and those in ``touched`` are forgotten when they are
        reported, so only the rest are still tracked here. O(finished) per step."""
        rejected, self._rejected = self._rejected, []
        tracked = self._tracked
        for rid in (*rejected, *finished_ids):
            t = tracked.get(rid)
            if t is not None and t.request.is_finished:
                self._forget(t)
                outputs.append(self._final(t, [], "", None))

    def _fail(self, tracked: _Tracked, req: Request, error: str) -> RequestOutput:
        """Finish one request with ``error`` (its blocks return to the pool at once)."""
        if not req.is_finished:
            req.error = error
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        elif req.error is None:
            req.error = error
            req.status = RequestStatus.FINISHED_ERROR
        self._forget(tracked)
        return self._final(tracked, [], "", None)

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
            self._forget(tracked)
            return self._final(tracked, new_ids, delta, new_logprobs)
        out = RequestOutput(tracked.output_id, new_ids, delta, new_logprobs,
                            req.num_prompt_tokens, len(ids), False)
        if tracked.index:
            out.index = tracked.index
        return out

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
            request_id=tracked.output_id,
            index=tracked.index,
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


def describe_startup(engine: LLMEngine) -> tuple[str, str]:
    """Two status lines: what was loaded (model, dtype, device, whose CPU kernels) and the
    KV cache it sized (blocks, tokens, memory, the step's token budget)."""
    runner = engine.executor
    cfg = getattr(runner, "model_config", None)
    dtype = getattr(runner, "precision", None) or str(getattr(runner, "dtype", "")).replace(
        "torch.", "")
    if note := getattr(runner, "dtype_note", ""):
        dtype += f" ({note})"
    loaded = (f"{getattr(cfg, 'architecture', 'model')} {dtype} on "
              f"{getattr(runner, 'device', '?')}")
    if kernels := getattr(runner, "kernels_note", ""):
        loaded += f"; {kernels}"
    model = getattr(runner, "model", None)
    if getattr(model, "loaded_ready", False):
        loaded += "; weights ready to run, from the cache"
    elif getattr(model, "saving_ready", False):
        loaded += "; weights converted, saved ready to run for later starts"
    cache = engine.scheduler.cache_config
    kv = (f"KV cache: {cache.num_gpu_blocks} blocks x {cache.block_size} tokens = "
          f"{cache.num_gpu_blocks * cache.block_size} tokens")
    nbytes = getattr(getattr(getattr(runner, "kv_cache", None), "gpu", None), "nbytes", None)
    if isinstance(nbytes, int):
        kv += f" ({nbytes / 2**30:.2f} GiB)"
    if cache.kv_offload_blocks and cache.enable_prefix_caching:
        kv += f"; host prefix tier: {cache.kv_offload_blocks} blocks"
    if note := getattr(engine, "token_budget_note", None):
        kv += f"; {note}"
    return loaded, kv
