"""The tokenizer of a local Hugging Face folder: encode, chat template, EOS ids, detokenizers.

Fast and exact: the first load of a folder builds transformers' tokenizer (``AutoTokenizer``,
about 1-9 s) and records what it effectively encodes with: its ``tokenizers`` backend (which
transformers may have changed from ``tokenizer.json``: added special tokens, a post-processor
rebuilt from ``add_bos_token``, a patched pre-tokenizer), its chat template, its special
tokens and decode settings. Later loads read that record from the cache
(``cache_dir()/tokenizers``, keyed by the tokenizer files' bytes and the transformers and
tokenizers versions) and use ``tokenizers`` directly, with the chat template rendered by
jinja2 as transformers renders it (``chat_template.py``): the same token ids in a tenth of
the time, without importing transformers.

NOTE: the record is only used for tokenizer classes that encode and decode through the
backend unchanged (transformers' ``TokenizersBackend`` methods, not overridden); any other
class is loaded through transformers every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvloop.engine.chat_template import render_chat_template
from kvloop.engine.detokenizer import Detokenizer
from kvloop.engine.token_floor import count_words, dropped_characters

RECORD_VERSION = 1
"""Part of the cache key: bump it when the record's meaning changes."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack",
                    ".onnx", ".ckpt", ".npz", ".pkl")
_MAX_HASHED_FILE = 256 << 20
# transformers' methods that must not be overridden for the record to be exact
_PLAIN_METHODS = ("_encode_plus", "encode", "__call__", "_decode", "decode",
                  "clean_up_tokenization", "apply_chat_template", "get_chat_template")


class Tokenizer:
    """A fast tokenizer loaded from the folder ``path`` (never from the network)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._hf: Any = None
        key, record = _cache_key(self.path), None
        if key is not None:
            record = _read_record(key)
        if record is None:
            record = self._record_from_transformers()
            if key is not None:
                _write_record(key, record)
        self._from_record(record)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        """EOS ids of generation_config.json and of the tokenizer, together."""

    # -- loading ---------------------------------------------------------------------
    def _record_from_transformers(self) -> dict[str, Any]:
        hf = self._load_hf()
        backend = hf.backend_tokenizer
        record: dict[str, Any] = {
            "version": RECORD_VERSION,
            "plain": _is_plain(hf),
            "backend": None,
            "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
            "clean_up_tokenization_spaces": _cleans_up(hf),
            "special_tokens": {k: str(v) for k, v in hf.special_tokens_map.items()},
            "chat_template": getattr(hf, "chat_template", None),
            "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id,
            "vocab_size": len(hf),
        }
        from tokenizers import Tokenizer as Backend

        effective = Backend.from_str(backend.to_str())
        _neutral(effective)
        file = self.path / "tokenizer.json"
        as_is = None
        if file.is_file():
            as_is = Backend.from_file(str(file))
            _neutral(as_is)
        if as_is is None or as_is.to_str() != effective.to_str():
            record["backend"] = effective.to_str()  # transformers changed it: keep its version
        return record

    def _from_record(self, record: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as Backend

        if not record["plain"]:
            hf = self._load_hf()
            self.backend: Any = hf.backend_tokenizer
            """The ``tokenizers.Tokenizer`` this encodes and decodes with."""
        elif record["backend"] is not None:
            self.backend = Backend.from_str(record["backend"])
        else:
            self.backend = Backend.from_file(str(self.path / "tokenizer.json"))
        if record["plain"]:
            _neutral(self.backend)
            self.backend.encode_special_tokens = record["split_special_tokens"]
        self._plain = bool(record["plain"])
        self._clean_up = bool(record["clean_up_tokenization_spaces"])
        self.special_tokens: dict[str, str] = dict(record["special_tokens"])
        """Named special tokens (``bos_token``, ``eos_token``, ...), as chat templates see
        them."""
        self.chat_template: str | dict[str, str] | None = record["chat_template"]
        """The model's chat template (a dict when it has several, by name)."""
        self._bos: int | None = record["bos_token_id"]
        self._eos: int | None = record["eos_token_id"]
        self._vocab_size = int(record["vocab_size"])
        self._dropped = dropped_characters(self.backend)
        """Characters the tokenizer encodes to nothing, when its words (of other characters)
        are a floor on its tokens (``token_floor.dropped_characters``); None: they are not."""

    def _load_hf(self) -> Any:
        if self._hf is None:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except (OSError, ValueError, TypeError) as exc:
                text = str(exc).strip()
                first = text.splitlines()[0] if text else type(exc).__name__
                raise ValueError(f"{self.path}: cannot load its tokenizer: {first}") from exc
            if not getattr(hf, "is_fast", False):
                raise ValueError(f"{self.path}: kvloop needs a fast tokenizer (tokenizer.json)")
            self._hf = hf
        return self._hf

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of the folder, loaded on first use (seconds): for callers
        that need its wider API; kvloop itself encodes and decodes without it."""
        return self._load_hf()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = self.path / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or ())
        if isinstance(self._eos, int):
            ids.add(self._eos)
        return ids

    # -- the tokenizer ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """The BOS token's id (None when the tokenizer has none)."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (``eos_token_ids`` adds generation_config.json's)."""
        return self._eos

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self.chat_template)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (as transformers' ``get_vocab``)."""
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt``, with the special tokens (e.g. BOS) the tokenizer adds
        unless ``add_special_tokens`` is False.

        NOTE: through the batch encoder, which releases the GIL while it works (``encode``
        holds it: 0.5 s per 600 KB stalled every other thread, the event loop's too)."""
        if not self._plain:  # NOTE: transformers encodes through the batch encoder too
            return list(self.hf.encode(prompt, add_special_tokens=add_special_tokens))
        return self.backend.encode_batch_fast([prompt], add_special_tokens=add_special_tokens
                                              )[0].ids

    def token_floor(self, text: str, cap: int) -> int:
        """A lower bound on the tokens ``text`` encodes to, counted up to ``cap``: its words
        where they are a floor (``token_floor``), else 0. Reads only as many words as
        ``cap``, so a text too long for the model is refused without encoding it
        (``intake.check_prompt_words``)."""
        return count_words(text, cap, self._dropped) if self._dropped is not None else 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (as transformers' ``decode``)."""
        if not self._plain:
            return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        """The conversation as text through the model's chat template."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.path} has no chat template; "
                             "give a plain prompt instead")
        if not self._plain:
            return self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        template = self.chat_template
        if isinstance(template, dict):
            if "default" not in template:
                raise ValueError(f"the tokenizer of {self.path} has several chat templates "
                                 f"and none named 'default': {sorted(template)}")
            template = template["default"]
        return render_chat_template(str(template), messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation through the chat template, ready for the reply.

        The template writes its own special tokens (BOS included), so none are added here.
        """
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int], params: Any = None) -> Detokenizer:
        """A fresh incremental detokenizer for one request with ``params.stop`` strings."""
        stop = list(getattr(params, "stop", None) or ())
        skip = getattr(params, "skip_special_tokens", True)
        return Detokenizer(self.backend, prompt_ids, stop, skip_special_tokens=skip)


_LOADED: dict[tuple[str, str | None], Tokenizer] = {}
_LOADED_LOCK = threading.Lock()


def load_tokenizer(folder: str | os.PathLike[str]) -> Tokenizer:
    """The folder's tokenizer, loaded once per process while its files stay the same (a
    command that checks its prompts before the model loads, and the engine after, share
    one).

    NOTE: a ``Tokenizer`` is not changed after loading, so sharing it is safe."""
    path = Path(folder).resolve()
    key = (str(path), _cache_key(path))
    with _LOADED_LOCK:
        found = _LOADED.get(key)
    if found is None:
        found = Tokenizer(path)
        with _LOADED_LOCK:
            found = _LOADED.setdefault(key, found)
    return found


def _neutral(backend: Any) -> None:
    """What transformers' ``encode`` sets before every call: no truncation, no padding."""
    backend.no_truncation()
    backend.no_padding()


def _is_plain(hf: Any) -> bool:
    """Whether ``hf`` encodes, decodes and renders chats as ``TokenizersBackend`` does."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(hf)
    return isinstance(hf, TokenizersBackend) and all(
        getattr(cls, name, None) is getattr(TokenizersBackend, name, None)
        for name in _PLAIN_METHODS)


def _cleans_up(hf: Any) -> bool:
    """Whether transformers' ``decode`` applies ``clean_up_tokenization`` (it skips BPE
    models unless forced)."""
    if not getattr(hf, "clean_up_tokenization_spaces", False):
        return False
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    force = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False)
    return not bpe or bool(force)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m")
            .replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re"))


# -- the record cache ----------------------------------------------------------------------
def _cache_key(folder: Path) -> str | None:
    """A hash of every tokenizer-related file of ``folder`` (all but weights) and of the
    library versions; None when the folder cannot be read or the versions are unknown."""
    try:
        versions = [importlib.metadata.version(d) for d in ("transformers", "tokenizers")]
        h = hashlib.blake2b(f"kvloop-tokenizer-v{RECORD_VERSION}|{versions}".encode())
        files = sorted(p for p in folder.iterdir() if p.is_file())
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            files += sorted(p for p in extra.iterdir() if p.is_file())
        for file in files:
            if file.name.endswith(_WEIGHT_SUFFIXES) or file.stat().st_size > _MAX_HASHED_FILE:
                continue
            h.update(f"|{file.relative_to(folder)}|{file.stat().st_size}|".encode())
            h.update(file.read_bytes())
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return h.hexdigest()[:32]


def _record_path(key: str) -> Path:
    from kvloop.paths import cache_dir

    return cache_dir() / "tokenizers" / f"{key}.json"


def _read_record(key: str) -> dict[str, Any] | None:
    try:
        record = json.loads(_record_path(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == RECORD_VERSION \
        else None


def _write_record(key: str, record: dict[str, Any]) -> None:
    """Write atomically; a cache that cannot be written only costs the next load time."""
    path = _record_path(key)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, ensure_ascii=False)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
