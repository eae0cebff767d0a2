"""The conditional entropy bound of a BF16 (or F16) delta: the benchmark's yardstick.

Bits an ideal order-0 coder needs when the receiver already holds the base: the change mask
coded with one probability per base exponent (an update is visible roughly when |dw| > |w|/256,
so small weights change far more often), plus the change of each changed element in ULP steps
coded with one pooled distribution. Better context models go below it; it is not a wall.
Only 16-bit floats count (BF16 and F16, each exponent of each a context of its own); other dtypes
are outside the bound.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

SIGN = np.uint16(0x8000)
# dtype -> (exponent shift, exponent mask, first context): BF16's 256 exponents, then F16's 32
EXPONENTS = {torch.bfloat16: (7, 0xFF, 0), torch.float16: (10, 0x1F, 256)}
CONTEXTS = 256 + 32


def ordered(bits: np.ndarray) -> np.ndarray:
    """16-bit float bit patterns (BF16 or F16) mapped to integers in float order (-0 sits just below +0).

    Negative values reverse: x ^ 0xFFFF; non-negative ones move above them: x | 0x8000. One ULP
    step is then +-1 everywhere, across zero too.
    """
    neg = (bits & SIGN) != 0
    return np.where(neg, bits ^ np.uint16(0xFFFF), bits | SIGN).astype(np.int32)


def _entropy_bits(counts: np.ndarray) -> float:
    """Total bits to code `counts.sum()` symbols with their own empirical order-0 distribution."""
    counts = counts[counts > 0].astype(np.float64)
    n = counts.sum()
    return float(-(counts * np.log2(counts / n)).sum()) if n else 0.0


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).contiguous().cpu().view(torch.int16).numpy().view(np.uint16)


def conditional_entropy_bound(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> dict:
    """Order-0 bits of (change mask | base exponent) + (ULP step of each change), pooled over the checkpoint."""
    total = np.zeros(CONTEXTS, np.int64)
    changed = np.zeros(CONTEXTS, np.int64)
    steps: list[np.ndarray] = []
    for name, t_tensor in target.items():
        if t_tensor.dtype not in EXPONENTS:
            continue
        if name not in base or base[name].shape != t_tensor.shape or base[name].dtype != t_tensor.dtype:
            raise ValueError(f"tensor {name!r}: base and target differ in presence, shape or dtype")
        shift, mask, first = EXPONENTS[t_tensor.dtype]
        b = _bits(base[name])
        t = _bits(t_tensor)
        exponent = first + ((b >> shift) & mask).astype(np.int64)
        total += np.bincount(exponent, minlength=CONTEXTS)
        where = np.flatnonzero(b != t)
        if where.size:
            changed += np.bincount(exponent[where], minlength=CONTEXTS)
            steps.append(ordered(t[where]) - ordered(b[where]))
    n, c = total.astype(np.float64), changed.astype(np.float64)
    mask_bits = _entropy_bits(np.concatenate([c, n - c])) - _entropy_bits(n)  # sum_e n_e * H(c_e / n_e)
    all_steps = np.concatenate(steps) if steps else np.zeros(0, np.int32)
    value_bits = _entropy_bits(np.unique(all_steps, return_counts=True)[1]) if all_steps.size else 0.0
    elements, n_changed = int(total.sum()), int(changed.sum())
    bits = mask_bits + value_bits
    per = (lambda x: x / n_changed) if n_changed else (lambda x: 0.0)
    return {
        "elements": elements,
        "changed": n_changed,
        "changed_fraction": n_changed / elements if elements else 0.0,
        "mask_bits": mask_bits,
        "value_bits": value_bits,
        "total_bits": bits,
        "bytes": bits / 8,
        "percent": 100 * bits / 8 / (2 * elements) if elements else 0.0,
        "mask_bits_per_changed": per(mask_bits),
        "value_bits_per_changed": per(value_bits),
        "bits_per_changed": per(bits),
    }
