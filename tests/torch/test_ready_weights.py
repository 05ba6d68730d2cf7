"""Ready-to-run weights (``executor.torch.ready_weights``): saved after the first
conversion, read back at the next start with the same tensors and the same outputs; not
written where a layout cannot be; an unreadable file is converted again and replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import native, ready_weights  # noqa: E402
from kvloop.executor.torch.loader import load_model  # noqa: E402

CPU = torch.device("cpu")


def _load(path: Path, dtype: torch.dtype, quantization: str | None = None):
    _, model = load_model(path, dtype=dtype, device=CPU, quantization=quantization)
    model.adopt_moved_weights(wait=True)
    return model


def _saved(path: Path, dtype: torch.dtype, quantization: str | None = None) -> Path:
    """The ready file of the model, once the background save is done."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "kvloop-save-ready-weights":
            thread.join(60)
    return ready_weights.ready_path(path, dtype, quantization)


def _tensors(model) -> list[tuple[str, torch.Tensor]]:
    state = ready_weights._state(model)
    assert state is not None
    return sorted(state[0].items())


@pytest.mark.parametrize("dtype, quantization", [
    (torch.bfloat16, None), (torch.bfloat16, "int4"), (torch.float32, None)])
def test_the_second_start_reads_what_the_first_converted(
        llama_model, dtype: torch.dtype, quantization: str | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if native.kernels() is None:
        pytest.skip("kvloop's CPU kernels do not run here: their layouts are not saved")
    # NOTE: float32 matrices are oneDNN's (not saved) where it is faster than kvloop's kernel.
    monkeypatch.setattr(native, "f32_preferred", lambda: True)
    first = _load(llama_model.path, dtype, quantization)
    assert not first.loaded_ready
    assert _saved(llama_model.path, dtype, quantization).exists()
    second = _load(llama_model.path, dtype, quantization)
    assert second.loaded_ready
    a, b = _tensors(first), _tensors(second)
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert [type(m) for m in (first.lm_head, first.layers[0].qkv)] == [
        type(m) for m in (second.lm_head, second.layers[0].qkv)]
    x = first.embed[torch.tensor([1, 5, 9, 13])]
    for m in ("qkv", "o", "gate_up", "down"):
        lin_a, lin_b = getattr(first.layers[-1], m), getattr(second.layers[-1], m)
        xm = x if m != "down" else x.new_ones(4, lin_a.in_features)
        xm = xm[:, :lin_a.in_features].contiguous()
        assert torch.equal(lin_a(xm), lin_b(xm)), m
    assert torch.equal(first.lm_head(x), second.lm_head(x))


def test_opaque_layouts_are_not_written(llama_model, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    from kvloop.executor.torch import linear

    monkeypatch.setattr(ready_weights, "ready_dir", lambda: tmp_path)

    monkeypatch.setattr(native, "f32_preferred", lambda: False)
    monkeypatch.setattr(linear, "float_kernel_runs", lambda weight: False)
    model = _load(llama_model.path, torch.float32)
    if not isinstance(model.layers[0].qkv, linear.PackedLinear):
        pytest.skip("no oneDNN packing on this build")
    assert not ready_weights.cacheable(model)
    assert not _saved(llama_model.path, torch.float32).exists()


def test_an_unreadable_file_is_converted_again_and_replaced(
        llama_model, caplog: pytest.LogCaptureFixture) -> None:
    if native.kernels() is None:
        pytest.skip("kvloop's CPU kernels do not run here: their layouts are not saved")
    _load(llama_model.path, torch.bfloat16, "int4")
    target = _saved(llama_model.path, torch.bfloat16, "int4")
    target.write_bytes(b"not a safetensors file")
    model = _load(llama_model.path, torch.bfloat16, "int4")
    assert not model.loaded_ready and "unreadable" in caplog.text
    assert _saved(llama_model.path, torch.bfloat16, "int4").stat().st_size > 1000
    assert _load(llama_model.path, torch.bfloat16, "int4").loaded_ready


def test_each_dtype_and_quantization_has_its_own_file(llama_model) -> None:
    paths = {ready_weights.ready_path(llama_model.path, d, q)
             for d, q in [(torch.bfloat16, None), (torch.bfloat16, "int4"),
                          (torch.float32, None)]}
    assert len(paths) == 3


def test_the_start_up_line_says_where_the_weights_came_from(llama_model, monkeypatch,
                                                             tmp_path: Path) -> None:
    from kvloop.engine.args import EngineArgs
    from kvloop.engine.llm_engine import LLMEngine, describe_startup

    if native.kernels() is None or not native.bf16_supported():
        pytest.skip("bfloat16 matrices are oneDNN's here: nothing is saved")
    monkeypatch.setattr(ready_weights, "ready_dir", lambda: tmp_path)
    args = EngineArgs(model=str(llama_model.path), dtype="bfloat16", device="cpu",
                      num_gpu_blocks=32, max_num_batched_tokens=64, swap_space=0.0,
                      skip_tokenizer_init=True)
    first, _ = describe_startup(LLMEngine.from_args(args))
    assert first.endswith("; weights converted, saved ready to run for later starts")
    _saved(llama_model.path, torch.bfloat16)
    again, _ = describe_startup(LLMEngine.from_args(args))
    assert again.endswith("; weights ready to run, from the cache")
