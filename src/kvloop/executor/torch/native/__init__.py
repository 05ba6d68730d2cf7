"""kvloop's own CPU kernels (C++, AVX-512 with VNNI, or AVX2), built on first use.

torch's CPU build has no kernel for what a small-batch decode step spends its time on
beyond the stock GEMMs (``docs/native-kernels.md``), so kvloop ships its own:

- ``q4_linear``: 4-bit weights (groups of 32, a float16 scale and offset each: llama.cpp's
  Q4_1) times activations quantised per group of 32 to int8 (llama.cpp's Q8_1), with
  ``vpdpbusd``; ``linear.Int4Linear`` uses it.
- ``q8_linear``: the same with 8-bit weights (llama.cpp's Q8_0), for the LM head under
  ``--quantization int4`` (``linear.Int8Linear``).
- ``bf16_linear``: bfloat16 weights times bfloat16 activations with ``vdpbf16ps`` (CPUs with
  AVX-512 BF16; shifts and FMA in the AVX2 build), for the decode-sized products of a
  bfloat16 model (``linear.Bf16Linear``).
- on CPUs with AMX-BF16, ``bf16_linear`` from 4 rows and ``q4_linear`` from 32 bfloat16
  rows multiply with AMX tiles (``amx_gemm.cpp``: the 4-bit weights widened to bfloat16
  first), for prompt chunks and wide batches (:func:`amx_rows`).
- ``f32_linear``: float32 weights times float32 activations (FMA), for the decode-sized
  products of a float32 model (``linear.F32Linear``).
- ``decode_attention``: one query token per sequence over its paged KV, reading the cache
  blocks in place through the block table (no gathered copy); ``attention.paged_attention``
  uses it for decode groups (bfloat16 and float32).
- ``prefill_attention``: prefill chunks (causal, after any cached prefix) over their paged
  KV, read in place the same way, a tile of query rows against each tile of keys with an
  online softmax; ``attention.paged_attention`` uses it for prefill groups.
- ``rms_norm``, ``rope_write_kv``, ``silu_mul``: a decoder layer's small ops fused, rounding
  where torch's ops round; ``layer_ops.NATIVE_OPS`` (bfloat16 and float32).
- ``argmax_rows``: each float32 logits row's argmax as a list (numpy's and torch's ties and
  NaNs), the sampler's pick where every row of a step is plain greedy.

The kernels a layer calls are torch operators (:data:`OPS`, ``torch.ops.kvloop.<name>``,
with fake implementations for ``torch.compile``); ``argmax_rows`` and ``DecodeLayers`` (a
decode step's layers in one call) are plain bindings of the module :func:`kernels` returns.

On CPUs with AVX2 but without AVX-512 VNNI, a second build (:data:`AVX2`) holds the same
kernels: the GEMMs of ``avx2_gemm.cpp`` (same layouts; the integer ones give the same bits)
and the float kernels over ``simd.h``'s AVX2 vector type.

The sources (``*.cpp`` beside this file) are compiled once per machine and source version
with ``torch.utils.cpp_extension`` (25–110 s on 2 cores) into
``$KVLOOP_CACHE_DIR/native/`` (``~/.cache/kvloop/native`` by default), and loaded from
there after. Where they cannot run — neither AVX-512 VNNI nor AVX2, no C++ compiler, a
failed build, an unwritable cache, or ``KVLOOP_NATIVE=0`` (for A/B measurements) —
:func:`kernels` returns None, logs why once, and kvloop uses torch's kernels: same results
up to rounding, slower. The kernels release the GIL while they run.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Build:
    """One build of the kernels: its module name, sources, compiler flags and the CPU
    features (``/proc/cpuinfo`` names) those flags need."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    required: frozenset[str]


FULL = Build("kvloop_native",
             ("module.cpp", "q4_linear.cpp", "q8_linear.cpp", "bf16_linear.cpp", "amx_gemm.cpp",
              "f32_linear.cpp",
              "decode_attention.cpp", "prefill_attention.cpp", "layer_ops.cpp",
              "decode_layers.cpp", "argmax.cpp"),
             ("-O3", "-fopenmp", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
              "-mavx512vnni"),
             frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}))
"""Every kernel, for AVX-512 with VNNI."""
AVX2 = Build("kvloop_native_avx2",
             ("module.cpp", "avx2_gemm.cpp", "amx_gemm.cpp", "f32_linear.cpp",
              "decode_attention.cpp",
              "prefill_attention.cpp", "layer_ops.cpp", "decode_layers.cpp", "argmax.cpp"),
             ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
             frozenset({"avx2", "fma", "f16c"}))
"""The same kernels for CPUs with AVX2 but not :data:`FULL`'s features: the GEMMs of
``avx2_gemm.cpp`` (4-bit, 8-bit and bfloat16, on the same layouts), the float kernels over
``simd.h``'s AVX2 ``V16``."""
BUILDS = (FULL, AVX2)
"""The builds :func:`kernels` may use, the first whose CPU features this machine has."""
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
"""Cache dtypes ``decode_attention`` and ``prefill_attention`` read."""


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def _env_choice() -> bool | None:
    """``KVLOOP_NATIVE`` read as on (True, also when unset), off (False) or neither (None)."""
    value = os.environ.get("KVLOOP_NATIVE", "1").strip().lower()
    return True if value in _ON else False if value in _OFF else None


def build_for_cpu() -> Build | None:
    """The first of :data:`BUILDS` whose CPU features this machine has (None: neither)."""
    return next((b for b in BUILDS if b.required <= cpu_flags()), None)


def unavailable_reason() -> str | None:
    """Why :func:`kernels` cannot build on this machine before trying (None: it may).

    NOTE: a ``KVLOOP_NATIVE`` value that is neither on nor off turns them off too, with a
    reason naming the accepted values, rather than being read as either silently."""
    choice, value = _env_choice(), os.environ.get("KVLOOP_NATIVE", "1")
    if choice is False:
        return f"KVLOOP_NATIVE={value}"
    if choice is None:
        return (f"KVLOOP_NATIVE={value!r} is not one of {'/'.join(_ON[1:])} (on) or "
                f"{'/'.join(_OFF)} (off)")
    if sys.platform != "linux":
        return f"platform {sys.platform}"
    if build_for_cpu() is None:
        lacks = " or ".join(", ".join(sorted(b.required - cpu_flags())) for b in BUILDS)
        return f"the CPU lacks {lacks}"
    return None


@cache
def kernels() -> ModuleType | None:
    """The compiled kernels (:func:`build_for_cpu`'s build), building them on the first call
    of a machine; None where they cannot run (module docstring), with the reason logged
    once."""
    reason = unavailable_reason()
    if reason is not None:
        level = logging.WARNING if _env_choice() is None else logging.INFO
        log.log(level, "kvloop's CPU kernels are off (%s): using torch's kernels", reason)
        return None
    try:
        module = _build_and_load(build_for_cpu() or FULL)
        for name in OPS:
            # NOTE: every operator writes only into its arguments (its schema's ``(a!)``):
            # its shape function has nothing to compute.
            torch.library.register_fake(f"kvloop::{name}")(_writes_only)
            _OVERLOADS[name] = getattr(torch.ops.kvloop, name).default
    except Exception as exc:  # NOTE: any failure (compiler, cache dir) falls back to torch's
        log.warning("kvloop's CPU kernels are off (%s): using torch's kernels", exc)
        return None
    return module


OPS = ("q4_linear", "q8_linear", "bf16_linear", "f32_linear", "decode_attention",
       "prefill_attention", "rms_norm", "rope_write_kv", "silu_mul")
"""The kernels that are torch operators, ``torch.ops.kvloop.<name>`` (``module.cpp``'s
``TORCH_LIBRARY``), once :func:`kernels` has loaded them."""


_OVERLOADS: dict[str, Callable[..., None]] = {}
"""Each operator of :data:`OPS` by name, looked up once (:func:`call`)."""


def _writes_only(*args: object, **kwargs: object) -> None:
    """The fake (shape) implementation of every operator of :data:`OPS`: none returns a
    tensor."""


def build_tag(build_spec: Build) -> str:
    """The name of ``build_spec``'s build directory: torch's and Python's versions, the
    variant, and a hash of the flags, the sources and the torch installation the build
    compiles against.

    NOTE: torch's build files name its installation's include paths, so two environments
    with the same torch (two virtual environments) would otherwise share a directory and
    recompile it, silently, each time the other one started."""
    here = Path(__file__).parent
    digest = hashlib.sha256(" ".join(build_spec.cflags).encode())
    digest.update(str(Path(torch.__file__).resolve().parent).encode())
    for name in sorted(p.name for p in here.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(name.encode() + (here / name).read_bytes())
    version = f"{sys.version_info[0]}{sys.version_info[1]}"
    variant = build_spec.name.removeprefix("kvloop_native").replace("_", "-")
    return (f"torch{torch.__version__.replace('+', '_')}-py{version}{variant}-"
            f"{digest.hexdigest()[:12]}")


def _build_and_load(build_spec: Build) -> ModuleType:
    """Compile the sources into this machine's cache (once per source version) and load them.

    NOTE: the build directory is named by :func:`build_tag`, so two checkouts, versions or
    environments never rebuild over each other. An ``flock`` (released by the OS even when a
    process is killed) serialises builders; torch's own lock file, which a killed build
    leaves behind and which torch would wait on forever, is removed under it. A failed build
    leaves ``build-failed.txt``, naming the compiler it used, so that later processes do not
    retry it for a minute each — until the compiler changes (another ``$CXX``, or the same
    one reinstalled or upgraded)."""
    from torch.utils.cpp_extension import load  # NOTE: slow import, only when needed

    from kvloop.paths import cache_dir

    here = Path(__file__).parent
    build = cache_dir() / "native" / build_tag(build_spec)
    built = build / f"{build_spec.name}.so"
    failed = build / "build-failed.txt"
    compiler = os.environ.get("CXX", "c++")
    if failed.exists():
        if _failed_with(failed) == _fingerprint(compiler):
            raise RuntimeError(f"their build failed before with the same compiler (see "
                               f"{failed}; delete it to retry)")
        failed.unlink(missing_ok=True)  # NOTE: another compiler now: try it
    try:
        build.mkdir(parents=True, exist_ok=True)
        lock = open(build / "kvloop.lock", "w")  # noqa: SIM115 (held across the build)
    except OSError:
        if built.exists():  # NOTE: a read-only cache that holds a finished build
            return _import(built, build_spec.name)
        raise
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("kvloop: waiting for another process compiling its CPU kernels...",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        fresh = not built.exists()
        if fresh:
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C++ compiler ({compiler}) on PATH to build them")
            print(f"kvloop: compiling its CPU kernels into {build} (once per version, 25-110 "
                  "s; KVLOOP_NATIVE=0 skips them)...", file=sys.stderr, flush=True)
        _ninja_on_path()
        start = time.perf_counter()
        try:
            module = load(name=build_spec.name,
                          sources=[str(here / s) for s in build_spec.sources],
                          extra_cflags=list(build_spec.cflags), extra_ldflags=["-fopenmp"],
                          build_directory=str(build), verbose=False)
        except Exception as exc:
            if not fresh:  # NOTE: not the compiler (e.g. torch's lock file gone under it)
                log.info("kvloop's CPU kernels: torch's loader failed (%s); importing the "
                         "finished build", exc)
                return _import(built, build_spec.name)
            failed.write_text(f"{_COMPILER}{_fingerprint(compiler)}\n"
                              f"{type(exc).__name__}: {exc}\n")
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = first.rstrip(" .;:")
            raise RuntimeError(f"their build failed ({first}; the log is in {failed})") from exc
        if fresh:
            print(f"kvloop: compiled its CPU kernels in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        return module


_COMPILER = "compiler: "


def _fingerprint(compiler: str) -> str:
    """The compiler ``compiler`` names as found now: its resolved path, size and mtime (so a
    reinstalled or upgraded one differs too); "missing" where it is not on PATH."""
    found = shutil.which(compiler)
    if found is None:
        return f"{compiler} missing"
    real = os.path.realpath(found)
    try:
        st = os.stat(real)
    except OSError:
        return f"{compiler} -> {real} unreadable"
    return f"{compiler} -> {real} ({st.st_size} bytes, mtime {st.st_mtime_ns})"


def _failed_with(marker: Path) -> str | None:
    """The compiler fingerprint a ``build-failed.txt`` recorded (None: unreadable or from an
    older version)."""
    try:
        first = marker.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[len(_COMPILER):] if first.startswith(_COMPILER) else None


def _import(path: Path, name: str) -> ModuleType:
    """The built kernels ``name`` at ``path``, imported without touching their (read-only)
    folder."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(name: str, *args: object) -> None:
    """Run operator ``name`` of :data:`OPS` (:func:`kernels` must have built) on ``args``;
    torch's profiler shows it as ``kvloop::<name>``."""
    _OVERLOADS[name](*args)


def _ninja_on_path() -> None:
    """Put the ``ninja`` package's binary on PATH: torch's builder runs ``ninja`` from PATH,
    which lacks the venv's ``bin`` when its Python is called without activating it."""
    try:
        import ninja
    except ImportError:  # NOTE: a system ninja may still be on PATH
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def attention_supported(device: torch.device, dtype: torch.dtype, head_dim: int,
                        num_heads: int) -> bool:
    """Whether ``decode_attention`` and ``prefill_attention`` serve a model of this shape and
    dtype on ``device`` (building the kernels if needed)."""
    return (device.type == "cpu" and dtype in ATTENTION_DTYPES and head_dim % 16 == 0
            and head_dim // 16 in (*range(1, 9), 16) and num_heads <= 256
            and kernels() is not None)


TILE = 16
"""Outputs per tile of ``q4_linear`` and ``q8_linear``: a matrix's output count must be a
multiple of it."""


def pack_q4(codes: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q4_linear``'s layout (``q4_linear.cpp``) of ``W[n, k] = scale[n, g] * codes[n, k]
    + low[n, g]``, ``g = k // 32``: codes ``[N, K]`` in 0..15, scale and low ``[N, K/32]``.
    Returns the packed bytes ``[N/16, K/32, 256]`` and float16 scales and offsets ``[N/16,
    K/32, 16]`` (as a Q4_1 block holds them).

    NOTE: ``scale`` and ``low`` must already be float16 values (``Int4Linear`` quantises onto
    them): a value float16 cannot hold exactly is refused, not rounded behind the codes'
    back."""
    n, k = codes.shape
    tiles, groups = n // TILE, k // 32
    # (tile, row, group, chunk, high nibble?, byte) -> (tile, group, chunk, row, byte, nibble)
    c = codes.to(torch.uint8).view(tiles, TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    c = c.contiguous()
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 256)
    return packed, _float16_tiles("pack_q4", "scale", scale), _float16_tiles("pack_q4", "low", low)


def pack_q8(codes: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """``q8_linear``'s layout (``q8_linear.cpp``) of ``W[n, k] = scale[n, g] * codes[n, k]``,
    ``g = k // 32``: codes ``[N, K]`` in -127..127, scale ``[N, K/32]`` (llama.cpp's Q8_0).
    Returns the packed bytes ``[N/16, K/32, 512]`` and the float16 scales (as a Q8_0 block
    holds them) ``[N/16, K/32, 16]``.

    NOTE: ``scale`` must already hold float16 values (``Int8Linear`` quantises onto them),
    as ``pack_q4``'s."""
    n, k = codes.shape
    tiles, groups = n // TILE, k // 32
    codes = codes.to(torch.int8)
    # (tile, row, group, chunk, byte) -> (tile, group, chunk, row, byte)
    packed = codes.view(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(tiles, groups, 512)
    return packed, _float16_tiles("pack_q8", "scale", scale)


def _float16_tiles(kernel: str, name: str, values: Tensor) -> Tensor:
    """``values`` ``[N, K/32]`` as float16 ``[N/16, K/32, 16]``; ``ValueError`` naming
    ``name`` where one is not a float16 value (it would be rounded behind the codes' back)."""
    h = values.half()
    if not torch.equal(h.float(), values.float()):
        raise ValueError(f"{kernel}: {name} must hold float16 values")
    return _per_tile(h)


def bf16_supported() -> bool:
    """Whether ``bf16_linear`` runs here: the kernels built, and either the AVX2 build (its
    kernel needs only AVX2 and FMA) or a CPU with AVX-512 BF16 (``vdpbf16ps``; CPUs with VNNI
    but without it run the other kernels)."""
    mod = kernels()
    return (mod is not None and mod.bf16_available()
            and (mod.__name__ == AVX2.name or "avx512_bf16" in cpu_flags()))


def pack_bf16(weight: Tensor) -> Tensor:
    """``bf16_linear``'s layout (``bf16_linear.cpp``) of ``weight`` ``[N, K]``:
    ``[N/16, K/2, 16, 2]`` bfloat16 (a copy)."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).view(n // TILE, TILE, k // 2, 2)
    return w.permute(0, 2, 1, 3).contiguous()


def amx_rows() -> dict[str, int]:
    """From how many rows each kernel multiplies with AMX tiles (``amx_gemm.cpp``) on this
    machine: ``bf16_linear`` and ``q4_linear`` (bfloat16 rows); empty where none does (no
    AMX-BF16, an OS that withholds the tiles, the AVX2 build, or no kernels)."""
    mod = kernels()
    if mod is None or not mod.amx_available():
        return {}
    return {"bf16_linear": int(mod.AMX_ROWS), "q4_linear": int(mod.AMX_Q4_ROWS)}


def f32_preferred() -> bool:
    """Whether ``make_linear`` gives float32 matrices to ``f32_linear`` here: the AVX2 build,
    where it was measured faster than oneDNN's float32 GEMM at every size (1 to 512 rows,
    ``docs/native-kernels.md``). On the full build oneDNN keeps them: on a 2-core Sapphire
    Rapids VM, SmolLM2-135M's 30 layers, ``f32_linear`` took 0.80-0.89x oneDNN's time up to
    8 rows, the same at 12-24, but 1.2x at 32, 1.3x at 64 and 1.7x at 512 rows (prompt
    chunks), and one layout serves every row count."""
    mod = kernels()
    return mod is not None and mod.__name__ == AVX2.name


def pack_f32(weight: Tensor) -> Tensor:
    """``f32_linear``'s layout (``f32_linear.cpp``) of ``weight`` ``[N, K]``:
    ``[N/16, K, 16]`` float32 (a copy)."""
    n, k = weight.shape
    return weight.detach().float().view(n // TILE, TILE, k).transpose(1, 2).contiguous()


def decode_layers(norms: list[Tensor], matrices: list[tuple[str, list[Tensor], Tensor | None]],
                  num_heads: int, num_kv_heads: int, head_dim: int,
                  intermediate: int) -> object:
    """A ``DecodeLayers`` (``decode_layers.cpp``): a model's layers run for one decode step
    in one call. ``norms``: each layer's input and post-attention norm weights; ``matrices``:
    each layer's QKV, O, gate/up and down as (kernel, weight tensors, float32 bias), the
    kernel ``bf16_linear``, ``f32_linear`` or ``q4_linear`` (all packed as ``[N/16, ...]``).
    The object reads the matrices' memory as it was when built (and keeps it alive): values
    changed in place are seen; tensors moved to other memory (``Tensor.set_``, as
    :func:`~kvloop.executor.torch.huge_pages.move_to_huge_pages` does) are not: build a new one."""
    mod = kernels()
    kinds = {"bf16_linear": mod.DecodeLayers.BF16, "f32_linear": mod.DecodeLayers.F32,
             "q4_linear": mod.DecodeLayers.Q4}
    return mod.DecodeLayers(norms, [kinds[k] for k, _, _ in matrices],
                            [w for _, w, _ in matrices], [b for _, _, b in matrices],
                            num_heads, num_kv_heads, head_dim, intermediate)


def _per_tile(t: Tensor) -> Tensor:
    """A per-(output, group) tensor ``[N, K/32]`` as ``[N/16, K/32, 16]``."""
    n, groups = t.shape
    return t.view(n // TILE, TILE, groups).transpose(1, 2).contiguous()
