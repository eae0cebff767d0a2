#!/usr/bin/env python
"""What BLAKE3 per-tensor digests (signed runs' records, PROTOCOL §3.1) cost the publisher, per GB.

    python scripts/bench_blake3.py [--mib 512] [--runs 5] [--changed 1.0]

Hashes one BF16 "model" of --mib MiB (tensors of 16 MiB) the way the publisher does, in the same run
against the baselines it must be compared with: xxh3-128 (the digest every record has) and SHA-256
(what a signed run already computes per object). BLAKE3 is timed single-threaded and with
blake3's max_threads=AUTO (what relay.manifest.tensor_blake3 uses for tensors >= 4 MiB). `--changed`
is the fraction of tensors whose bytes changed since the last step: only those are rehashed
(Publisher._blake3_of), so the per-step cost is that fraction of the full pass. Medians of --runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402
import torch  # noqa: E402

from codec.hashing import digest_elements  # noqa: E402
from codec.tensors import element_view  # noqa: E402
from relay.manifest import tensor_blake3  # noqa: E402


def timed(fn, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--changed", type=float, default=1.0, help="fraction of tensors rehashed per step")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(8 << 20, generator=g).to(torch.bfloat16) for _ in range(max(1, args.mib // 16))]
    views = [element_view(t) for t in tensors]
    total = sum(t.numel() * 2 for t in tensors)
    rehashed = views[:max(0, round(len(views) * args.changed))]

    def one_thread() -> None:
        for v in rehashed:
            h = blake3.blake3(max_threads=1)
            h.update(v.data.cast("B"))
            h.digest()

    cases = {
        "xxh3-128 (every record)": lambda: [digest_elements("BF16", tuple(v.shape), v) for v in views],
        "sha256 (signed objects)": lambda: [hashlib.sha256(v.data.cast("B")).digest() for v in views],
        "blake3, 1 thread": one_thread,
        "blake3, max_threads=AUTO (publisher)": lambda: [tensor_blake3("BF16", tuple(v.shape), v) for v in rehashed],
    }
    hashed = {"blake3, 1 thread": sum(v.nbytes for v in rehashed),
              "blake3, max_threads=AUTO (publisher)": sum(v.nbytes for v in rehashed)}
    xxh3 = None
    rows = []
    for name, fn in cases.items():
        fn()  # warm
        s = timed(fn, args.runs)
        xxh3 = xxh3 or s
        per_gb = s / (total / 1e9)
        rows.append({"case": name, "seconds": round(s, 4), "model_gb": round(total / 1e9, 3),
                     "hashed_gb": round(hashed.get(name, total) / 1e9, 3),
                     "seconds_per_model_gb": round(per_gb, 4), "x_xxh3": round(s / xxh3, 2),
                     "gb_per_s": round(hashed.get(name, total) / s / 1e9, 2)})
    for r in rows:
        print(f"{r['case']:40} {r['seconds_per_model_gb']:8.3f} s per model GB  {r['gb_per_s']:6.2f} GB/s  "
              f"{r['x_xxh3']:5.2f}x xxh3")
    print(json.dumps({"threads_available": torch.get_num_threads(), "changed_fraction": args.changed, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
