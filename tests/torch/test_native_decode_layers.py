"""``native.DecodeLayers`` (``decode_layers.cpp``): a decode step's layers in one call give
the logits of the Python loop over the same kernels to the bit (bfloat16, float32 and int4
layer matrices, with and without q/k/v bias), only steps of decodes read in place take it,
float32 through it keeps transformers' greedy tokens, and bad construction or call arguments
are refused with a RuntimeError."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from native_helpers import BF16, KERNELS, OPS, LogitRecorder  # noqa: E402

from conftest import (  # noqa: E402
    assert_matches,
    build_tiny,
    drive,
    llama_config,
    make_runner,
    prompts_of,
    qwen2_config,
)
from kvloop.executor.torch import native  # noqa: E402

# NOTE: head size 32 and sizes in 16s and 32s: the shapes every kernel of the stack tiles.
SHAPE = {"hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 4,
         "num_key_value_heads": 2}


class Counting:
    """A ``DecodeLayers`` that counts its calls and the tokens of each."""

    def __init__(self, stack: object) -> None:
        self.stack, self.tokens = stack, []

    def run(self, ids: torch.Tensor, *args: object) -> torch.Tensor:
        self.tokens.append(ids.shape[0])
        return self.stack.run(ids, *args)  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    config = llama_config if request.param == "llama" else qwen2_config
    return build_tiny(tmp_path_factory.mktemp(request.param), config(**SHAPE))


@pytest.mark.parametrize("dtype, quantization",
                         [("bfloat16", None), ("bfloat16", "int4"), ("float32", None)])
def test_one_call_gives_the_python_loops_logits(shaped: object, dtype: str,
                                                quantization: str | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: float32 matrices are oneDNN's on the full build (``f32_preferred``): kvloop's
    # kernel is asked for, so that its one call is tested on every build.
    monkeypatch.setattr(native, "f32_preferred", lambda: True)
    runner = make_runner(shaped, dtype=dtype, quantization=quantization, block_size=16)
    model = runner.model
    if dtype == "bfloat16" and quantization is None and not native.bf16_supported():
        assert model.decode_layers is None, "bfloat16 matrices stay oneDNN's without it"
        pytest.skip("no bf16_linear here: no DecodeLayers for bfloat16 matrices")
    # NOTE: a matrix changed in place after the weights moved (onto huge pages, where the OS
    # offers them) after the model built its DecodeLayers: the one call must read the
    # weights where they are now (the move builds it again), with their new values. The
    # move is adopted first: while a forward adopts it, DecodeLayers is briefly None.
    model.adopt_moved_weights(wait=True)
    assert model.decode_layers is not None
    weights = model.layers[-1].gate_up.native_operands[1][0]
    weights.copy_(weights.flip(0))
    prompts = [[1, 5, 9, 44, 3], [1, 7, 7, 300, 12, 8, 90, 4, 33, 61], [1, 2, 3]]
    counting, one_call, loop = _one_call_then_python_loop(runner, prompts, 8, monkeypatch,
                                                          arrive_at=[0, 0, 3])
    # Able to fail: the steps whose tokens were all decodes went through the one call, and
    # the steps with a prefill (first, and the third request's arrival) did not.
    assert counting.tokens and set(counting.tokens) <= {1, 2, 3}, counting.tokens
    assert one_call.keys() == loop.keys()
    for key, row in one_call.items():
        assert torch.equal(row, loop[key]), key


def _one_call_then_python_loop(runner: object, prompts: list[list[int]], steps: int,
                               monkeypatch: pytest.MonkeyPatch, **drive_args: object
                               ) -> tuple[Counting, dict, dict]:
    """``prompts`` driven ``steps`` steps through the model's one call (counted), then again
    through the Python loop forced to the same tokens: the counter and each run's logits."""
    model = runner.model  # type: ignore[attr-defined]
    model.adopt_moved_weights(wait=True)  # NOTE: no move replaces the counter midway
    counting = Counting(model.decode_layers)
    model.decode_layers = counting
    recorder = LogitRecorder(runner, monkeypatch)
    reqs, _ = drive(runner, prompts, steps, **drive_args)
    one_call = recorder.force(reqs)
    model.decode_layers = None
    drive(runner, prompts, steps, **drive_args)
    return counting, one_call, recorder.logits


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_its_team_of_threads_gives_the_same_bits(shaped: object, threads: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The one call's kernels share out their work through a team (``team.h``) kept for the
    call, which gives the Python loop's bits; no team at one thread, nor where the threads
    outnumber the CPUs this process may use (spinning threads would hold the CPUs)."""
    usable = len(os.sched_getaffinity(0))
    expected = threads if 1 < threads <= usable else 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = make_runner(shaped, dtype="bfloat16", quantization="int4", block_size=16)
        prompts = [[1, 5, 9, 44, 3], [1, 7, 7, 300, 12, 8, 90, 4, 33, 61]]
        counting, one_call, loop = _one_call_then_python_loop(runner, prompts, 6, monkeypatch)
        assert counting.tokens and one_call.keys() == loop.keys()
        assert counting.stack.threads == expected  # type: ignore[attr-defined]
        for key, row in one_call.items():
            assert torch.equal(row, loop[key]), key
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("f32_kernel", [True, False], ids=["f32_linear", "onednn"])
def test_float32_through_the_stack_keeps_transformers_greedy_tokens(
        shaped: object, f32_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 (the greedy-parity dtype) through kvloop's fused ops, with its kernel and
    ``DecodeLayers`` (AVX2) or oneDNN's products (where ``f32_linear`` is not preferred),
    sums in another order than torch: the greedy tokens stay transformers'."""
    monkeypatch.setattr(native, "f32_preferred", lambda: f32_kernel)
    runner = make_runner(shaped, dtype="float32", block_size=16)
    runner.model.adopt_moved_weights(wait=True)  # NOTE: no move replaces the counter midway
    assert runner.model.layer_ops.fused
    assert (runner.model.decode_layers is not None) is f32_kernel
    counting = Counting(runner.model.decode_layers) if f32_kernel else None
    if counting is not None:
        runner.model.decode_layers = counting
    reqs, _ = drive(runner, prompts_of([5, 17, 3, 40], shaped.vocab_size, seed=9), 12,
                    arrive_at=[0, 0, 2, 4])
    assert counting is None or counting.tokens, "no decode step went through DecodeLayers"
    assert_matches(shaped, reqs, 12)


def _stack_args(layers: int = 1, *, random: bool = False,
                **change: object) -> dict[str, object]:
    """A one-KV-head int4 stack: zero weights, or (``random``) codes 0..15 at a scale of
    1/64 and an offset of -8/64 (exact in float16), so every layer changes x and the cache."""
    hidden, inter, heads, kv, d = 64, 64, 2, 1, 32
    qkv = (heads + 2 * kv) * d
    gen = torch.Generator().manual_seed(3)

    def mat(n: int, k: int) -> list[torch.Tensor]:
        codes = (torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen) if random
                 else torch.zeros(n, k, dtype=torch.int32))
        scale, offset = (1 / 64, -8 / 64) if random else (1.0, 0.0)
        return list(native.pack_q4(codes, torch.full((n, k // 32), scale),
                                   torch.full((n, k // 32), offset)))

    per = [(qkv, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    args: dict[str, object] = {
        "norms": [torch.ones(hidden, dtype=BF16)] * (2 * layers),
        "kinds": [KERNELS.DecodeLayers.Q4] * (4 * layers),
        "weights": [mat(n, k) for n, k in per] * layers,
        "biases": [None] * (4 * layers),
        "num_heads": heads, "num_kv_heads": kv, "head_dim": d, "intermediate": inter,
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"kinds": [7] * 4}, "kind 7"),
    ({"kinds": [0] * 4}, "has kind 0 and 3 tensors"),
    ({"norms": [torch.ones(64, dtype=BF16)]}, "2 norms and 4 matrices"),
    ({"weights": [[w[0][:3], *w[1:]] for w in _stack_args()["weights"]]}, "matrix sizes"),
    ({"intermediate": 96}, "matrix sizes"),
    ({"norms": [], "kinds": [], "weights": [], "biases": []}, "2 norms"),
    ({"weights": [[w[0], w[1].float(), w[2]] for w in _stack_args()["weights"]]},
     "matrix 0's weights"),
    ({"weights": [[w[0][:, :1], *w[1:]] for w in _stack_args()["weights"]]},
     "matrix 0's weights"),
    ({"biases": [torch.zeros(96, dtype=BF16), None, None, None]}, "matrix 0's bias"),
])
def test_decode_layers_refuses_bad_construction(change: dict[str, object], message: str) -> None:
    KERNELS.DecodeLayers(**_stack_args())  # the unchanged arguments build
    with pytest.raises(RuntimeError, match=message):
        KERNELS.DecodeLayers(**_stack_args(**change))


def test_decode_layers_refuses_a_layer_wider_than_x() -> None:
    """Every layer's O and down write x's width: a wider one (here the second layer's) would
    write past x, so it is refused when built."""
    args = _stack_args(layers=2)
    wide = list(native.pack_q4(torch.zeros(128, 64, dtype=torch.int32), torch.ones(128, 2),
                               torch.zeros(128, 2)))
    args["weights"] = [*args["weights"][:5], wide, args["weights"][6], wide]
    with pytest.raises(RuntimeError, match="layer 1's matrix sizes"):
        KERNELS.DecodeLayers(**args)


def test_decode_layers_refuses_x_of_another_float_type_than_its_matrices() -> None:
    """float32 matrices multiply float32 activations only (4-bit ones either)."""
    shapes = [(128, 64), (64, 64), (128, 64), (64, 64)]
    stack = KERNELS.DecodeLayers(
        norms=[torch.ones(64)] * 2, kinds=[KERNELS.DecodeLayers.F32] * 4,
        weights=[[native.pack_f32(torch.zeros(n, k))] for n, k in shapes], biases=[None] * 4,
        num_heads=2, num_kv_heads=1, head_dim=32, intermediate=64)
    cache = torch.zeros(2, 4, 16, 1, 32)
    args = {"ids": torch.tensor([5]), "cos_table": torch.ones(8, 32),
            "sin_table": torch.zeros(8, 32), "positions": torch.tensor([3]), "caches": [cache],
            "slots": torch.tensor([3]), "block_table": torch.tensor([[0]]),
            "context_lens": torch.tensor([4]), "eps": 1e-5, "scale": 32 ** -0.5}
    stack.run(embed=torch.randn(10, 64), **args)  # float32 x runs
    with pytest.raises(RuntimeError, match="for float32 matrices"):
        stack.run(embed=torch.randn(10, 64).to(BF16),
                  **{**args, "cos_table": torch.ones(8, 32, dtype=BF16),
                     "sin_table": torch.zeros(8, 32, dtype=BF16)})


def test_decode_layers_refuses_bad_calls() -> None:
    stack = KERNELS.DecodeLayers(**_stack_args(random=True))
    cache = torch.zeros(2, 4, 16, 1, 32, dtype=BF16)
    args = {"ids": torch.tensor([5]), "embed": torch.randn(10, 64).to(BF16),
            "cos_table": torch.ones(8, 32, dtype=BF16),
            "sin_table": torch.zeros(8, 32, dtype=BF16), "positions": torch.tensor([3]),
            "caches": [cache], "slots": torch.tensor([3]), "block_table": torch.tensor([[0]]),
            "context_lens": torch.tensor([4]), "eps": 1e-5, "scale": 32 ** -0.5}
    x = stack.run(**args)  # a right call runs
    assert x.shape == (1, 64) and x.dtype == BF16
    # NOTE: random rows, so that a refused call that left anything behind changes x or the
    # cache of the next call.
    cache.zero_()
    torch.manual_seed(0)
    args["embed"] = torch.randn(10, 64).to(BF16)
    args["cos_table"] = torch.randn(8, 32).to(BF16)
    args["sin_table"] = torch.randn(8, 32).to(BF16)
    x = stack.run(**args)
    written = cache.clone()
    assert written.any() and not torch.equal(x, args["embed"][5:6])  # NOTE: so both can tell
    cache.zero_()
    for change, message in [({"caches": [cache, cache]}, "one cache per layer"),
                            ({"embed": torch.randn(10, 32).to(BF16)}, "embed"),
                            ({"embed": torch.randn(10, 64).half()}, "cos_table .* table of Half"),
                            ({"ids": torch.tensor([10])}, "token id 10 is outside"),
                            ({"ids": torch.tensor([-1])}, "token id -1 is outside"),
                            ({"ids": torch.tensor([5], dtype=torch.int32)}, "ids"),
                            ({"positions": torch.tensor([8])}, "position 8 is outside"),
                            ({"positions": torch.tensor([3, 4])}, "1 ids and 2 positions"),
                            ({"sin_table": torch.zeros(7, 32, dtype=BF16)}, "RoPE tables"),
                            ({"cos_table": torch.ones(8, 16, dtype=BF16)}, "cos_table"),
                            ({"context_lens": torch.tensor([40])}, "decode_attention"),
                            ({"block_table": torch.tensor([[9]])}, "out of range")]:
        with pytest.raises(RuntimeError, match=message):
            stack.run(**{**args, **change})
        if "ids" in change or "positions" in change:
            assert not cache.any()  # NOTE: refused before a byte of the cache is written
        cache.zero_()
        assert torch.equal(stack.run(**args), x)  # NOTE: no thread left behind either
        assert torch.equal(cache, written)
        cache.zero_()
    # NOTE: no team left behind by the refusals: a kernel called alone on 64 rows (4 grains of
    # 16) forks and joins, giving what it gives row by row (one thread each).
    rows, weight = torch.randn(64, 64).to(BF16), torch.rand(64).to(BF16)
    out, by_row = torch.empty_like(rows), torch.empty_like(rows)
    OPS.rms_norm(rows, weight, 1e-5, out)
    for r in range(64):
        OPS.rms_norm(rows[r:r + 1], weight, 1e-5, by_row[r:r + 1])
    assert torch.equal(out, by_row)
