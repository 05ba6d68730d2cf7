"""Layer-matrix layouts (``executor.torch.linear``): the packed oneDNN layout computes what the
dense one does, int4 finds a Q4_1 grid again, bad quantization settings are refused by name,
and ``dtype="auto"`` follows the CPU's native bfloat16."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import drive, make_runner  # noqa: E402
from kvloop.executor.torch import loader, native  # noqa: E402
from kvloop.executor.torch.linear import (  # noqa: E402
    Bf16Linear,
    DenseLinear,
    F32Linear,
    Int4Linear,
    PackedLinear,
    check_quantization,
    make_linear,
)


def q4_1_grid(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """A float32 [out, inp] matrix every group of 32 of which lies on a Q4_1 grid
    (``low + code * step``, codes 0 and 15 both used), as a dequantised Q4_1 GGUF does;
    groups are roughly centred on 0, as trained weights are."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    step = torch.rand(out, inp // 32, 1, generator=g) * 0.01 + 0.001
    low = -step * (7.5 + torch.randn(out, inp // 32, 1, generator=g))
    return (low + codes * step).view(out, inp)


BF16_PACKS = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
"""oneDNN packs bfloat16 only with AVX-512 or AVX-NE-CONVERT."""


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_PACKS, reason="no bf16")),
])
def test_packed_layout_equals_dense(rows: int, with_bias: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 64, generator=g).to(dtype)
    dense, packed = DenseLinear(w, b), PackedLinear(w, b)
    torch.testing.assert_close(packed(x), dense(x))
    # A strided input (the gate half of a fused gate/up output) is read as it is.
    wide = torch.randn(rows, 128, generator=g).to(dtype)
    torch.testing.assert_close(packed(wide[:, :64]), dense(wide[:, :64].contiguous()))
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    tol = 1e-5 if dtype == torch.float32 else 0.1  # bfloat16: a few steps of 1/128
    torch.testing.assert_close(packed(x).double(), ref, atol=tol, rtol=tol)
    for lin in (dense, packed):  # the residual add: one rounding more or less in bfloat16
        acc = torch.ones(rows, 96, dtype=dtype)
        lin.add_to_(acc, x)
        torch.testing.assert_close(acc.double(), ref + 1, atol=tol, rtol=tol)


def test_make_linear_picks_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(64, 32)
    assert isinstance(make_linear(w, None), F32Linear if native.f32_preferred() else PackedLinear)
    bf16 = Bf16Linear if native.bf16_supported() else PackedLinear if BF16_PACKS else DenseLinear
    assert isinstance(make_linear(w.bfloat16(), None), bf16)
    assert isinstance(make_linear(w.half(), None), DenseLinear)
    assert isinstance(make_linear(w, None, quantization="int4"), Int4Linear)
    # Without kvloop's kernels (tested in test_native_float_linear), oneDNN's packed layout.
    monkeypatch.setattr(native, "bf16_supported", lambda: False)
    monkeypatch.setattr(native, "kernels", lambda: None)
    assert isinstance(make_linear(w.bfloat16(), None), PackedLinear if BF16_PACKS else DenseLinear)
    # A CPU whose oneDNN does not run bfloat16 (AVX2): dense, and still float32 packed.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert isinstance(make_linear(w.bfloat16(), None), DenseLinear)
    assert isinstance(make_linear(w, None), PackedLinear)
    # A oneDNN build that refuses to pack: dense, computing the same product.
    def refuse(*args: object) -> None:
        raise RuntimeError("mkldnn_reorder_linear_weight: not supported here")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    lin = make_linear(w, None)
    assert isinstance(lin, DenseLinear)
    x = torch.randn(3, 32)
    torch.testing.assert_close(lin(x), x @ w.t())
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert isinstance(make_linear(w, None), DenseLinear)


def test_int4_recovers_a_q4_1_grid() -> None:
    w = q4_1_grid(48, 128)
    b = torch.randn(48)
    eye = torch.eye(128, dtype=torch.bfloat16)
    dequantised = Int4Linear(w, None, torch.bfloat16)(eye).float().t()
    step = (w.view(48, -1, 32).amax(-1) - w.view(48, -1, 32).amin(-1)) / 15
    err = (dequantised - w).abs().view(48, -1, 32).amax(-1)
    # NOTE: only the bfloat16 rounding of the kernel's scales, zeros and outputs remains: far
    # below half a step (what re-quantising onto another grid would cost).
    assert bool((err <= 0.1 * step).all()), float((err / step).max())
    lin = Int4Linear(w, b.bfloat16(), torch.bfloat16)
    x = torch.randn(3, 128).bfloat16()
    acc = torch.zeros(3, 48, dtype=torch.bfloat16)
    lin.add_to_(acc, x)
    torch.testing.assert_close(acc.float(), (x.float() @ w.t() + b), atol=0.1, rtol=0.02)


def test_int4_holds_a_q4_1_files_float16_scales_exactly() -> None:
    """A Q4_1 file's blocks hold float16 scales and mins; dequantised in float32 (as a GGUF
    reader does) and quantised again, the kernel holds those very float16 values."""
    if not native.kernels():
        pytest.skip("kvloop's kernels did not build here")
    n, k = 32, 128
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half()
    m = (-d.float() * (7.5 + torch.randn(n, k // 32, 1, generator=g))).half()
    w = (d.float() * codes + m.float()).view(n, k)
    lin = Int4Linear(w, None, torch.bfloat16)
    assert lin.scales.dtype == lin.lows.dtype == torch.float16
    per_group = lin.scales.transpose(1, 2).reshape(n, k // 32)
    assert torch.equal(per_group, d.view(n, k // 32))
    assert torch.equal(lin.lows.transpose(1, 2).reshape(n, k // 32), m.view(n, k // 32))


def test_int4_refuses_weights_beyond_float16() -> None:
    w = torch.randn(16, 64) * 0.02
    w[3, 40] = 1e5  # NOTE: its group's scale, (1e5 - low) / 15, fits; its offset does not
    w[3, 41] = -7e4
    with pytest.raises(ValueError, match=r"offset as float16 .*: a weight group's offset is 70000"):
        Int4Linear(w, None, torch.bfloat16)
    w[3, 41] = float("nan")
    with pytest.raises(ValueError, match="a weight group's offset is nan"):
        Int4Linear(w, None, torch.bfloat16)
    with pytest.raises(ValueError, match="pack_q4: scale must hold float16 values"):
        native.pack_q4(torch.zeros(16, 32, dtype=torch.int32), torch.full((16, 1), 0.1),
                       torch.zeros(16, 1))


@pytest.mark.parametrize("quantization, device, dtype, field", [
    ("int8", "cpu", torch.bfloat16, "quantization must be one of int4"),
    ("int4", "cpu", torch.float32, "quantization int4 needs dtype bfloat16"),
    ("int4", "cuda", torch.bfloat16, "quantization int4 runs on CPU only"),
])
def test_bad_quantization_is_refused(quantization: str, device: str, dtype: torch.dtype,
                                     field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_quantization(quantization, torch.device(device), dtype)


def test_int4_needs_inputs_in_whole_groups() -> None:
    with pytest.raises(ValueError, match="quantization int4 needs input sizes divisible by 32"):
        Int4Linear(torch.randn(8, 48), None, torch.bfloat16)


def test_auto_dtype_follows_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    assert loader.resolve_dtype("float32", cpu) == torch.float32


def test_int4_runner_matches_bf16_on_a_q4_1_model(llama_model, tmp_path) -> None:
    """A model whose matrices lie on Q4_1 grids: the int4 runner's greedy tokens equal the
    bfloat16 runner's, and its weights take under a third of the bytes."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "q4"
    folder.mkdir()
    for f in llama_model.path.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            for i, (name, t) in enumerate(sorted(tensors.items())):
                if name.endswith("_proj.weight"):
                    grid = q4_1_grid(*t.shape, seed=i)
                    tensors[name] = (grid - grid.mean()) * (t.std() / grid.std())
                    tensors[name] = _snap(tensors[name])
            save_file(tensors, folder / f.name)
        elif f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    model = type(llama_model)(folder, llama_model.hf)
    prompts = [[5, 9, 13, 40, 41, 42, 43], [7, 8, 300, 301]]

    def run(**kw: object) -> tuple[list[list[int]], int]:
        runner = make_runner(model, dtype="bfloat16", **kw)
        reqs, _ = drive(runner, prompts, 6)
        assert runner.precision == ("bfloat16, int4 weights" if kw else "bfloat16")
        return [list(r.output_token_ids) for r in reqs], runner.model.num_parameter_bytes

    dense, dense_bytes = run()
    quant, quant_bytes = run(quantization="int4")
    assert quant == dense
    matrices = sum(p.numel() for n, p in llama_model.hf.named_parameters() if "_proj" in n)
    assert dense_bytes - quant_bytes > 0.6 * matrices * 2  # bf16 -> ~4.5 bits


def _snap(w: torch.Tensor) -> torch.Tensor:
    """Re-grid a scaled grid exactly (scaling moves points off float32 steps only slightly,
    but min/max must stay the codes 0 and 15 of every group)."""
    groups = w.view(w.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (low + ((groups - low) / step).round() * step).view(w.shape)


def test_auto_dtype_with_int4_is_bfloat16_and_says_why(llama_model,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2"}))  # no native bf16
    runner = make_runner(llama_model, dtype="auto", quantization="int4")
    assert runner.dtype == torch.bfloat16 and runner.dtype_note == "auto: for int4"
    plain = make_runner(llama_model, dtype="auto", quantization="none")
    assert plain.quantization is None and plain.dtype == torch.float32
    assert plain.dtype_note == "auto: no native bfloat16 on this CPU"
    assert make_runner(llama_model, dtype="float32").dtype_note == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_without_cuda_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device cuda: this torch build has no CUDA"):
        loader.resolve_device("cuda")


@pytest.mark.skipif(native.kernels() is None, reason="kvloop's CPU kernels do not run here")
def test_the_load_line_names_whose_kernels_run(llama_model) -> None:
    """``kernels_note`` (the "loaded in" line) names each of kvloop's kernels a model runs."""
    f32 = make_runner(llama_model, dtype="float32")
    note = f32.kernels_note
    assert note.startswith("kvloop's CPU kernels: ") and "decode_attention" in note
    assert ("f32_linear" in note) == native.f32_preferred()
    assert "prefill_attention" in note
    assert ("rms_norm" in note) == f32.model.layer_ops.fused
    assert ("DecodeLayers" in note) == (f32.model.decode_layers is not None)
    bf16 = make_runner(llama_model, dtype="bfloat16")
    note = bf16.kernels_note
    assert note.startswith("kvloop's CPU kernels: ") and "decode_attention" in note
    assert ("rms_norm" in note) == bf16.model.layer_ops.fused
    assert ("bf16_linear" in note) == native.bf16_supported()
    assert ("bf16_linear with AMX from" in note) == (
        native.bf16_supported() and "bf16_linear" in native.amx_rows())
    assert ("DecodeLayers" in note) == (bf16.model.decode_layers is not None)
    int4 = make_runner(llama_model, dtype="bfloat16", quantization="int4").kernels_note
    assert "q4_linear" in int4, int4
    assert ("q4_linear with AMX from" in int4) == ("q4_linear" in native.amx_rows())


def test_the_load_line_says_when_torch_kernels_run(llama_model,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOP_NATIVE", "0")
    monkeypatch.setattr(native, "kernels", lambda: None)
    runner = make_runner(llama_model, dtype="bfloat16")
    assert runner.kernels_note == "torch's kernels (kvloop's are off: KVLOOP_NATIVE=0)"
