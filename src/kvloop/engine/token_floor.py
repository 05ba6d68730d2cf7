"""A lower bound on a text's token count, without encoding it: its whitespace-separated words.

Encoding is the costly part of taking a long prompt (about 0.5 s per 600 KB on this
project's 2-core VM); a text of more words than a model takes tokens can be refused after
reading only that many words. The bound holds when the tokenizer never puts two words in
one token (``splits_words``): its pre-tokenizer cuts the text at whitespace (GPT-2's and the
GPT-4-style byte-level regexes of Llama 3, Qwen2 and SmolLM2 do; so do BERT's), nothing
before it joins words or drops characters, no added token holds whitespace between other
characters, and its model gives every piece at least one token (byte-level BPE whose
vocabulary holds all 256 bytes, byte fallback, or an unknown-token). Each word then starts
at least one piece, and each piece is at least one token. Other tokenizers
(SentencePiece-style ones that turn spaces into ``▁``) get no bound.
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
_KEEP_WHITESPACE = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "Prepend"}
"""Normalizers that never join two words nor empty one (NFKC may write a space, never remove
one). Not ``StripAccents`` (a word of combining marks vanishes) nor ``BertNormalizer`` (it
drops control characters)."""
_PROBE = ("Hello world  it's 12 345 a\tb c\nd e\r\nf !? ¿q x\u00a0y s\u2003t 中文 字 ok'll "
          "x\u3000y (a) [b] --c-- 'q' \"r\" x.y z,  \n\n  end")
"""A text with every kind of word boundary the pre-tokenizer must cut at."""
_WORDS_JOINED = re.compile(r"\S\s+\S")


def dropped_characters(backend: Any) -> str | None:
    """The characters ``backend`` (a ``tokenizers.Tokenizer``) encodes to nothing, when no
    token of it can hold parts of two whitespace-separated words and every other word gives
    at least one token ("" when it drops none); None when words are no floor on its tokens
    (module docstring)."""
    try:
        pre = backend.pre_tokenizer
        pre_state = json.loads(pre.__getstate__()) if pre is not None else None
        if pre_state is None or not _pre_tokenizer_ok(pre_state):
            return None
        normalizer = backend.normalizer
        if normalizer is not None and not _normalizer_ok(json.loads(normalizer.__getstate__())):
            return None
        dropped = _dropped_by_model(backend, pre_state)
        if dropped is None or any(_WORDS_JOINED.search(t.content)
                                  for t in backend.get_added_tokens_decoder().values()):
            return None
        pieces = pre.pre_tokenize_str(_PROBE)
    except Exception:  # an unusual tokenizer: no bound rather than a wrong one
        return None
    if any(_WORDS_JOINED.search(_PROBE[start:end]) for _, (start, end) in pieces):
        return None
    return dropped


def splits_words(backend: Any) -> bool:
    """Whether ``backend``'s words are a floor on its tokens (``dropped_characters``)."""
    return dropped_characters(backend) is not None


def count_words(text: str, cap: int, dropped: str = "") -> int:
    """Whitespace-separated words of ``text`` that hold a character other than ``dropped``,
    counted up to ``cap`` (at most ``cap`` is returned; the work is proportional to the
    first ``cap`` words, not to the text)."""
    if any(c in text for c in _PYTHON_ONLY_SPACES):
        text = text.translate({ord(c): "x" for c in _PYTHON_ONLY_SPACES})
    parts = text.split(None, cap)
    if dropped and any(c in text for c in dropped):
        # NOTE: the last part may hold many words; it counts once if any is kept
        blank = dropped + _SPACES
        return min(sum(1 for p in parts if p.strip(blank)), cap)
    return min(len(parts), cap)


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


def _dropped_by_model(backend: Any, pre: dict[str, Any]) -> str | None:
    """The characters the model drops from a piece ("" for none), or None when a piece may
    give no token for another reason."""
    model = backend.model
    kind = type(model).__name__
    if kind in ("WordPiece", "WordLevel"):
        return "" if getattr(model, "unk_token", None) is not None else None
    if kind == "Unigram":
        return ""  # NOTE: it falls back to its unknown token
    if kind != "BPE":
        return None
    if getattr(model, "unk_token", None) is not None or getattr(model, "byte_fallback", False):
        return ""
    members = pre.get("pretokenizers", [pre])
    if not any(m.get("type") == "ByteLevel" for m in members):
        return None
    # NOTE: byte-level BPE drops a byte whose character is not a token. A character is lost
    # only if all its bytes are: an ASCII one whose byte is missing, or (never, while every
    # continuation byte 0x80-0xBF is a token) a multi-byte one.
    vocab = backend.get_vocab(with_added_tokens=False)
    missing = [b for b, c in enumerate(_BYTE_CHARS) if c not in vocab]
    if any(0x80 <= b <= 0xBF for b in missing):
        return None
    return "".join(chr(b) for b in missing if b < 0x80)


def _byte_chars() -> str:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255 (the
    printable ones stand for themselves, the others for 256 + their rank)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return "".join(chr(b) if b in keep else chr(next(extra)) for b in range(256))


_BYTE_CHARS = _byte_chars()
_SPACES = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
