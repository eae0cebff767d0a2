"""The publisher on a synthetic BF16 checkpoint: seconds per delta step and peak memory against the model.

    PYTHONPATH=. python scripts/bench_publish.py --tensors 4 --mib 256 --steps 6        # 1 GB
    flock /tmp/deltarelay-bigmem.lock python scripts/bench_publish.py --tensors 16 --mib 256   # 4.3 GB

Each step changes about `--changed` of the elements by one ULP, more often where |w| is small (as RL
steps do), in the trainer's own tensors, in place. Prints one JSON line: the first (snapshot) step's
seconds, each delta step's, their median, the resume time, and peak RSS (VmHWM) over the model's bytes,
the trainer's copy included, and beyond it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM afresh from the current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def model(tensors: int, mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = mib * (1 << 20) // 2
    return {f"layers.{i}.weight": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).reshape(-1, 4096)
            for i in range(tensors)}


def step_(state: dict[str, torch.Tensor], changed: float, gen: torch.Generator) -> None:
    """+1 ULP on about `changed` of each tensor's elements, chosen among twice as many candidates by the
    smallest |w| (small weights change more often at RL learning rates)."""
    for t in state.values():
        flat = t.view(-1)
        k = max(1, int(flat.numel() * changed))
        cand = torch.randint(0, flat.numel(), (2 * k,), generator=gen)
        pick = cand[torch.topk(flat[cand].float().abs(), k, largest=False).indices]
        bits = flat.view(torch.int16)
        bits[pick] += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256, help="MiB per tensor")
    ap.add_argument("--steps", type=int, default=6, help="delta steps after the first (snapshot) step")
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--advance", choices=("copy", "apply"), default="copy")
    ap.add_argument("--snapshot-every", type=int, default=1000,
                    help="steps between snapshots (default: none but the first, in the background otherwise)")
    ap.add_argument("--shard-mib", type=int, default=2048, help="max_shard_bytes, in MiB (one delta part each)")
    ap.add_argument("--resume", action="store_true", help="also time a resume of the run")
    ap.add_argument("--dir", default=None, help="where the file:// store goes (default: a temporary directory)")
    args = ap.parse_args(argv)

    import relay

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        warm = model(2, 1, seed=9)  # loads the compiled kernels before memory is measured
        with relay.Publisher(f"file://{tmp}/warm", workers=args.workers) as pub:
            pub.publish(warm, 0)
            pub._warm.wait()  # the measured run codes with the compiled kernels, not the interim (kernel-free) coder
            step_(warm, args.changed, torch.Generator().manual_seed(1))
            pub.publish(warm, 1)
        del warm
        state = model(args.tensors, args.mib)
        size = sum(t.numel() * t.element_size() for t in state.values())
        base = rss("VmRSS")
        reset_peak()
        gen = torch.Generator().manual_seed(2)
        url = f"file://{tmp}/run"
        times = []
        with relay.Publisher(url, workers=args.workers, advance=args.advance, snapshot_every=args.snapshot_every,
                             snapshot_fraction=1e9, max_shard_bytes=args.shard_mib << 20) as pub:
            t0 = time.perf_counter()
            pub.publish(state, 0)
            first = time.perf_counter() - t0
            for step in range(1, args.steps + 1):
                step_(state, args.changed, gen)
                t0 = time.perf_counter()
                pub.publish(state, step)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        flush = time.perf_counter() - t0
        peak = rss("VmHWM")
        out = {"model_bytes": size, "tensors": args.tensors, "workers": args.workers, "advance": args.advance,
               "first_step_s": round(first, 3), "delta_steps_s": [round(t, 3) for t in times],
               "delta_median_s": round(statistics.median(times), 3), "close_flush_s": round(flush, 3),
               "peak_rss_over_model": round(peak / size, 3),
               "publisher_peak_over_model": round((peak - base) / size, 3),
               # of which superseded tensors held for a pending snapshot (copy-on-write; 0 when every
               # snapshot is written before the base moves past it)
               "snapshot_held_peak_over_model": round(pub.snapshot_held_peak / size, 3)}
        if args.resume:
            del pub, state  # the trainer is gone: a new one reads the run back
            t0 = time.perf_counter()
            resumed = relay.Publisher(url, resume=True, workers=args.workers)
            out["resume_s"] = round(time.perf_counter() - t0, 3)
            resumed.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
