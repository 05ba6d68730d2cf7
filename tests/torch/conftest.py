"""Tiny random-weight transformers models saved to disk, and greedy references for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # a wide init keeps greedy decoding free of near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass
class TinyModel:
    """A saved tiny model and its transformers twin (float32, CPU) for references."""

    path: Path
    hf: object
    _cache: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size  # type: ignore[attr-defined]

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """transformers ``generate(do_sample=False)`` continuation, EOS not stopping it."""
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            with torch.inference_mode():
                out = self.hf.generate(  # type: ignore[attr-defined]
                    torch.tensor([prompt]),
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    pad_token_id=0,
                )
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]

    def logits(self, prompt: list[int], max_tokens: int) -> torch.Tensor:
        """Raw float32 logits [max_tokens, vocab] of the greedy continuation's steps."""
        with torch.inference_mode():
            out = self.hf.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return torch.cat(out.logits).float()


def build_tiny(root: Path, config: object, seed: int = 0, **save: object) -> TinyModel:
    """Instantiate ``config``'s model with a fixed seed and save it under ``root``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # init leaves norms at 1 and biases at 0: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    model.save_pretrained(root, **save)
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    return TinyModel(root, model)


def llama_config(**overrides: object) -> object:
    return transformers.LlamaConfig(**{**_COMMON, **overrides})


def qwen2_config(**overrides: object) -> object:
    return transformers.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, **overrides})


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("llama"), llama_config())


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("qwen2"), qwen2_config(), seed=1)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(f"{request.param}_model")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param
