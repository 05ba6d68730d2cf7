"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(...)``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.engine.intake import PromptInput, ValidatedRequest
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestOutput
from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import SamplingParams

Message = dict[str, str]
OutputHook = Callable[[int, RequestOutput], None]
"""Called with (prompt index, output) for each request's progress in every step."""

logger = logging.getLogger("kvloop.engine")


class LLM:
    """Batch generation over kvloop's scheduler loop.

    ``LLM(model="default", max_num_seqs=64, ...)`` takes any ``EngineArgs`` field as a
    keyword; an unknown one is a ``ValueError`` naming it. Without ``SamplingParams``,
    ``generate`` and ``chat`` sample with ``get_default_sampling_params()``: the model's
    generation config (``generation_config="auto"``) over vLLM's neutral defaults.

    Start-up logs one line per phase on the ``kvloop.engine`` logger (INFO;
    ``LLMEngine.from_args``): converting a GGUF file (once), loading, and the KV cache it
    sized.
    """

    def __init__(
        self, model: str = "default", *, trace_out: str | None = None, **engine_args: Any
    ) -> None:
        self.args = EngineArgs.from_kwargs(model=model, **engine_args)
        self._trace_file = open(trace_out, "w") if trace_out else None  # noqa: SIM115
        recorder = (
            StepRecorder(keep_in_memory=False, sink=self._trace_file) if self._trace_file else None
        )
        self.engine = LLMEngine.from_args(self.args, recorder=recorder)
        self.default_sampling: dict[str, Any] = self.engine.default_sampling
        """``SamplingParams`` fields from the generation config (empty: neutral defaults)."""

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters used when none are given (vLLM's method of that name): the
        model's generation config over ``SamplingParams()``' neutral defaults. Change a copy
        of it to keep the model's settings and set a few of your own."""
        return SamplingParams(**self.default_sampling)

    def close(self) -> None:
        """Flush and close the step trace, if one is being written."""
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None

    def get_tokenizer(self) -> Any:
        """The engine's ``Tokenizer`` (None with ``skip_tokenizer_init``)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        tenant: str | Sequence[str] | None = None,
        slo_ttft: float | Sequence[float | None] | None = None,
        slo_tpot: float | Sequence[float | None] | None = None,
        on_output: OutputHook | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come in input order.

        A prompt is text, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}`` (vLLM's forms); give one or a list of them, mixed.
        Every prompt is validated before any is queued, so a bad one
        (``InvalidRequestError`` naming the field) leaves the engine as it was.
        ``sampling_params`` None means ``get_default_sampling_params()``. ``on_output`` is
        called with (prompt index, output) as each step's outputs come: deltas
        (``new_text``, ``new_token_ids``, ``new_logprobs``), then the final one, to stream.

        ``priority`` (one per prompt), and ``tenant``, ``slo_ttft`` and ``slo_tpot`` (one
        value for all prompts or one per prompt) go to the scheduling policy: the tenant the
        ``fair`` policy shares by, the TTFT/TPOT targets in seconds of ``slo`` (None: the
        engine's ``slo_ttft``/``slo_tpot``). A request ``slo`` rejects (``slo_overload=
        "reject"``) comes back with ``finish_reason == "rejected"`` and ``error`` set.
        """
        batch = _as_batch(prompts)
        n = len(batch)
        params = self._as_params(sampling_params, n)
        if priority is not None and (isinstance(priority, (str, bytes))
                                     or not isinstance(priority, Sequence)):
            raise InvalidRequestError("priority", "priority must be a list with one integer "
                                      f"per prompt (as vLLM's), got {type(priority).__name__}")
        prios = list(priority) if priority is not None else [0] * n
        if len(prios) != n:
            raise InvalidRequestError("priority", "priority must have one entry per prompt")
        tenants = _per_prompt("tenant", tenant, n)
        ttfts = _per_prompt("slo_ttft", slo_ttft, n)
        tpots = _per_prompt("slo_tpot", slo_tpot, n)
        validate = self.engine.validate
        return self._run([validate(batch[i], params[i], priority=prios[i], tenant=tenants[i],
                                   slo_ttft=ttfts[i], slo_tpot=tpots[i]) for i in range(n)],
                         use_tqdm, on_output)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        on_output: OutputHook | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the model's chat template);
        ``sampling_params`` and ``on_output`` as in ``generate``."""
        if not messages:
            raise InvalidRequestError("messages", "messages must not be empty")
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("messages", "chat needs a tokenizer: this engine has none "
                                      "(skip_tokenizer_init); give token-id prompts to generate")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        params = self._as_params(sampling_params, len(convs))
        validate = self.engine.validate
        return self._run([validate(tok.apply_chat_template(list(c)), sp)
                          for c, sp in zip(convs, params, strict=True)], use_tqdm, on_output)

    def _as_params(
        self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        items = list(sp)
        if len(items) != n:
            raise InvalidRequestError(
                "sampling_params", f"sampling_params has {len(items)} entries for {n} prompts")
        return items

    def _run(self, requests: list[ValidatedRequest], use_tqdm: bool,
             on_output: OutputHook | None = None) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for i, vreq in enumerate(requests):
                order[engine.add_request(None, vreq)] = i
            results: list[RequestOutput | None] = [None] * len(requests)
            samples: dict[str, list[RequestOutput | None]] = {
                rid: [None] * requests[i].params.n
                for rid, i in order.items() if requests[i].params.n > 1}
            with tqdm(total=len(requests), disable=not use_tqdm, unit="req") as bar:
                while any(r is None for r in results):
                    for out in engine.step():
                        if on_output is not None and out.request_id in order:
                            on_output(order[out.request_id], out)
                        if not out.finished or out.request_id not in order:
                            continue
                        group = samples.get(out.request_id)
                        if group is not None and out.finish_reason == "rejected":
                            # NOTE: refused before its sequences forked: one output is all.
                            out = replace(out, outputs=[out])
                        elif group is not None:
                            group[out.index] = out
                            if any(s is None for s in group):
                                continue
                            out = replace(group[0], outputs=group)  # type: ignore[type-var]
                        results[order.pop(out.request_id)] = out
                        bar.update(1)
        finally:
            for rid in order:  # interrupted: leave nothing behind
                engine.abort_request(rid)
            if self._trace_file is not None:
                self._trace_file.flush()
        return results  # type: ignore[return-value]


def _per_prompt(name: str, value: Any, n: int) -> list[Any]:
    """One value for every prompt (a scalar, or None) or a sequence of one per prompt."""
    if value is None or isinstance(value, str | int | float):
        return [value] * n
    try:
        items = list(value)
    except TypeError:
        return [value] * n  # not a sequence: validation names what is wrong with it
    if len(items) != n:
        raise InvalidRequestError(name, f"{name} has {len(items)} entries for {n} prompts")
    return items


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, ids, a dict) as a batch of one; a list of prompts as it is."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items = list(prompts)
    if not items:
        raise InvalidRequestError("prompt", "prompts must not be empty")
    if all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items
