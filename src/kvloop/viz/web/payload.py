"""What the page is fed: step records as JSON-ready dicts, and the words for the codes."""

from __future__ import annotations

from typing import Any

from kvloop.core.decisions import CAUSE_WORDS, REASON_WORDS
from kvloop.core.stats import StepRecord


def words() -> dict[str, dict[str, str]]:
    """The reason and preemption-cause codes of step records, in words."""
    return {"reasons": {str(k): v for k, v in REASON_WORDS.items()},
            "causes": {str(k): v for k, v in CAUSE_WORDS.items()}}


def record_dicts(records: list[StepRecord]) -> list[dict[str, Any]]:
    """Each record as its JSONL line has it."""
    return [r.to_dict() for r in records]


def trace_payload(records: list[StepRecord], source: str) -> dict[str, Any]:
    """The whole document ``trace.json`` serves: records, words and where they came from."""
    return {"source": source, "words": words(), "records": record_dicts(records)}
