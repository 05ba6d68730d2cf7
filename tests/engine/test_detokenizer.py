"""Incremental detokenizer (multi-byte characters, stop strings) and the Tokenizer wrapper."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvloop.engine import detokenizer
from kvloop.engine.detokenizer import HELD_TOKENS, Detokenizer

CORPUS = [
    "hello world, this is a small corpus for a tiny byte level tokenizer.",
    "the quick brown fox jumps over the lazy dog. stop here, please.",
    "tokens are merged from bytes; rare characters stay as single bytes.",
] * 20
TEXT = "héllo 你好 🙂 world, stop here: 你好🙂 done"
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok() -> RawTokenizer:
    """A GPT-2 style byte-level BPE trained here: CJK and emoji stay split into byte tokens."""
    t = RawTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS, trainer)
    return t


def _stream(detok: Detokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for i in ids:
        delta, stopped = detok.add([i])
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


@pytest.fixture(params=[True, False], ids=["DecodeStream", "prefix-offset"])
def use_stream(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_multibyte_characters_are_never_emitted_half(tok, use_stream):
    ids = tok.encode(TEXT).ids
    # The test only means something if some token is an incomplete UTF-8 sequence on its own.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, stopped = _stream(Detokenizer(tok, use_decode_stream=use_stream), ids)
    assert not stopped
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(d == "" for d in deltas) > 0  # something was held back


def test_prompt_context_and_special_tokens(tok, use_stream):
    prompt = tok.encode("hello world, ").ids
    eos = tok.token_to_id(EOS)
    ids = [*tok.encode("héllo 🙂").ids, eos]
    detok = Detokenizer(tok, prompt, use_decode_stream=use_stream)
    assert "".join(_stream(detok, ids)[0]) == "héllo 🙂"
    detok = Detokenizer(tok, prompt, skip_special_tokens=False, use_decode_stream=use_stream)
    assert "".join(_stream(detok, ids)[0]) == "héllo 🙂" + EOS


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["stop"], "héllo 你好 🙂 world, "),
        (["你好🙂"], "héllo 你好 🙂 world, stop here: "),  # bytes of three characters
        (["🙂", "world"], "héllo 你好 "),  # the earliest match wins
        (["lo 你", "xyz"], "hél"),
        (["not there", "zz"], TEXT),
    ],
)
def test_stop_strings(tok, use_stream, stop, expected):
    ids = tok.encode(TEXT).ids
    detok = Detokenizer(tok, stop=stop, use_decode_stream=use_stream)
    emitted = ""
    for i in ids:
        delta, stopped = detok.add(i)
        emitted += delta
        # Whatever was emitted stays true of the final text: no stop string is ever half-sent.
        assert expected.startswith(emitted)
        if stopped:
            break
    else:
        emitted += detok.flush()
    assert emitted == expected == detok.text
    assert detok.stopped == (expected != TEXT)
    if detok.stopped:
        assert detok.stop_reason in stop
        assert detok.add([ids[-1]]) == ("", True)
        assert detok.flush() == ""


def test_stop_string_split_across_tokens(tok):
    stop = "quick brown"
    ids = tok.encode("the " + stop + " fox").ids
    assert all(stop not in tok.decode([i]) for i in ids)
    deltas, stopped = _stream(Detokenizer(tok, stop=[stop]), ids)
    assert stopped and "".join(deltas) == "the "


def test_flush_returns_a_dangling_partial_character(tok, use_stream):
    ids = tok.encode("ok 🙂").ids
    detok = Detokenizer(tok, use_decode_stream=use_stream)
    deltas = [detok.add(i)[0] for i in ids[:-1]]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids[:-1])
    assert detok.flush() == ""


def _lead_byte_token(tok) -> int:
    """A token that is the first byte of a multi-byte character alone: a run of them is no
    text (each lead byte is cut short by the next)."""
    first = tok.encode("你").ids[0]
    assert tok.decode([first]) == "\ufffd" and tok.decode([first] * 3) == "\ufffd" * 3
    return first


def test_bytes_that_never_end_a_character_are_released_as_they_go(tok, use_stream):
    """A run that never completes a character is not held back to the end (each token would
    decode every held one again): its final part goes out every HELD_TOKENS tokens, and
    the whole text is still the tokenizer's own decoding, valid characters after it too."""
    lead = _lead_byte_token(tok)
    ids = [lead] * (10 * HELD_TOKENS) + tok.encode(TEXT).ids
    detok = Detokenizer(tok, use_decode_stream=use_stream)
    deltas = [detok.add(i)[0] for i in ids[:10 * HELD_TOKENS]]
    out = "".join(deltas)
    assert out == "\ufffd" * len(out) and len(out) >= 9 * HELD_TOKENS
    deltas += [detok.add(i)[0] for i in ids[10 * HELD_TOKENS:]]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert "".join(deltas).endswith(TEXT)


def test_a_character_completed_after_held_tokens_is_kept_whole(tok, use_stream):
    """A lead byte held back behind a run of invalid ones still joins the bytes that complete
    it: the release cuts only where text already follows."""
    lead = _lead_byte_token(tok)
    rest = tok.encode("你").ids[1:]
    assert rest and "\ufffd" not in tok.decode([lead, *rest])
    for run in (HELD_TOKENS - 1, HELD_TOKENS, 2 * HELD_TOKENS - 1):
        ids = [lead] * run + [lead, *rest] + tok.encode(" ok").ids
        deltas, stopped = _stream(Detokenizer(tok, use_decode_stream=use_stream), ids)
        assert not stopped and "".join(deltas) == tok.decode(ids)
        assert "".join(deltas).endswith("你 ok")


def test_held_tokens_past_the_bound_are_released_as_flush_does(tok, use_stream, monkeypatch):
    """Where no part is final (here: the final-part release switched off), at most
    MAX_HELD_TOKENS tokens are held back: past it their text goes out as flush() gives it."""
    monkeypatch.setattr(detokenizer, "HELD_TOKENS", 10**9)
    monkeypatch.setattr(detokenizer, "MAX_HELD_TOKENS", 5)
    lead = _lead_byte_token(tok)
    detok = Detokenizer(tok, use_decode_stream=use_stream)
    deltas = [detok.add(lead)[0] for _ in range(18)]
    assert [len(d) for d in deltas] == ([0] * 5 + [6]) * 3
    assert "".join(deltas) + detok.flush() == "\ufffd" * 18


def test_a_prompt_ending_inside_a_character_is_not_output(tok, use_stream):
    """A prompt cut inside a character (token ids from a client) is no context: its text
    never comes out as output."""
    prompt = tok.encode("ok 你").ids[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    ids = tok.encode(" fine").ids
    deltas, stopped = _stream(Detokenizer(tok, prompt, use_decode_stream=use_stream), ids)
    assert not stopped and "".join(deltas) == " fine"


def _byte_level_bpe(extra: list[bytes]) -> RawTokenizer:
    """A byte-level BPE whose tokens are the 256 bytes and each of ``extra`` (ids 256, ...)."""
    # GPT-2's bytes-to-characters table, as the ByteLevel decoder reads it
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + i for i in range(256 - len(printable))]
    order = printable + [b for b in range(256) if b not in printable]
    table = dict(zip(order, map(chr, chars), strict=True))
    vocab = {table[b]: b for b in range(256)}
    merges = []
    for token in extra:
        text = "".join(table[b] for b in token)
        merges.append((text[:-1], text[-1]))
        vocab.setdefault(text[:-1], len(vocab))
        vocab[text] = len(vocab)
    t = RawTokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


def test_a_release_never_cuts_inside_an_invalid_sequence(use_stream):
    """Lead bytes held back, then a token that continues the last of them and goes on: the
    release must not cut between the lead byte and its continuation (the text then has one
    U+FFFD for both, as the tokenizer's decoding)."""
    tok = _byte_level_bpe([b"\xbdA", b"\xbdA\xe4"])
    bridge = tok.token_to_id("".join(tok.id_to_token(i) for i in (0xBD, ord("A"), 0xE4)))
    assert bridge is not None and tok.decode([0xE4, bridge]) == "\ufffdA\ufffd"
    for run in (HELD_TOKENS - 1, 2 * HELD_TOKENS - 1):
        ids = [0xE4] * run + [bridge, ord("x")]
        deltas, _ = _stream(Detokenizer(tok, use_decode_stream=use_stream), ids)
        assert "".join(deltas) == tok.decode(ids)


def test_released_text_follows_the_streams_own_context(tok, use_stream):
    """A prompt ending in a lead byte (no context for the stream), then output tokens that
    start with continuation bytes, long enough to be released: the output is the tokenizer's
    decoding of the output alone, released or not."""
    lead = _lead_byte_token(tok)
    prompt = [*tok.encode("ok ").ids, lead]
    cont = tok.encode("你").ids[1]
    assert tok.decode([cont]) == "\ufffd"
    for pairs in (3, 6, 12):
        ids = [cont, lead] * pairs + tok.encode(" fine").ids
        deltas, _ = _stream(Detokenizer(tok, prompt, use_decode_stream=use_stream), ids)
        assert "".join(deltas) == tok.decode(ids)


# -- Tokenizer (transformers wrapper) ----------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _save_folder(tmp_path, raw: RawTokenizer, template: str | None):
    transformers = pytest.importorskip("transformers")
    raw = RawTokenizer.from_str(raw.to_str())
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    kwargs = {"chat_template": template} if template else {}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                              **kwargs)
    hf.save_pretrained(tmp_path)
    eos = [raw.token_to_id(EOS), raw.token_to_id("<|im_end|>")]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tmp_path, set(eos)


def test_tokenizer_wrapper(tmp_path, tok):
    from kvloop.engine.tokenizer import Tokenizer

    folder, eos = _save_folder(tmp_path, tok, TEMPLATE)
    t = Tokenizer(folder)
    assert t.eos_token_ids == eos
    assert t.encode("hello world") == tok.encode("hello world").ids
    ids = t.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert t.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n")
    detok = t.detokenizer(ids, type("P", (), {"stop": ["lo"]})())
    out = detok.add(t.encode("hello"))
    assert out == ("hel", True)


def test_tokenizer_without_chat_template(tmp_path, tok):
    from kvloop.engine.tokenizer import Tokenizer

    folder, _ = _save_folder(tmp_path, tok, None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_missing_files(tmp_path):
    from kvloop.engine.tokenizer import Tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        Tokenizer(tmp_path)
