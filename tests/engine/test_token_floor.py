"""The word floor on token counts: which tokenizers it holds for, that it is a floor, that a
text of too many words is refused without being encoded, and that encoding a long text
leaves the GIL to other threads."""

from __future__ import annotations

import random
import string
import threading
import time
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers  # noqa: E402

from kvloop.engine.intake import EngineLimits, InvalidRequestError, encode_prompt  # noqa: E402
from kvloop.engine.token_floor import (  # noqa: E402
    count_words,
    dropped_characters,
    splits_words,
)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ("the quick brown fox jumps over the lazy dog; hello world, it's 2024! "
          "tabs\tand\nnew lines, unicode: caf\u00e9 na\u00efve \u4e2d\u6587 \u00a0spaces ")


def _trained(pre: object, normalizer: object | None = None, **bpe: object
             ) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(**bpe))
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                             special_tokens=["<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator([CORPUS] * 8, trainer)
    return tok


def _cases() -> dict[str, tuple[tokenizers.Tokenizer, bool]]:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    llama3 = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                      pre_tokenizers.ByteLevel(use_regex=False)])
    smollm2 = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       byte_level])
    joined = _trained(byte_level)
    joined.add_tokens([AddedToken("new york")])
    missing_bytes = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    missing_bytes.pre_tokenizer = byte_level
    return {
        "a byte-level vocabulary without every byte": (missing_bytes, False),
        "a normalizer that strips accents": (_trained(
            pre_tokenizers.Whitespace(), normalizers.StripAccents(), unk_token="<unk>"), False),
        "bert's normalizer (drops control characters)": (_trained(
            pre_tokenizers.Whitespace(), normalizers.BertNormalizer(), unk_token="<unk>"),
            False),
        "nfkc and lowercase": (_trained(byte_level, normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Lowercase()])), True),
        "gpt2 byte-level": (_trained(byte_level), True),
        "llama3 split + byte-level": (_trained(llama3), True),
        "smollm2 digits + byte-level": (_trained(smollm2), True),
        "bert whitespace": (_trained(pre_tokenizers.Whitespace(), unk_token="<unk>"), True),
        "metaspace (spaces become ▁)": (_trained(pre_tokenizers.Metaspace(),
                                                  unk_token="<unk>"), False),
        "digits only": (_trained(pre_tokenizers.Digits()), False),
        "byte-level without its regex": (_trained(pre_tokenizers.ByteLevel(use_regex=False)),
                                         False),
        "a normalizer that replaces spaces": (_trained(pre_tokenizers.Whitespace(),
                                                       normalizers.Replace(" ", "_"),
                                                       unk_token="<unk>"), False),
        "no unknown token (pieces may vanish)": (_trained(pre_tokenizers.Whitespace()), False),
        "an added token with a space inside": (joined, False),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_splits_words_where_it_holds(name: str) -> None:
    tok, expected = CASES[name]
    assert splits_words(tok) is expected


@pytest.mark.parametrize("name", [n for n, (_, ok) in CASES.items() if ok])
def test_words_never_exceed_tokens(name: str) -> None:
    """On random texts of words, spaces, digits, punctuation, CJK and control characters, the
    word count is at most the token count, for every tokenizer ``splits_words`` admits."""
    tok, _ = CASES[name]
    dropped = dropped_characters(tok)
    assert dropped is not None
    rng = random.Random(7)
    pieces = [*string.ascii_letters, *string.digits, *string.punctuation, " ", "  ", "\t", "\n",
              "\r\n", "\u00a0", "\u3000", "\u2003", "\x1c", "\x1f", "\u4e2d", "\u00e9", "'s",
              "the", "hello", "\x00", "\u0301", "\x0b", "\x85", "\ufb01", "\u00c5"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        n = len(tok.encode(text, add_special_tokens=False).ids)
        assert count_words(text, 10**6, dropped) <= n, (text, n)


def test_bytes_a_byte_level_vocabulary_lacks_are_not_words() -> None:
    """A byte-level vocabulary without some control bytes (SmolLM2's lacks six) drops them:
    a word of only those is no token, and is not counted."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    kept = [c for c in alphabet if c not in ("Ą", "Ć")]  # the characters of bytes 4 and 6
    lacking = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(kept)},
                                              merges=[]))
    lacking.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert dropped_characters(lacking) == "\x04\x06"
    text = "\x04 \x06\x04"
    assert len(lacking.encode(text, add_special_tokens=False).ids) == 1  # the space only
    assert count_words(text, 100, "\x04\x06") == 0
    assert count_words(text, 100) == 2  # NOTE: counting them, the floor would be too high
    assert count_words("\x04 \x06\x04 a\x04 b", 100, "\x04\x06") == 2


def test_count_words_reads_only_what_it_needs() -> None:
    text = "w1 " * 200_000
    started = time.perf_counter()
    assert count_words(text, 8192) == 8192
    assert time.perf_counter() - started < 0.05
    assert count_words("a\x1fb  c", 10) == 2  # NOTE: not a Unicode space: part of a word
    assert count_words(" \n\t", 10) == 0


def test_too_many_words_are_refused_without_encoding() -> None:
    """A text of more words than the model takes tokens is refused by its words; the
    tokenizer never encodes it."""

    class Counting:
        calls = 0

        def encode(self, prompt: str) -> list[int]:
            Counting.calls += 1
            return [1] * len(prompt.split())

        def token_floor(self, text: str, cap: int) -> int:
            return count_words(text, cap)

    limits = EngineLimits(max_model_len=256, kv_cache_tokens=4096)
    with pytest.raises(InvalidRequestError, match="more than 255 words") as exc:
        encode_prompt("w1 " * 200_000, limits, Counting())
    assert exc.value.field == "prompt" and Counting.calls == 0
    assert len(encode_prompt("w " * 255, limits, Counting()).prompt_token_ids) == 255


def test_a_long_encode_leaves_the_gil_to_other_threads(tmp_path: Path) -> None:
    """Encoding 600 KB takes a sizeable fraction of a second; a thread ticking every
    millisecond meanwhile is never held up for long (``Tokenizer.encode`` goes through the
    batch encoder, which releases the GIL)."""
    from kvloop.engine.tokenizer import Tokenizer

    tok, _ = CASES["gpt2 byte-level"]
    fast = tokenizers.Tokenizer.from_str(tok.to_str())
    fast.save(str(tmp_path / "tokenizer.json"))
    transformers = pytest.importorskip("transformers")
    transformers.PreTrainedTokenizerFast(tokenizer_object=fast, unk_token="<unk>"
                                         ).save_pretrained(tmp_path)
    ours = Tokenizer(tmp_path)
    text = "hello world quick fox " * 30_000
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    started = time.perf_counter()
    ids = ours.encode(text)
    took = time.perf_counter() - started
    stop.set()
    ticker.join()
    assert len(ids) > 100_000
    assert max(gaps) < max(0.1, took / 3), (max(gaps), took)
