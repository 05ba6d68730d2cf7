"""A lower bound on a text's token count, without encoding it: its whitespace-separated words.

Encoding is the costly part of taking a long prompt (about 0.5 s per 600 KB on this
project's 2-core VM); a text of more words than a model takes tokens can be refused after
reading only that many words. The bound holds when the tokenizer never puts two words in
one token (``splits_words``): its pre-tokenizer cuts the text at whitespace (GPT-2's and the
GPT-4-style byte-level regexes of Llama 3, Qwen2 and SmolLM2 do; so do BERT's), nothing
before it joins words or drops characters, no added token holds whitespace between other
characters, and its model gives every piece at least one token (byte-level BPE, or an
unknown-token). Each word then starts at least one piece, and each piece is at least one
token. Other tokenizers (SentencePiece-style ones that turn spaces into ``▁``) get no bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

_PYTHON_ONLY_SPACES = "\x1c\x1d\x1e\x1f"
"""What ``str.split()`` takes for whitespace and Unicode (and so the tokenizers' regexes)
does not: counted as part of a word here, which only lowers the bound."""
_ONLY_SPLITS = {"Digits", "Punctuation", "UnicodeScripts", "Split", "CharDelimiterSplit",
                "Whitespace", "WhitespaceSplit", "BertPreTokenizer", "ByteLevel"}
"""Pre-tokenizers that cut a text into pieces (ByteLevel also maps each byte to a character
of its own, after its cut)."""
_KEEP_WHITESPACE = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents",
                    "BertNormalizer", "Prepend"}
"""Normalizers that never join two words (NFKC may write a space, never remove one)."""
_PROBE = ("Hello world  it's 12 345 a\tb c\nd e\r\nf !? ¿q x\u00a0y s\u2003t 中文 字 ok'll "
          "x\u3000y (a) [b] --c-- 'q' \"r\" x.y z,  \n\n  end")
"""A text with every kind of word boundary the pre-tokenizer must cut at."""
_WORDS_JOINED = re.compile(r"\S\s+\S")


def splits_words(backend: Any) -> bool:
    """Whether no token of ``backend`` (a ``tokenizers.Tokenizer``) can hold parts of two
    whitespace-separated words, and every word gives at least one token (module docstring)."""
    try:
        pre = backend.pre_tokenizer
        if pre is None or not _pre_tokenizer_ok(json.loads(pre.__getstate__())):
            return False
        normalizer = backend.normalizer
        if normalizer is not None and not _normalizer_ok(json.loads(normalizer.__getstate__())):
            return False
        if not _model_keeps_every_piece(backend.model, json.loads(pre.__getstate__())):
            return False
        if any(_WORDS_JOINED.search(t.content)
               for t in backend.get_added_tokens_decoder().values()):
            return False
        pieces = pre.pre_tokenize_str(_PROBE)
    except Exception:  # an unusual tokenizer: no bound rather than a wrong one
        return False
    return not any(_WORDS_JOINED.search(_PROBE[start:end]) for _, (start, end) in pieces)


def count_words(text: str, cap: int) -> int:
    """Whitespace-separated words of ``text``, counted up to ``cap`` (at most ``cap`` is
    returned; the work is proportional to the first ``cap`` words, not to the text)."""
    if any(c in text for c in _PYTHON_ONLY_SPACES):
        text = text.translate({ord(c): "x" for c in _PYTHON_ONLY_SPACES})
    return min(len(text.split(None, cap)), cap)


def _pre_tokenizer_ok(pre: dict[str, Any]) -> bool:
    kind = pre.get("type")
    if kind == "Sequence":
        members = pre.get("pretokenizers", [])
        return bool(members) and all(m.get("type") in _ONLY_SPLITS for m in members)
    return kind in _ONLY_SPLITS


def _normalizer_ok(normalizer: dict[str, Any]) -> bool:
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_ok(n) for n in normalizer.get("normalizers", []))
    return kind in _KEEP_WHITESPACE


def _model_keeps_every_piece(model: Any, pre: dict[str, Any]) -> bool:
    """Whether every non-empty piece becomes at least one token (no character dropped)."""
    kind = type(model).__name__
    if kind in ("WordPiece", "WordLevel"):
        return getattr(model, "unk_token", None) is not None
    if kind == "Unigram":
        return True  # NOTE: it falls back to its unknown token
    if kind != "BPE":
        return False
    members = pre.get("pretokenizers", [pre])
    byte_level = any(m.get("type") == "ByteLevel" for m in members)
    return byte_level or bool(getattr(model, "byte_fallback", False)) or (
        getattr(model, "unk_token", None) is not None)
