"""Prompt text of a requested token length, made from the served model's tokenizer.

Workloads (``kvloop.sim``) carry made-up token ids, not text. A prompt is cut into blocks of
:data:`BLOCK_TOKENS` ids and each block becomes random text keyed by its first id, so equal
blocks give equal text: Mooncake's hash ids (``BlockPrompt``) become shared prefixes that a
server's prefix cache can hit, while synthetic prompts (disjoint ``range`` ids) stay unique.

Block text comes from random ordinary (non-special) token ids, decoded, re-encoded and
trimmed or topped up until it encodes to the block's length (a few rounds; close, not always
exact, since byte-level merges across the joins may shift a token or two).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BLOCK_TOKENS", "PromptBuilder", "load_tokenizer"]

BLOCK_TOKENS = 512
"""Tokens per prompt block: Mooncake's hash-id block size."""
_ROUNDS = 6


def load_tokenizer(tokenizer: str | os.PathLike[str] | None, model: str = "default") -> Any:
    """kvloop's :class:`~kvloop.engine.tokenizer.Tokenizer` of ``tokenizer`` (a folder with
    the tokenizer files, or anything ``resolve_model`` takes), else of ``resolve_model(model)``.
    """
    from kvloop.engine.model_source import resolve_model
    from kvloop.engine.tokenizer import Tokenizer

    source = tokenizer if tokenizer is not None else model
    path = Path(os.fspath(source)).expanduser()
    return Tokenizer(path if path.is_dir() else resolve_model(os.fspath(source)))


class PromptBuilder:
    """Turns workload prompts (token-id sequences) into text of about the same token count."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        hf = getattr(tokenizer, "hf", tokenizer)
        self._hf = hf
        self._seed = seed
        special = set(hf.all_special_ids) | set(hf.get_added_vocab().values())
        self._ids = [i for i in range(len(hf)) if i not in special]
        if not self._ids:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
        self.num_special = len(hf.encode("", add_special_tokens=True))
        """Tokens the server's tokenizer adds to every prompt (e.g. BOS); subtracted."""
        self._cache: dict[tuple[int, int], str] = {}

    def count(self, text: str) -> int:
        """Tokens of ``text`` as a completions prompt (special tokens included)."""
        return len(self._hf.encode(text, add_special_tokens=True))

    def _encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def block_text(self, key: int, length: int) -> str:
        """Text of about ``length`` tokens for block ``key``; the same (key, length), same text.

        Blocks of one key share their random id draws, so a shorter block of a key starts
        like the longer one.
        """
        if length <= 0:
            return ""
        cached = self._cache.get((key, length))
        if cached is not None:
            return cached
        rng = random.Random(f"prompt-{self._seed}-{key}")
        ids = rng.choices(self._ids, k=length)
        text = self._hf.decode(ids)
        for _ in range(_ROUNDS):
            again = self._encode(text)
            if len(again) == length:
                break
            ids = again[:length] if len(again) > length else (
                again + rng.choices(self._ids, k=length - len(again)))
            text = self._hf.decode(ids)
        self._cache[(key, length)] = text
        return text

    def text_for(self, prompt_ids: Sequence[int]) -> str:
        """Text for a workload prompt: one block of text per :data:`BLOCK_TOKENS` ids."""
        n = len(prompt_ids)
        target = max(1, n - self.num_special)
        parts = []
        for start in range(0, target, BLOCK_TOKENS):
            length = min(BLOCK_TOKENS, target - start)
            parts.append(self.block_text(int(prompt_ids[start]), length))
        return "".join(parts)
