"""The paged KV cache tensors: a device pool, a host pool for swapping, and their sizing.

Both pools are one tensor shaped ``[num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]``, so one indexed copy moves a block of every layer at once.

The device pool is zero-filled. On CPU it is made without waiting for its pages: they are
faulted in by a background thread (``huge_pages.zeroed_cpu_tensor``), so that start-up
does not wait for them and steps do not take them (first-touch page faults inside a timed
step cost 10-20 % of a decode step's time in a VM). The host pool is left unwritten until
a block is swapped out, so swap space costs no resident memory until it is used: on CPU, a
2 GiB cache with the default 4 GiB of swap space is 2 GiB, not 6.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from kvloop.executor.torch.huge_pages import zeroed_cpu_tensor

DEFAULT_CPU_KV_MEMORY = 2 << 30
"""Default KV budget on CPU: 2 GiB (capped at a fifth of physical RAM, see below)."""


def block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def physical_memory() -> int:
    """Physical RAM in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_kv_budget(kv_cache_memory: int | None) -> int:
    """Bytes for the KV cache on CPU: ``kv_cache_memory`` if given, else 2 GiB capped at
    a fifth of physical RAM (weights, activations and the OS need the rest)."""
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
        return kv_cache_memory
    ram = physical_memory()
    return min(DEFAULT_CPU_KV_MEMORY, ram // 5) if ram else DEFAULT_CPU_KV_MEMORY


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float, reserve: int) -> int:
    """Bytes for the KV cache on a CUDA device once the weights are loaded:
    ``total × utilization − memory already in use − reserve`` (activations, workspace)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB total × "
            f"{gpu_memory_utilization} utilization, {(total - free) / 2**30:.1f} GiB in use, "
            f"{reserve / 2**30:.1f} GiB reserved for activations; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


class KVCache:
    """Device and host KV pools of one model, and the copies the scheduler orders.

    NOTE: the device pool is zero-initialised: attention relies on masked slots being
    finite. The host pool is not: a host block is only ever read after a swap-out wrote it
    whole.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        shape = (num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        self.populating = None
        """The thread making the CPU pool resident (``zeroed_cpu_tensor``), or None."""
        if device.type == "cpu":
            self.gpu, self.populating = zeroed_cpu_tensor(shape, dtype)
        else:
            self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self.layers: list[Tensor] = list(self.gpu.unbind(0))
        """Per-layer views ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        self._pinned = device.type == "cuda"
        host_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu = torch.empty(host_shape, dtype=dtype, pin_memory=self._pinned)

    def _index(self, ids: Sequence[int], device: torch.device) -> Tensor:
        return torch.tensor(ids, dtype=torch.long, device=device)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs device -> host."""
        if not pairs:
            return
        src = self._index([d for d, _ in pairs], self.device)
        dst = self._index([h for _, h in pairs], torch.device("cpu"))
        blocks = self.gpu.index_select(2, src)
        self.cpu.index_copy_(2, dst, blocks.to("cpu"))

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Duplicate (source, destination) device blocks (copy on write)."""
        if not pairs:
            return
        src = self._index([s for s, _ in pairs], self.device)
        dst = self._index([d for _, d in pairs], self.device)
        self.gpu.index_copy_(2, dst, self.gpu.index_select(2, src))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs host -> device."""
        if not pairs:
            return
        src = self._index([h for h, _ in pairs], torch.device("cpu"))
        dst = self._index([d for _, d in pairs], self.device)
        shape = list(self.cpu.shape)
        shape[2] = len(pairs)
        staging = torch.empty(shape, dtype=self.cpu.dtype, pin_memory=self._pinned)
        torch.index_select(self.cpu, 2, src, out=staging)
        self.gpu.index_copy_(2, dst, staging.to(self.device, non_blocking=self._pinned))

