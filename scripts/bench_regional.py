#!/usr/bin/env python
"""Cross-region bytes with regional snapshots (PROTOCOL §8.1) against shipping the trainer's snapshots.

    python scripts/bench_regional.py [--steps 60] [--snapshot-every 10] [--regions 3] [--mib 16] [--keep-snapshots K]

An origin run and N regions (file:// stores) filled as S3 CRR with a `snapshots/` prefix filter fills
them: every delta, record and manifest version crosses, the trainer's snapshots do not; a
materialiser per region bootstraps once from the origin and then builds the region's snapshots from
its chain. For every region the script counts the bytes that crossed after the bootstrap, split into
deltas, records, manifests and snapshots, and prints their ratio to the deltas and records the region
needs; beside it the same run with the trainer's snapshots shipped too (what a Fireworks-style policy,
a full snapshot to every region every N steps, costs). At the end a fresh watcher per region starts
from the region's newest snapshot and is checked bit-exact against the trainer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import relay  # noqa: E402
from codec.tensors import same_bits  # noqa: E402
from relay.store import open_store  # noqa: E402


def model(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // 2)
    return {f"layer.{i}.weight": torch.randn(1024, 512, generator=g).to(torch.bfloat16) for i in range(n)}


def step(state: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """An RL-like update: ~1% of elements move by about one BF16 ULP."""
    out = {}
    for k, t in state.items():
        mask = torch.rand(t.shape, generator=g) < 0.01
        nt = t.clone()
        nt[mask] = (t.float()[mask] * 1.01).to(torch.bfloat16)
        out[k] = nt
    return out


class Crossing:
    """What crosses into one region, by kind."""

    def __init__(self) -> None:
        self.bytes = {"deltas": 0, "records": 0, "manifests": 0, "snapshots": 0}

    def add(self, key: str, n: int) -> None:
        kind = "manifests" if key == "manifest.json" else key.split("/")[0]
        self.bytes[kind] += n


def replicate(src, dst, seen: set[str], crossing: Crossing, snapshots: bool) -> None:
    for key in sorted(src.list_run()):
        if key in seen or (key.startswith("snapshots/") and not snapshots):
            continue
        data = src.get(key)
        dst.put_immutable(key, data)
        seen.add(key)
        crossing.add(key, len(data))
    got, cur = src.read_manifest(), dst.read_manifest()
    if cur is None or cur.data != got.data:
        dst.commit_manifest(got.data, None if cur is None else cur.etag)
        crossing.add("manifest.json", len(got.data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--keep-snapshots", type=int, default=None,
                    help="the publisher's keep_snapshots (bounds the manifest, which crosses at every step)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-regional-") as tmp:  # ~300 MB a run: never left behind
        return run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> int:
    origin = f"file://{tmp}/origin"
    names = [f"region-{i}" for i in range(args.regions)]
    src = open_store(origin)
    dst = {r: open_store(f"file://{tmp}/{r}") for r in names}
    ship = {r: open_store(f"file://{tmp}/{r}-ship") for r in names}  # the same run with snapshots shipped
    seen = {r: set() for r in names}
    seen_ship = {r: set() for r in names}
    after = {r: Crossing() for r in names}  # regional snapshots: what crossed after the bootstrap
    shipped = {r: Crossing() for r in names}
    mats = {r: relay.Materialiser(dst[r], tmp / f"work-{r}", bootstrap_from=src) for r in names}
    g = torch.Generator().manual_seed(1)
    state = model(args.mib)
    bootstrap = {}
    with relay.Publisher(origin, snapshot_every=args.snapshot_every, snapshot_fraction=100.0,
                         background=False, keep_snapshots=args.keep_snapshots) as pub:
        for s in range(args.steps):
            state = state if s == 0 else step(state, g)
            pub.publish(state, s)
            for r in names:
                crossing = after[r] if r in bootstrap else Crossing()
                replicate(src, dst[r], seen[r], crossing, snapshots=False)
                replicate(src, ship[r], seen_ship[r], shipped[r], snapshots=True)
                mats[r].sync_once(timeout=120)
                if r not in bootstrap:
                    bootstrap[r] = mats[r].status()["bootstrap_bytes"]
    rows = {}
    for r in names:
        st = mats[r].status()
        b = after[r].bytes
        need = b["deltas"] + b["records"]
        crossed = sum(b.values()) + st["bootstrap_bytes"] - bootstrap[r]
        s = shipped[r].bytes
        rows[r] = {"after_bootstrap": b, "bootstrap_snapshot_bytes": bootstrap[r],
                   "snapshot_bytes_after_bootstrap": st["bootstrap_bytes"] - bootstrap[r],
                   "x_deltas_and_records": round(crossed / need, 3), "regional_snapshots": st["regional_snapshots"],
                   "shipped_policy": s, "shipped_x_deltas_and_records": round(sum(s.values()) / need, 3)}
        with relay.Watcher(f"file://{tmp}/{r}", tmp / f"dest-{r}") as w:
            rows[r]["fresh_watcher_step"] = w.sync(timeout=60)
            rows[r]["bit_exact"] = same_bits(w.tensors, state)
            rows[r]["fresh_watcher_bytes"] = w.bytes_downloaded
        print(f"{r}: after bootstrap {crossed} bytes cross ({b}), {rows[r]['x_deltas_and_records']}x the deltas "
              f"and records; shipping snapshots: {sum(s.values())} bytes, "
              f"{rows[r]['shipped_x_deltas_and_records']}x; fresh watcher at step {rows[r]['fresh_watcher_step']}, "
              f"bit-exact {rows[r]['bit_exact']}")
    print(json.dumps({"steps": args.steps, "snapshot_every": args.snapshot_every, "model_mib": args.mib,
                      "keep_snapshots": args.keep_snapshots, "regions": rows}))
    return 0 if all(r["bit_exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
