"""Device path for the conditional method: diff and change extraction where the tensors live.

When base and target sit on a CUDA device, copying both to the host just to find the ~1% of
elements that changed would move the whole checkpoint over PCIe. Here the comparison, the
context (exponent) of every element, and each change's rank within its context are computed
with torch ops on the device; only the changed elements and their contexts cross to the host.
The same code runs on CPU tensors (that is how it is tested without a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from .methods.conditional import KEY_SHIFT, N_KEYS, Analysis, lanes_for


def _bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit patterns as int32 in [0, 65536) on the tensor's device."""
    return t.detach().reshape(-1).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _ord(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0x8000, v ^ 0xFFFF, v ^ 0x8000)


def analyze_on_device(base: torch.Tensor, target: torch.Tensor) -> Analysis:
    """Same result as `conditional.analyze`, computed on base/target's device."""
    b = _bits(base)
    t = _bits(target)
    lanes = lanes_for(b.numel())
    keys = (b >> KEY_SHIFT) & 0xFF
    lane = torch.arange(b.numel(), device=b.device) % lanes
    slot = lane * N_KEYS + keys  # contexts are (lane, key)
    counts = torch.bincount(slot, minlength=lanes * N_KEYS)
    changed = torch.nonzero(b != t).reshape(-1)
    if changed.numel():
        # rank within (lane, key) = position in a stable sort by slot, minus where the slot's run starts
        order = torch.sort(slot, stable=True).indices
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel(), device=order.device)
        start = torch.cumsum(counts, 0) - counts
        ck = keys[changed]
        ranks = where[changed] - start[slot[changed]]
        s = _ord(t[changed]) - _ord(b[changed])
        zig = torch.where(s > 0, 2 * s - 2, -2 * s - 1)
    else:
        ck = ranks = zig = changed
    host = lambda x, dt: x.to("cpu").numpy().astype(dt, copy=False)  # noqa: E731 - the only crossing
    return Analysis(host(counts, np.int64).reshape(lanes, N_KEYS), host(changed, np.int64), host(ck, np.uint8),
                    host(ranks, np.int64), host(zig, np.int64))
