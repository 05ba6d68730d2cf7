"""CPU weights on transparent huge pages (Linux).

A decode step at small batches streams every layer matrix once from memory. On 4 KiB pages
that stream misses the TLB every 4 KiB; on 2 MiB pages once every 2 MiB. Linux hands those
to an anonymous mapping advised ``MADV_HUGEPAGE`` where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or
``always``; torch's own allocator asks for them only under ``THP_MEM_ALLOC_ENABLE=1``, set
before torch is imported, which a library cannot rely on.

:func:`move_to_huge_pages` copies a model's packed weights into one such mapping, in the
order a step reads them. Measured on a 2-core Zen 4 VM (``docs/native-kernels.md``,
fourteenth round): the default model's int4 decode step at batch 1 took 0.92x its time on
4 KiB pages.
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_HUGE_PAGE = 2 << 20
"""Bytes of one transparent huge page where Linux does not say (x86-64's)."""
ALIGN = 64
"""Alignment of each tensor in the mapping: a cache line, as torch's allocator gives."""
THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
"""Where Linux says whether it hands out transparent huge pages (``enabled``: ``always``,
``madvise`` or ``never``, the chosen one in brackets) and their size (``hpage_pmd_size``)."""


def huge_pages_offered() -> bool:
    """Whether this OS gives an anonymous mapping advised ``MADV_HUGEPAGE`` huge pages:
    Linux with transparent huge pages not ``[never]``."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in (THP_DIR / "enabled").read_text()
    except OSError:
        return False


def huge_page_bytes() -> int:
    """Bytes of one transparent huge page here (2 MiB on x86-64; more on some arm64
    kernels), the alignment of the mapping."""
    try:
        return int((THP_DIR / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


def _movable(t: Tensor) -> bool:
    """A dense, contiguous CPU tensor that alone spans its whole storage (so that moving it
    moves every byte that storage holds, and frees the old storage once nothing else holds
    it)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
            and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes)


def move_to_huge_pages(tensors: Sequence[Tensor]) -> int:
    """Moves the data of ``tensors`` into one private anonymous mapping advised
    ``MADV_HUGEPAGE``, back to back in the order given (each :data:`ALIGN`-aligned), with
    ``Tensor.set_``: every holder of those tensor objects sees the moved data, values
    unchanged. Tensors that are not :func:`_movable` stay where they are; tensors over one
    storage move together (one copy). Returns the bytes moved: 0 where the OS offers no
    huge pages (:func:`huge_pages_offered`), refuses the mapping (logged) or nothing is
    movable.

    NOTE: the mapping lives as long as any moved tensor does (each holds it through its
    storage); the old storages are freed as the moves go unless something else holds them.
    Where no huge page is free when a page is first touched, Linux may compact memory to
    make one or else hands out a base page: the values are the same either way.
    """
    offsets: dict[int, int] = {}  # storage address -> its copy's offset in the mapping
    # id -> (tensor, its copy's offset, whether it is the first over its storage)
    moving: dict[int, tuple[Tensor, int, bool]] = {}
    total = 0
    for t in tensors:
        if id(t) in moving or not _movable(t):
            continue
        key = t.untyped_storage().data_ptr()
        first = key not in offsets
        if first:
            offsets[key] = total
            total += -(-t.nbytes // ALIGN) * ALIGN
        moving[id(t)] = (t, offsets[key], first)
    if not moving or not huge_pages_offered():
        return 0
    page = huge_page_bytes()
    # NOTE: private, not shared: Linux gives shared anonymous memory huge pages only under
    # its separate shmem setting (usually never). Advised before any page is touched, so
    # that the copies below fault in huge pages.
    try:
        area = mmap.mmap(-1, total + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # NOTE: e.g. an address-space limit: the weights stay as they are
        logger.warning("weights stay on the OS's base pages: %s", exc)
        return 0
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    for t, offset, first in moving.values():
        at = start + offset
        view = raw[at:at + t.nbytes].view(t.dtype).view(t.shape)
        if first:
            view.copy_(t)
        # NOTE: a tensor made under inference mode is only changed in place under it, and a
        # leaf that requires grad only under no_grad (inner: inference_mode(False) turns
        # grad mode back on).
        with torch.inference_mode(t.is_inference()), torch.no_grad():
            t.set_(view)
    return total
