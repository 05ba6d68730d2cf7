"""Tiny random-weight transformers models saved to disk, greedy references for them, and
a Scheduler + TorchModelRunner loop to compare against."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core import Request, Scheduler
from kvloop.sampling_params import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvloop.executor.torch import TorchModelRunner  # noqa: E402

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


def qwen3_config(**overrides: object) -> object:
    """Qwen3: per-head query and key norms; a head_dim that is not hidden / heads."""
    return transformers.Qwen3Config(**{**_COMMON, "head_dim": 32, "tie_word_embeddings": True,
                                       **overrides})


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("llama"), llama_config())


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("qwen2"), qwen2_config(), seed=1)


def mixtral_config(**overrides: object) -> object:
    """Mixtral: every layer a mixture of 4 experts, 2 per token."""
    return transformers.MixtralConfig(**{**_COMMON, "num_local_experts": 4,
                                         "num_experts_per_tok": 2, **overrides})


def qwen3_moe_config(**overrides: object) -> object:
    """Qwen3-MoE: query/key norms; a dense second layer, experts of their own width,
    top-k probabilities not renormalised."""
    return transformers.Qwen3MoeConfig(**{
        **_COMMON, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False,
        **overrides})


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp("qwen3"), qwen3_config(), seed=2)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(f"{request.param}_model")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def make_runner(
    model: TinyModel,
    device: str = "cpu",
    *,
    num_gpu_blocks: int | None = 64,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    dtype: str = "float32",
    **kwargs: object,
) -> TorchModelRunner:
    return TorchModelRunner(
        str(model.path),
        dtype=dtype,
        device=device,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        **kwargs,  # type: ignore[arg-type]
    )


def drive(
    runner: TorchModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    arrive_at: list[int] | None = None,
    logprobs: int | None = None,
    max_model_len: int = 256,
    **sched: object,
) -> tuple[list[Request], Scheduler]:
    """Run the prompts through a Scheduler + runner loop (request i joins at step
    ``arrive_at[i]``); invariants checked every step."""
    sched.setdefault("max_num_batched_tokens", runner.max_num_batched_tokens)
    sched.setdefault("max_num_seqs", runner.max_num_seqs)
    s = Scheduler(
        SchedulerConfig(max_model_len=max_model_len, **sched),  # type: ignore[arg-type]
        CacheConfig(
            block_size=runner.block_size,
            num_gpu_blocks=runner.num_gpu_blocks,
            num_cpu_blocks=runner.num_cpu_blocks,
        ),
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    arrive_at = arrive_at or [0] * len(reqs)
    step = 0
    while step <= max(arrive_at) or s.has_unfinished_requests():
        for r, at in zip(reqs, arrive_at, strict=True):
            if at == step:
                s.add_request(r)
        out = s.schedule()
        result = runner.execute(out)
        assert result.step_time_s > 0
        s.update_from_output(out, result)
        s.check_invariants()
        step += 1
        assert step < 2000, "did not drain"
    assert s.kv.num_used_blocks == 0 and not s.kv.swapped_blocks
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return reqs, s


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches(model: TinyModel, reqs: list[Request], max_tokens: int) -> None:
    for r in reqs:
        expected = model.greedy(list(r.prompt_token_ids), max_tokens)
        assert r.output_token_ids == expected, r.request_id
