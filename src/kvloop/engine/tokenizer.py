"""The tokenizer of a local Hugging Face folder: encode, chat template, EOS ids, detokenizers."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvloop.engine.detokenizer import Detokenizer


class Tokenizer:
    """A transformers fast tokenizer loaded from ``path`` (never from the network)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{self.path}: cannot load its tokenizer: {first}") from exc
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{self.path}: kvloop needs a fast tokenizer (tokenizer.json)")
        self.hf: Any = hf
        """The transformers tokenizer."""
        self.backend: Any = hf.backend_tokenizer
        """Its ``tokenizers.Tokenizer``, which the detokenizers decode with."""
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        """EOS ids of generation_config.json and of the tokenizer, together."""

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = self.path / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or ())
        if isinstance(self.hf.eos_token_id, int):
            ids.add(self.hf.eos_token_id)
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt``, with the special tokens (e.g. BOS) the tokenizer adds."""
        return list(self.hf.encode(prompt, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        """The conversation as text through the model's chat template."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.path} has no chat template; "
                             "give a plain prompt instead")
        return self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation through the chat template, ready for the reply.

        The template writes its own special tokens (BOS included), so none are added here.
        """
        text = self.render_chat(messages, add_generation_prompt)
        return list(self.hf.encode(text, add_special_tokens=False))

    def detokenizer(self, prompt_ids: Sequence[int], params: Any = None) -> Detokenizer:
        """A fresh incremental detokenizer for one request with ``params.stop`` strings."""
        stop = list(getattr(params, "stop", None) or ())
        skip = getattr(params, "skip_special_tokens", True)
        return Detokenizer(self.backend, prompt_ids, stop, skip_special_tokens=skip)
