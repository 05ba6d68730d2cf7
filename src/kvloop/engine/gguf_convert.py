"""Convert a GGUF file into a Hugging Face folder (llama and qwen2 architectures).

The folder holds ``config.json``, ``generation_config.json``, float32 ``*.safetensors`` (sharded
with an index above ``SHARD_BYTES``), ``tokenizer.json`` and ``tokenizer_config.json`` with the
chat template; kvloop's runner and transformers' ``Auto*`` classes both load it.

* Weights: every tensor is dequantised with ``gguf.quants.dequantize`` and stored as float32.
  Dequantised values are ``scale * q (+ min)`` with a float16 scale, which bfloat16 (and often
  float16) cannot hold exactly while float32 can; the runner casts to its ``--dtype`` at load.
  llama.cpp permutes the Q/K rows of llama models for its RoPE kernel; that is undone here.
* Config: written from the GGUF metadata (classic Hugging Face keys: ``rope_theta``,
  ``rope_scaling``); llama3 RoPE scaling is recovered from the ``rope_freqs`` tensor.
* Tokenizer: transformers' GGUF tokenizer reader builds ``tokenizer.json``; digit-splitting
  pre-tokenizers it misses (SmolLM's) are fixed; ``tokenizer_config.json`` is written here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

SHARD_BYTES = 2 << 30
"""Largest safetensors shard written; bounds the memory a conversion needs."""

# GGUF architecture -> (HF model_type, HF class, whether llama.cpp permuted the Q/K rows)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # read into config.json's rope_scaling instead
# llama.cpp pre-tokenizers that split every digit apart (transformers' GGUF reader misses them)
_DIGIT_PRE_TOKENIZERS = {"smollm", "starcoder", "refact"}


def convert_gguf_into(gguf_path: Path, out: Path) -> None:
    """Write the Hugging Face folder for ``gguf_path`` into the existing folder ``out``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    config, generation_config = _configs(reader)
    _write_weights(reader, config, out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    _write_tokenizer(gguf_path, reader, config, out)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _configs(reader: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and ``generation_config.json`` contents from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; kvloop converts: "
                         f"{', '.join(sorted(_ARCHS))}")
    model_type, cls, _ = _ARCHS[arch]

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    if _field(reader, "tokenizer.ggml.model") is None:
        raise ValueError("the GGUF file has no tokenizer; kvloop needs one to serve text")
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ggml order: in, out
    names = set(shapes)
    hidden, n_head = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden // n_head
    theta = float(meta("rope.freq_base", 10000.0))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][1],  # the embedding's rows, padding included
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_head)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, int(head_dim)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    eos_ids = [i for key in ("eos", "eot", "eom")
               if (i := _field(reader, f"tokenizer.ggml.{key}_token_id")) is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if (pad := _field(reader, "tokenizer.ggml.padding_token_id")) is not None:
        generation["pad_token_id"] = pad
    return config, generation


def _rope_scaling(reader: Any, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """RoPE scaling from metadata, or llama3's, recovered from its ``rope_freqs`` factors."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    # llama.cpp writes llama3's per-frequency divisors; Llama 3.x all use low 1, high 4, 8192.
    low, high, orig = 1.0, 4.0, int(orig or 8192)
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (orig / wavelen - low) / (high - low)
    expect = np.where(wavelen < orig / high, 1.0,
                      np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expect.shape != factors.shape or not np.allclose(expect, factors, rtol=1e-4):
        raise ValueError("the GGUF file's rope_freqs are not llama3 RoPE scaling; kvloop "
                         "cannot convert them")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig}


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: not a model weight)."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{kind}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its ``convert_hf_to_gguf.py`` interleaves the two
    rotary halves of every head, ``(h, 2, d/2) -> (h, d/2, 2)``, for its RoPE kernel)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write_weights(reader: Any, config: dict[str, Any], out: Path) -> None:
    """Dequantise every tensor to float32 and write (sharded) safetensors plus an index."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    permuted = _ARCHS[_field(reader, "general.architecture")][2]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        save_file(pending, str(out / f"shard-{len(shards)}.safetensors"), {"format": "pt"})
        shards.append(list(pending))
        pending, size = {}, 0

    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name in _IGNORED_TENSORS:
                continue
            raise ValueError(f"unexpected tensor {tensor.name!r} in the GGUF file")
        shape = tuple(int(n) for n in reversed(tensor.shape))
        w = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        kind = tensor.name.split(".")[-2]
        if permuted and kind in heads:
            w = unpermute_qk(w, heads[kind])
        pending[name] = np.ascontiguousarray(w)
        size += w.nbytes
        total += w.nbytes
        if size >= SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    if len(shards) == 1:
        os.replace(out / "shard-0.safetensors", out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f"shard-{i}.safetensors", out / file)
        weight_map.update(dict.fromkeys(names, file))
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_tokenizer(gguf_path: Path, reader: Any, config: dict[str, Any], out: Path) -> None:
    """tokenizer.json via transformers' GGUF tokenizer reader; tokenizer_config.json by hand."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Not AutoTokenizer: it would first parse the whole file again for a config (seconds).
    tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  local_files_only=True)
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    for flag in ("add_bos_token", "add_eos_token"):  # transformers knows llama.cpp's defaults
        value = getattr(tok, flag, None)
        tokenizer_config[flag] = bool(_field(reader, f"tokenizer.ggml.{flag}", False)
                                      if value is None else value)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if (value := getattr(tok, name, None)) is not None:
            tokenizer_config[name] = str(value)
    if (template := _field(reader, "tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
