"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvloop.core.stats import StepRecorder
from kvloop.engine.args import EngineArgs
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestOutput
from kvloop.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """Batch generation over kvloop's scheduler loop.

    ``LLM(model="default", max_num_seqs=64, ...)`` takes any ``EngineArgs`` field as a
    keyword; an unknown one is a ``ValueError`` naming it.
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

    def close(self) -> None:
        """Flush and close the step trace, if one is being written."""
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come in input order.

        Every prompt is validated before any is queued, so a bad one (``ValueError`` naming
        the field) leaves the engine as it was.
        """
        batch = _as_batch(prompts)
        return self._run(
            [self.engine.encode(p) for p in batch], batch, sampling_params, use_tqdm, priority
        )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the model's chat template)."""
        if not messages:
            raise ValueError("messages must not be empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        ids = [tok.apply_chat_template(list(c)) for c in convs]  # type: ignore[union-attr]
        return self._run(ids, [None] * len(ids), sampling_params, use_tqdm, None)

    def _run(
        self,
        ids: list[list[int]],
        texts: Sequence[Prompt | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        params = _as_params(sampling_params, len(ids))
        prios = list(priority) if priority is not None else [0] * len(ids)
        if len(prios) != len(ids):
            raise ValueError("priority must have one entry per prompt")
        engine = self.engine
        for p, sp in zip(ids, params, strict=True):
            engine.check_request(p, sp)
        order: dict[str, int] = {}
        try:
            for i, (p, sp, text) in enumerate(zip(ids, params, texts, strict=True)):
                rid = engine.add_request(None, p, sp, priority=prios[i])
                if isinstance(text, str):
                    engine._tracked[rid].prompt = text
                order[rid] = i
            results: list[RequestOutput | None] = [None] * len(ids)
            with tqdm(total=len(ids), disable=not use_tqdm, unit="req") as bar:
                while any(r is None for r in results):
                    for out in engine.step():
                        if out.finished and out.request_id in order:
                            results[order.pop(out.request_id)] = out
                            bar.update(1)
        finally:
            for rid in order:  # interrupted: leave nothing behind
                engine.abort_request(rid)
            if self._trace_file is not None:
                self._trace_file.flush()
        return results  # type: ignore[return-value]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _as_params(
    sp: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    items = list(sp)
    if len(items) != n:
        raise ValueError(f"sampling_params has {len(items)} entries for {n} prompts")
    return items
