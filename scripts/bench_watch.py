"""Watcher cost on a synthetic BF16 run: cold-sync peak memory, one delta step's time and disk writes.

    python scripts/bench_watch.py --tensors 4 --mib 256 --workdir /tmp/bw        # ~1 GB
    flock /tmp/deltarelay-bigmem.lock python scripts/bench_watch.py --tensors 16 --mib 256 --workdir /tmp/bw4

Publishes (relay.Publisher into file://) a snapshot at step 0 and `--steps` deltas, each moving ~1% of the
elements by one ULP, more often where |w| is small (as RL updates do). Then, per persist mode, a fresh
watcher process cold-syncs to step 3 (the snapshot + 3 deltas: its VmHWM over the model's bytes), and
follows the rest one step at a time (wall time of each sync and the bytes it wrote, from
/proc/self/io write_bytes, in the watcher process). Prints one JSON line per mode; medians of the steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, sys, time
from relay.publisher import Publisher
from relay.watcher import Watcher
from relay.store import open_store
from relay.manifest import Manifest

url, dest, persist, cold_to = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def io_written():
    for line in open("/proc/self/io"):
        if line.startswith("write_bytes:"):
            return int(line.split()[1])

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

store = open_store(url)
head = Manifest.parse(store.read_manifest().data).head
# The cold sync reaches `cold_to` through a manifest trimmed there: a reader of the real head would take it all.
import relay.watcher as wmod
real = wmod.Reader.read_manifest
def upto(self, limit=[cold_to]):
    m = real(self)
    return m if limit[0] is None else _trim(m, limit[0])
def _trim(m, step):
    import dataclasses
    steps = [s for s in m.steps if s.step <= step]
    snaps = [s for s in m.snapshots if s.step <= step]
    return dataclasses.replace(m, steps=steps, snapshots=snaps, head=step)
wmod.Reader.read_manifest = upto
w = Watcher(url, dest, persist=persist, compact_fraction=1e9, compact_steps=10**9)
t0 = time.perf_counter()
w0 = io_written()
assert w.sync() == cold_to
cold = {"cold_s": time.perf_counter() - t0, "cold_hwm": hwm(), "cold_written": io_written() - w0}
model = sum(t.numel() * t.element_size() for t in w.tensors.values())
steps = []
for step in range(cold_to + 1, head + 1):
    upto.__defaults__[0][0] = step
    w0, t0 = io_written(), time.perf_counter()
    assert w.sync() == step
    steps.append({"s": time.perf_counter() - t0, "written": io_written() - w0})
m = Manifest.parse(store.read_manifest().data)
delta = [m.step(s).delta_bytes for s in range(cold_to + 1, head + 1)]
w.close()
print(json.dumps({"model": model, **cold, "steps": steps, "delta_bytes": delta}))
'''


def synthetic(n: int, numel: int, seed: int):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    return {f"layers.{i}.weight": torch.from_numpy(rng.standard_normal(numel, dtype=np.float32) * 0.02)
            .to(torch.bfloat16) for i in range(n)}


def rl_step(state: dict, fraction: float, rng) -> None:
    """~`fraction` of each tensor's elements move by one ULP, in place; small |w| more often (by exponent)."""
    import numpy as np

    from codec.tensors import element_view

    for t in state.values():
        bits = element_view(t)
        cand = rng.integers(0, bits.size, int(2 * fraction * bits.size))
        e = ((bits[cand] >> 7) & 0xFF).astype(np.int32)
        keep = rng.random(cand.size) < np.clip(0.5 * 2.0 ** ((np.median(e) - e) / 2.0), 0, 1)
        pos = np.unique(cand[keep])
        up = rng.random(pos.size) < 0.5
        b = bits[pos].astype(np.int32) + np.where(up, 1, -1)
        bits[pos] = np.where((b & 0x7F80) == 0x7F80, bits[pos], b).astype(np.uint16)  # stay finite


def publish(url: str, n: int, mib: int, steps: int) -> None:
    import numpy as np

    from relay.publisher import Publisher

    state = synthetic(n, mib << 19, 0)
    rng = np.random.default_rng(1)
    with Publisher(url, snapshot_every=10**6, snapshot_fraction=1e9, background=False) as pub:
        pub.publish(state, 0)
        for step in range(1, steps + 1):
            rl_step(state, 0.01, rng)
            pub.publish(state, step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256, help="MiB per tensor")
    ap.add_argument("--steps", type=int, default=8, help="deltas published (3 for the cold sync, the rest followed)")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--modes", default="full,journal")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    store = args.workdir / "store"
    url = f"file://{store}"
    if not (store / "manifest.json").exists():
        t0 = time.perf_counter()
        publish(url, args.tensors, args.mib, args.steps)
        print(json.dumps({"published_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for mode in args.modes.split(","):
        dest = args.workdir / f"dest-{mode}"
        shutil.rmtree(dest, ignore_errors=True)
        out = subprocess.run([sys.executable, "-c", CHILD, url, str(dest), mode, "3"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        times = [s["s"] for s in r["steps"]]
        written = [s["written"] for s in r["steps"]]
        print(json.dumps({
            "persist": mode, "model_bytes": r["model"], "cold_sync_s": round(r["cold_s"], 2),
            "cold_peak_rss_over_model": round(r["cold_hwm"] / r["model"], 3),
            "cold_written_over_model": round(r["cold_written"] / r["model"], 3),
            "step_s_median": round(statistics.median(times), 3), "step_s": [round(x, 3) for x in times],
            "step_written_median": int(statistics.median(written)),
            "delta_bytes_median": int(statistics.median(r["delta_bytes"])),
            "step_written_over_4x_delta_plus_64MiB": round(
                statistics.median(written) / (4 * statistics.median(r["delta_bytes"]) + (64 << 20)), 3),
        }), flush=True)
        shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
