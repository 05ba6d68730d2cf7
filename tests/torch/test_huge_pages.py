"""Weights moved onto transparent huge pages keep their values and their holders, skip what
cannot move, and move nothing where the OS offers no huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvloop.executor.torch import huge_pages  # noqa: E402
from kvloop.executor.torch.huge_pages import (  # noqa: E402
    ALIGN,
    huge_page_bytes,
    huge_pages_offered,
    move_to_huge_pages,
)
from kvloop.executor.torch.loader import load_model  # noqa: E402

needs_huge_pages = pytest.mark.skipif(not huge_pages_offered(),
                                      reason="this OS offers no transparent huge pages")


def _offered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setting: str) -> None:
    (tmp_path / "enabled").write_text(setting)
    monkeypatch.setattr(huge_pages, "THP_DIR", tmp_path)


def _advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised MADV_HUGEPAGE (its VmFlags in
    /proc/self/smaps list ``hg``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


@needs_huge_pages
def test_moves_values_in_order_and_holders_see_them() -> None:
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        inference = torch.randn(3, 5, generator=g)  # NOTE: changed in place under it only
    tensors = [torch.randn(1000, generator=g).to(torch.bfloat16),
               torch.randint(0, 255, (7, 3), dtype=torch.uint8, generator=g),
               inference, torch.randn(16, 16, generator=g)]
    before = [t.clone() for t in tensors]
    old_ptrs = [t.data_ptr() for t in tensors]
    moved = move_to_huge_pages(tensors)
    assert moved == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
    ptrs = [t.data_ptr() for t in tensors]
    assert all(p != o for p, o in zip(ptrs, old_ptrs, strict=True))
    assert all(p % ALIGN == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < moved  # one mapping, in order
    for t, b in zip(tensors, before, strict=True):
        assert t.dtype == b.dtype and t.shape == b.shape and torch.equal(t, b)
    assert all(_advised(p) for p in ptrs) and not _advised(before[0].data_ptr())
    tensors[3].add_(1)  # the moved data is writable
    assert torch.equal(tensors[3], before[3] + 1)


@needs_huge_pages
def test_skips_what_cannot_move() -> None:
    base = torch.arange(64, dtype=torch.float32)
    view = base[8:]                      # part of another tensor's storage
    strided = torch.zeros(8, 8).t()      # not contiguous
    kept = [base, view, strided]
    ptrs = [t.data_ptr() for t in kept]
    t = torch.ones(32)
    assert move_to_huge_pages([*kept[1:], t, t]) == 128  # t once; the others not at all
    assert [k.data_ptr() for k in kept] == ptrs
    assert torch.equal(view, torch.arange(8, 64, dtype=torch.float32))
    assert move_to_huge_pages([]) == 0


@pytest.mark.parametrize("setting", ["always madvise [never]\n", ""])
def test_nothing_moves_without_huge_pages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          setting: str) -> None:
    if setting:
        _offered(monkeypatch, tmp_path, setting)
    else:
        monkeypatch.setattr(huge_pages, "THP_DIR", tmp_path / "missing")
    assert not huge_pages_offered()
    t = torch.ones(1024)
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr


@needs_huge_pages
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_cpu_model_streams_from_one_mapping(llama_model, dtype: torch.dtype) -> None:
    _, model = load_model(llama_model.path, dtype=dtype, device=torch.device("cpu"))
    model.adopt_moved_weights(wait=True)
    assert model.weights_move is None
    tensors = [t for t in model.streamed_tensors() if not t.is_mkldnn]
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs[0] % huge_page_bytes() == 0, "the first layer's norm does not open the mapping"
    assert ptrs == sorted(ptrs), "not in the order a step reads them"
    assert ptrs[-1] - ptrs[0] < sum(-(-t.nbytes // ALIGN) * ALIGN for t in tensors)


@pytest.mark.skipif(not hasattr(mmap, "MAP_PRIVATE"), reason="no POSIX mmap flags here")
def test_a_refused_mapping_leaves_the_tensors(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_offered", lambda: True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = torch.arange(1024, dtype=torch.float32)
    ptr = t.data_ptr()
    with caplog.at_level("WARNING", logger=huge_pages.__name__):
        assert move_to_huge_pages([t]) == 0
    assert t.data_ptr() == ptr and torch.equal(t, torch.arange(1024, dtype=torch.float32))
    assert "Cannot allocate memory" in caplog.text


@needs_huge_pages
def test_tensors_over_one_storage_move_together() -> None:
    w = torch.arange(256, dtype=torch.float32)
    flat = w.view(16, 16)  # another object over the whole of w's storage
    param = torch.nn.Parameter(torch.ones(64))  # a leaf that requires grad
    assert move_to_huge_pages([w, flat, param]) == 1024 + 256  # w's bytes once
    assert w.data_ptr() == flat.data_ptr() and param.data_ptr() == w.data_ptr() + 1024
    flat[0, 0] = -1.0
    assert w[0] == -1.0, "the two objects no longer share their data"
    assert param.requires_grad and torch.equal(param.detach(), torch.ones(64))


def test_huge_page_size_comes_from_linux(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(huge_pages, "THP_DIR", tmp_path)
    assert huge_page_bytes() == huge_pages.DEFAULT_HUGE_PAGE  # nothing said: x86-64's
    (tmp_path / "hpage_pmd_size").write_text("536870912\n")  # an arm64 kernel with 64K pages
    assert huge_page_bytes() == 512 << 20


def test_zeroed_cpu_tensor_is_zero_and_keeps_writes_made_while_it_populates() -> None:
    from kvloop.executor.torch import huge_pages

    shape = (3, 2, 257, 16, 64)  # 3.2 MiB of bfloat16: a few populate calls at 1 MiB
    original = huge_pages.POPULATE_CHUNK
    huge_pages.POPULATE_CHUNK = 1 << 20
    try:
        t, thread = huge_pages.zeroed_cpu_tensor(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert int(t.count_nonzero()) == 0
        t[1, 0, 100:].fill_(1.5)  # written while the thread may still be populating
        if thread is not None:
            thread.join(timeout=30)
            assert not thread.is_alive()
    finally:
        huge_pages.POPULATE_CHUNK = original
    assert bool((t[1, 0, 100:] == 1.5).all())
    assert int(t.count_nonzero()) == t[1, 0, 100:].numel()


def test_the_cpu_kv_pool_is_zero_filled_and_populated() -> None:
    from kvloop.executor.torch.kv_cache import KVCache

    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                    num_gpu_blocks=64, num_cpu_blocks=4, dtype=torch.float32,
                    device=torch.device("cpu"))
    if cache.populating is not None:
        cache.populating.join(timeout=30)
    assert int(cache.gpu.count_nonzero()) == 0
    assert cache.layers[1].shape == (2, 64, 16, 2, 32)
    cache.copy([(0, 1)])  # the pool is an ordinary tensor to the copies
    cache.swap_out([(3, 0)])


@needs_huge_pages
def test_weights_move_after_start_up_without_changing_outputs(llama_model, monkeypatch) -> None:
    import threading

    from kvloop.engine.args import EngineArgs
    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.sampling_params import SamplingParams

    gate, copy = threading.Event(), huge_pages.HugePageMove.copy
    monkeypatch.setattr(huge_pages.HugePageMove, "copy",
                        lambda self: (gate.wait(60), copy(self))[1])
    engine = LLMEngine.from_args(EngineArgs(
        model=str(llama_model.path), dtype="bfloat16", device="cpu", block_size=4,
        num_gpu_blocks=64, swap_space=0.0, max_model_len=256, skip_tokenizer_init=True,
        max_num_batched_tokens=64))
    model = engine.executor.model
    move = model.weights_move
    assert move is not None and move.nbytes > 0  # start-up did not wait for the copy

    def greedy(rid: str) -> list[int]:
        engine.add_request(rid, [1, 5, 9, 13, 17],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return list(out.token_ids)
        raise AssertionError("no output")

    before = greedy("a")  # on the weights as loaded
    assert model.weights_move is move
    gate.set()
    move._thread.join(60)  # an idle engine: the copy thread swaps the copies in itself
    assert model.weights_move is None
    ptrs = [t.data_ptr() for t in model.streamed_tensors() if not t.is_mkldnn]
    assert ptrs == sorted(ptrs) and ptrs[0] % huge_page_bytes() == 0
    assert greedy("b") == before
