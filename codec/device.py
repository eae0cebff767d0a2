"""Device path for the conditional method: diff and change extraction where the tensors live.

When base and target sit on a CUDA device, copying both to the host just to find the ~1% of
elements that changed would move the whole checkpoint over PCIe. Here the comparison, the
class (exponent interval) of every element, and each change's rank within its class are computed
with torch ops on the device; only the changed elements and their contexts cross to the host.
The same code runs on CPU tensors (that is how it is tested without a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from .methods import exponent_classes as ec
from .methods.conditional import KEY_SHIFT, MAX_CLASSES, Analysis, choose_thresholds


def _bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit patterns as int32 in [0, 65536) on the tensor's device."""
    return t.detach().reshape(-1).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def analyze_on_device(base: torch.Tensor, target: torch.Tensor) -> Analysis:
    """Same result as `conditional.analyze`, computed on base/target's device.

    Only the changes, their exponents and the sampled per-exponent counts (what the host needs
    to choose the classes) cross to the host; the class thresholds cross back."""
    b = _bits(base)
    t = _bits(target)
    n = b.numel()
    host = lambda x, dt: x.to("cpu").numpy().astype(dt, copy=False)  # noqa: E731 - the only crossings
    keys = (b >> KEY_SHIFT) & 0xFF
    stride = ec.sample_stride(n)
    # the elements `ec.sample_stats` samples: runs of 64 every 64 * stride
    starts = torch.arange(0, n, 64 * stride, device=b.device)
    idx = (starts[:, None] + torch.arange(64, device=b.device)[None, :]).reshape(-1)
    idx = idx[idx < n]
    sk = keys[idx]
    n_e = host(torch.bincount(sk, minlength=256), np.int64)
    k_e = host(torch.bincount(sk[b[idx] != t[idx]], minlength=256), np.int64)
    thresholds = choose_thresholds(n_e, k_e, stride)
    changed = torch.nonzero(b != t).reshape(-1)
    lut = torch.from_numpy(ec.class_lut(thresholds).astype(np.int64)).to(b.device)
    cls = lut[keys]
    sizes = torch.bincount(cls, minlength=MAX_CLASSES)
    if changed.numel():
        # rank within the class = position in a stable sort by class, minus where the class's run starts
        order = torch.sort(cls, stable=True).indices
        where = torch.empty_like(order)
        where[order] = torch.arange(n, device=order.device)
        start = torch.cumsum(sizes, 0) - sizes
        cc = cls[changed]
        ranks = where[changed] - start[cc]
        pairs = (b[changed].to(torch.int64) << 16) | t[changed]
    else:
        cc = ranks = pairs = changed
    return Analysis(thresholds, host(sizes, np.int64), host(pairs, np.uint32), host(cc, np.uint8),
                    host(ranks, np.int64), index=host(changed, np.int64))
