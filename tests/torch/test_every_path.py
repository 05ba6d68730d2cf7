"""Every architecture through every path of the one layer description: torch's ops and
gathered attention, kvloop's fused layer ops with its attention kernels, and (where the
layers are plain dense ones) the one-call decode step, each giving transformers' greedy tokens
in float32 on tiny random models."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    _COMMON,
    TinyModel,
    assert_matches,
    build_tiny,
    drive,
    make_runner,
    prompts_of,
)
from kvloop.executor.torch import native  # noqa: E402
from kvloop.executor.torch.layer_ops import NATIVE_OPS, TORCH_OPS  # noqa: E402

# NOTE: head_dim 32 and widths in multiples of 16: shapes kvloop's kernels take, so that
# every path below runs each architecture.
_SHAPE = {**_COMMON, "hidden_size": 128, "intermediate_size": 96}
_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**{**_SHAPE, "tie_word_embeddings": True}),
    "mistral": lambda: transformers.MistralConfig(**{**_SHAPE, "sliding_window": None}),
    "qwen3": lambda: transformers.Qwen3Config(**{**_SHAPE, "head_dim": 32}),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**_SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**{
        **_SHAPE, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False}),
}
PATHS = ["torch", "native-ops", "one-call"]
"""torch: torch's layer ops, gathered attention, oneDNN's products; native-ops: kvloop's
layer ops, attention and float32 products, each step through the Python layer; one-call:
the same, decode steps as ``native.DecodeLayers``."""
native_only = pytest.mark.skipif(native.kernels() is None,
                                 reason="kvloop's CPU kernels do not run here")


@pytest.fixture(scope="module", params=list(_CONFIGS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> TinyModel:
    return build_tiny(tmp_path_factory.mktemp(request.param), _CONFIGS[request.param](),
                      seed=5)


@pytest.mark.parametrize("path", [
    "torch", pytest.param("native-ops", marks=native_only),
    pytest.param("one-call", marks=native_only)])
def test_every_path_gives_transformers_greedy_tokens(
        arch: TinyModel, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "f32_preferred", lambda: path != "torch")
    runner = make_runner(arch, max_num_batched_tokens=24, block_size=16)
    model = runner.model
    model.adopt_moved_weights(wait=True)
    plain = all(layer.q_norm is None and layer.moe is None for layer in model.layers)
    if path == "torch":
        model.layer_ops, model.decode_layers = TORCH_OPS, None
        runner.native_attention = False
    else:
        assert model.layer_ops is NATIVE_OPS and runner.native_attention
        assert (model.decode_layers is not None) == plain, "the one call runs plain layers"
        if path == "native-ops":
            model.decode_layers = None
        elif not plain:
            pytest.skip("the one-call decode step runs dense layers without q/k norms")
    calls = []
    if model.decode_layers is not None:
        real = model.decode_layers

        class Counting:
            def run(self, *args: object) -> torch.Tensor:
                calls.append(1)
                return real.run(*args)

        model.decode_layers = Counting()
    prompts = prompts_of([5, 30, 11, 3], arch.vocab_size, seed=4)
    reqs, _ = drive(runner, prompts, 10, arrive_at=[0, 0, 2, 5])  # chunks beside decodes
    assert_matches(arch, reqs, 10)
    assert bool(calls) == (path == "one-call")
