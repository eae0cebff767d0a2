"""New tensors for decoded checkpoints, in memory that is cheap to touch for the first time.

A decode writes every byte of a checkpoint into fresh memory, and fresh memory costs a page
fault per 4 KiB page on first touch: ~11,500 faults for a 45 MB checkpoint, ~20 ms of a ~30 ms
decode on this project's VMs (measured: `torch.empty` of 45 MB and a fill, 21-42 ms; warm
memory, 3 ms). Whether a given decode pays them is up to the allocator (glibc returns large
freed blocks to the kernel or keeps them, run by run). Transparent huge pages fault once per
2 MiB instead: a large output gets its own anonymous mapping with `MADV_HUGEPAGE` (the same
`madvise` PyTorch's `THP_MEM_ALLOC_ENABLE` does for its own allocations): 7-12 ms for the same
45 MB. Each tensor keeps its own mapping (its own storage: safetensors refuses to save tensors
that share one), unmapped when the tensor is freed. Smaller tensors, hosts without huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` "never", or no such file) and platforms without
`madvise` get `torch.empty`.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import numpy as np
import torch

# Below this, a tensor holds no whole huge page (2 MiB) once its mapping's unaligned head is
# left out, and the mapping and its system calls cost more than the faults they save.
HUGE_MIN_BYTES = 4 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages_usable() -> bool:
    """Whether anonymous mappings can ask for transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


HUGE_PAGES = _huge_pages_usable()


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor (as `torch.empty`), in huge pages where it is large enough
    and the host has them (see the module's doc)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not HUGE_PAGES or nbytes < HUGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (a kernel without THP for anonymous memory): ordinary pages
        pass
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def new_elements(n: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised flat array of n elements of `dtype`, in the memory `new_tensor` gives (huge
    pages where large enough): for a decoded tensor built in numpy and handed to torch without a
    copy (`tensors.tensor_from_elements(..., copy=False)`). The array keeps its memory alive."""
    dtype = np.dtype(dtype)
    return new_tensor((n * dtype.itemsize,), torch.uint8).numpy().view(dtype)
