#!/usr/bin/env python
"""Relay benchmark: bytes a watcher downloads to catch up from k steps behind, against a full
snapshot, and the publisher's cost per step.

    python scripts/bench_catchup.py --corpus corpus/minilm-bf16-lr3e-6-long          # existing corpus
    python scripts/bench_catchup.py --make corpus/minilm-bf16-lr3e-6-long --regime bf16-lr3e-6 --steps 24
    python scripts/bench_catchup.py ... --s3        # through a moto S3 server on loopback (HTTP costs)

A corpus is a directory of step_NNNN.safetensors (relay.lab.corpus writes them). The run is
published with snapshots only at the first step (so a catch-up is a pure delta chain); a watcher is
synced at head-k for each k, then brought to the head, and the bytes it fetched are counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import codec  # noqa: E402
import relay  # noqa: E402
from relay import checkpoint  # noqa: E402
from relay.manifest import Manifest  # noqa: E402
from relay.store import open_store  # noqa: E402


def load_corpus(path: Path) -> list[dict]:
    files = sorted(path.glob("step_*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no step_*.safetensors (build one with --make)")
    # private in-memory copies: a trainer publishes from RAM (or GPU), not from mmapped files
    return [{k: v.clone() for k, v in checkpoint.load(f)[0].items()} for f in files]


def make(out: Path, regime: str, steps: int, tiny: bool) -> None:
    from relay.lab.corpus import make_corpus

    make_corpus(out, regime=regime, steps=steps, tiny=tiny, log=print)


def moto_options() -> tuple[dict, object]:
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                 region_name="us-east-1").create_bucket(Bucket="bench")
    return {"endpoint_url": endpoint, "key": "x", "secret": "x", "client_kwargs": {"region_name": "us-east-1"}}, server


def run(states: list[dict], url: str, options: dict | None, ks: list[int], work: Path) -> dict:
    head = len(states) - 1
    ks = [k for k in ks if k <= head]
    watchers = {}
    publish_s, encode_s = [], []
    with relay.Publisher(url, storage_options=options, snapshot_every=10 ** 9, snapshot_fraction=1e9) as pub:
        for step, state in enumerate(states):
            t0 = time.perf_counter()
            pub.publish(state, step)
            dt = time.perf_counter() - t0
            if step:
                publish_s.append(dt)
                t0 = time.perf_counter()
                codec.encode(states[step - 1], state)
                encode_s.append(time.perf_counter() - t0)
            for k in ks:
                if step == head - k:
                    w = relay.Watcher(url, work / f"k{k}", storage_options=options)
                    w.sync()
                    watchers[k] = (w, w.bytes_downloaded)
    m = Manifest.parse(open_store(url, options).read_manifest().data)
    snap = m.snapshots[0]
    full = snap.bytes + m.step(snap.step).record.size
    raw = sum(t.numel() * t.element_size() for t in states[-1].values())
    rows = []
    for k in ks:
        w, before = watchers[k]
        t0 = time.perf_counter()
        assert w.sync() == head
        rows.append({"k": k, "bytes": w.bytes_downloaded - before, "seconds": round(time.perf_counter() - t0, 3)})
    fresh = relay.Watcher(url, work / "fresh", storage_options=options)
    fresh.sync()
    deltas = [m.step(s).delta_bytes for s in range(1, head + 1)]
    return {"url": url.split("://")[0], "steps": head, "checkpoint_bytes": raw, "full_snapshot_bytes": full,
            "delta_bytes_mean": statistics.mean(deltas),
            "catchup": [{**r, "percent_of_snapshot": round(100 * r["bytes"] / full, 3)} for r in rows],
            "fresh_start_bytes": fresh.bytes_downloaded,
            "publish_seconds_median": round(statistics.median(publish_s), 4),
            "encode_seconds_median": round(statistics.median(encode_s), 4),
            "publish_overhead_seconds_median": round(statistics.median(p - e for p, e in zip(publish_s, encode_s)), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, help="directory of step_*.safetensors")
    p.add_argument("--make", type=Path, help="build a corpus here first (relay.lab.corpus)")
    p.add_argument("--regime", default="bf16-lr3e-6")
    p.add_argument("--steps", type=int, default=22, help="steps to build with --make (k=20 needs 20+)")
    p.add_argument("--tiny", action="store_true", help="with --make: the small test model")
    p.add_argument("--k", type=int, nargs="+", default=[1, 5, 20])
    p.add_argument("--s3", action="store_true", help="publish through a moto S3 server on loopback")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (1: tensor copies do not spin against a busy machine)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    corpus = args.make or args.corpus
    if corpus is None:
        p.error("give --corpus or --make")
    if args.make:
        make(args.make, args.regime, args.steps, args.tiny)
    states = load_corpus(corpus)
    server = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.s3:
            options, server = moto_options()
            url = "s3://bench/run"
        else:
            options, url = None, f"file://{tmp}/store/run"
        try:
            result = run(states, url, options, args.k, Path(tmp))
        finally:
            if server is not None:
                server.stop()
    result["corpus"] = str(corpus)
    result["torch_threads"] = args.torch_threads
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
