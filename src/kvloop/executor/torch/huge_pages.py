"""CPU weights on transparent huge pages (Linux), and zeroed CPU memory that start-up does
not wait for.

A decode step at small batches streams every layer matrix once from memory. On 4 KiB pages
that stream misses the TLB every 4 KiB; on 2 MiB pages once every 2 MiB. Linux hands those
to an anonymous mapping advised ``MADV_HUGEPAGE`` where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or
``always``; torch's own allocator asks for them only under ``THP_MEM_ALLOC_ENABLE=1``, set
before torch is imported, which a library cannot rely on.

:class:`HugePageMove` copies a model's packed weights into one such mapping, in the
order a step reads them, on a background thread; the engine swaps them in between two
steps. Measured on a 2-core Zen 4 VM: the default model's int4 decode step at batch 1 took
0.92x its time on 4 KiB pages.

:func:`zeroed_cpu_tensor` gives the KV cache zeroed memory at once: an anonymous mapping
(zero-filled by the OS, advised ``MADV_HUGEPAGE`` where offered) whose pages a background
thread at the lowest CPU priority faults in with ``MADV_POPULATE_WRITE``. ``torch.zeros``
of the default 2 GiB cache took 3.2-5.8 s of start-up on a 2-core Sapphire Rapids VM (a
fault per 4 KiB page, each written); populating the same mapping took 0.6 s, off the path
to the first token.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from kvloop.priority import lowest_priority

logger = logging.getLogger(__name__)

DEFAULT_HUGE_PAGE = 2 << 20
"""Bytes of one transparent huge page where Linux does not say (x86-64's)."""
ALIGN = 64
"""Alignment of each tensor in the mapping: a cache line, as torch's allocator gives."""
THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
"""Where Linux says whether it hands out transparent huge pages (``enabled``: ``always``,
``madvise`` or ``never``, the chosen one in brackets) and their size (``hpage_pmd_size``)."""


MADV_POPULATE_WRITE = 23
"""Linux's ``madvise`` advice (5.14 on) that faults pages in writable without writing them
(so populating never races a write to the same page). Python's ``mmap`` does not name it."""
POPULATE_CHUNK = 2 << 20
"""Bytes populated per ``madvise`` call (one huge page). NOTE: small, because a call holds
the process's memory-map lock: a step that maps new memory (a large allocation) waits for
the call in progress, so each call must be short."""


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


class HugePageMove:
    """The data of some tensors copied into one private anonymous mapping advised
    ``MADV_HUGEPAGE``, back to back in the order given (each :data:`ALIGN`-aligned), then
    swapped in with ``Tensor.set_`` (:meth:`apply`): every holder of those tensor objects
    sees the moved data, values unchanged. Tensors that are not :func:`_movable` stay where
    they are; tensors over one storage move together (one copy).

    :meth:`start` makes the copies on a background thread at the lowest CPU priority, so
    that start-up does not wait for them (faulting in and filling a few hundred MB of huge
    pages took 1.3 s of the default model's start-up on a 2-core Sapphire Rapids VM); the
    model applies the move between two forwards once :attr:`ready`.

    NOTE: the tensors must not change while the copies are made (weights, after loading).
    The mapping lives as long as any moved tensor does (each holds it through its storage);
    the old storages are freed at :meth:`apply` unless something else holds them, so until
    then the moved weights take twice their memory. Where no huge page is free when a page
    is first touched, Linux may compact memory to make one or else hands out a base page:
    the values are the same either way.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
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
        self._moving = list(moving.values()) if huge_pages_offered() else []
        self.nbytes = total if self._moving else 0
        """Bytes the move takes: 0 where the OS offers no huge pages or nothing is movable."""
        self._views: list[tuple[Tensor, Tensor]] | None = None
        self._thread: threading.Thread | None = None
        self._cancelled = threading.Event()

    def copy(self) -> None:
        """Make the copies (on the calling thread). A refused mapping is logged, and the
        move then moves nothing."""
        if not self._moving:
            self._views = []
            return
        page = huge_page_bytes()
        # NOTE: private, not shared: Linux gives shared anonymous memory huge pages only
        # under its separate shmem setting (usually never). Advised before any page is
        # touched, so that the copies below fault in huge pages.
        try:
            area = mmap.mmap(-1, self.nbytes + page,
                             flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # NOTE: e.g. an address-space limit: the weights stay
            logger.warning("weights stay on the OS's base pages: %s", exc)
            self._views, self.nbytes = [], 0
            return
        raw = torch.frombuffer(area, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        views = []
        for t, offset, first in self._moving:
            if self._cancelled.is_set():
                self._views, self.nbytes = [], 0
                return
            at = start + offset
            view = raw[at:at + t.nbytes].view(t.dtype).view(t.shape)
            if first:
                view.copy_(t)
            views.append((t, view))
        self._views = views

    def start(self, then: Callable[[], None] | None = None) -> HugePageMove:
        """Make the copies on a background thread at the lowest CPU priority, then call
        ``then`` (on that thread)."""
        def run() -> None:
            try:
                lowest_priority()
                self.copy()
                if then is not None and not self._cancelled.is_set():
                    then()
            finally:
                atexit.unregister(self.cancel)

        # NOTE: a daemon thread, so that exiting does not wait for the copies; cancelled at
        # exit before the interpreter stops daemon threads (stopping one inside torch's copy
        # ends the process with "terminate called without an active exception").
        self._thread = threading.Thread(target=run, daemon=True, name="kvloop-huge-pages")
        atexit.register(self.cancel)
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop making the copies (after the one being made) and wait for the thread; the
        move then moves nothing."""
        self._cancelled.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def ready(self) -> bool:
        """Whether the copies are made (:meth:`apply` then does not wait)."""
        return self._views is not None

    def apply(self) -> int:
        """Point every tensor at its copy (making the copies first, or waiting for the
        thread making them); returns the bytes moved (0 where the copy failed). Never while
        something reads the tensors (kernels holding raw pointers, such as
        ``DecodeLayers``, are rebuilt after).

        NOTE: ``_views`` is set once, when every copy is made."""
        if self._views is None:
            if self._thread is None:
                self.copy()
            elif self._thread is not threading.current_thread():
                self._thread.join()
        views = self._views or []
        for t, view in views:
            # NOTE: a tensor made under inference mode is only changed in place under it,
            # and a leaf that requires grad only under no_grad (inner: inference_mode(False)
            # turns grad mode back on).
            with torch.inference_mode(t.is_inference()), torch.no_grad():
                t.set_(view)
        self._views, self._moving = [], []
        return self.nbytes if views else 0


def move_to_huge_pages(tensors: Sequence[Tensor]) -> int:
    """Move ``tensors``' data onto huge pages now (:class:`HugePageMove`, copied on the
    calling thread); returns the bytes moved."""
    return HugePageMove(tensors).apply()


def zeroed_cpu_tensor(shape: Sequence[int], dtype: torch.dtype,
                      ) -> tuple[Tensor, threading.Thread | None]:
    """A zero-filled CPU tensor, returned before its pages are resident, and the thread that
    makes them resident (None where Linux cannot: then pages fault in as they are first
    written).

    The tensor lives on a private anonymous mapping, which the OS hands out zero-filled
    (the KV cache relies on masked slots being finite), advised ``MADV_HUGEPAGE`` where
    huge pages are offered. The thread runs at the lowest CPU priority and populates the
    mapping in :data:`POPULATE_CHUNK` pieces with :data:`MADV_POPULATE_WRITE`, through
    ``ctypes`` (which releases the GIL), so that later steps do not take the faults.
    """
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_offered():
        area.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(area, dtype=dtype, count=numel).view(tuple(shape))
    if not sys.platform.startswith("linux") or nbytes == 0:
        return tensor, None
    thread = threading.Thread(target=_populate, args=(tensor, nbytes), daemon=True,
                              name="kvloop-populate")
    thread.start()
    return tensor, thread


def _populate(tensor: Tensor, nbytes: int) -> None:
    """Fault in ``tensor``'s mapping without writing it (:func:`zeroed_cpu_tensor`).

    NOTE: holds ``tensor`` (and so its mapping) until done; stops at the first refusal
    (a kernel before 5.14: the pages then fault in as they are written)."""
    lowest_priority()
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start = tensor.data_ptr()
    for offset in range(0, nbytes, POPULATE_CHUNK):
        if madvise(start + offset, min(POPULATE_CHUNK, nbytes - offset),
                   MADV_POPULATE_WRITE) != 0:
            logger.debug("KV cache pages fault in as written: madvise errno %d",
                         ctypes.get_errno())
            return
