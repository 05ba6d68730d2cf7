"""Default sampling settings from a model's ``generation_config.json``, as vLLM takes them
(``--generation-config auto|vllm|PATH``, ``ModelConfig.get_diff_sampling_param``).

* ``auto`` (the default): the model folder's ``generation_config.json``;
* ``vllm``: none, so vLLM's neutral ``SamplingParams`` defaults apply (temperature 1.0,
  top_p 1.0, all tokens, 16 tokens);
* a path: that file, or the ``generation_config.json`` in that folder.

The fields taken are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``); unset (null) ones are
skipped, and other keys (``do_sample``, EOS ids, ...) are ignored, as vLLM ignores them.
They are defaults only: the offline API uses them when no ``SamplingParams`` is given
(``LLM.get_default_sampling_params``), ``kvloop generate`` for the flags not given, and a
server for the request fields a client left out.

The embedded default model (``--model default``) ships no sampling settings of its own, so
``auto`` gives it kvloop's (:data:`DEFAULT_MODEL_GENERATION_CONFIG`: greedy, 64 tokens)
unless the converted folder's file says otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvloop.errors import InvalidRequestError
from kvloop.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                   "max_new_tokens")
"""The generation-config keys vLLM takes as sampling defaults (``max_new_tokens`` becomes
``max_tokens``)."""
DEFAULT_MODEL_GENERATION_CONFIG: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 64}
"""``--model default`` under ``auto`` (its GGUF file carries no sampling settings): greedy,
64 new tokens, kvloop's choice for a 135M model. The model card's usage example samples at
temperature 0.2 and top_p 0.9, which on this model answers the README's question ("What is
the capital of France?") in rambling French for one seed in four."""


def read_generation_config(
    generation_config: str | os.PathLike[str], model_folder: str | os.PathLike[str] | None,
    *, model: str | None = None,
) -> dict[str, Any]:
    """The generation config's contents (``{}`` for ``vllm`` or when the model has none).

    ``model`` is the ``--model`` value; ``default`` adds the embedded model's settings.
    A ``PATH`` that does not exist, or a file that is not a JSON object, is a ``ValueError``.
    """
    source = os.fspath(generation_config)
    if source == "vllm":
        return {}
    if source == "auto":
        base = dict(DEFAULT_MODEL_GENERATION_CONFIG) if model == "default" else {}
        if model_folder is None:
            return base
        file = Path(model_folder) / GENERATION_CONFIG_FILE
        return {**base, **_read(file)} if file.is_file() else base
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"generation_config {source!r}: no such file (give 'auto', 'vllm', "
                         f"a generation_config.json or a folder holding one)")
    return _read(path)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a generation config must be a JSON object")
    return data


def sampling_defaults(config: dict[str, Any], *, source: str = "generation config"
                      ) -> dict[str, Any]:
    """``SamplingParams`` fields from a generation config's sampling keys (vLLM's
    ``get_diff_sampling_param``): only the keys present and not null, ``max_new_tokens`` as
    ``max_tokens``. Values ``SamplingParams`` refuses are a ``ValueError`` naming ``source``.
    """
    fields = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    try:
        SamplingParams(**fields)
    except InvalidRequestError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return fields


def default_sampling_fields(
    generation_config: str | os.PathLike[str], model_folder: str | os.PathLike[str] | None,
    *, model: str | None = None,
) -> dict[str, Any]:
    """The sampling defaults of a model: ``SamplingParams`` keyword arguments, empty when the
    neutral defaults apply. ``generation_config`` is ``EngineArgs.generation_config``,
    ``model_folder`` the resolved model folder, ``model`` the ``--model`` value."""
    config = read_generation_config(generation_config, model_folder, model=model)
    name = os.fspath(generation_config)
    source = "the model's generation config" if name == "auto" else f"generation_config {name}"
    return sampling_defaults(config, source=source)


def default_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` with ``fields`` set over the neutral defaults."""
    return SamplingParams(**fields)
