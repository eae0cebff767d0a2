#!/usr/bin/env python3
"""Fan-out benchmark: how fast each step reaches every rollout host, and what crosses region boundaries.

Four designs move the same published steps to M regions of K hosts each:

  deltarelay   the trainer publishes deltas (a snapshot every --snapshot-every steps) to the origin; one
               relay per region, in that region, copies each delta and record across once and never a
               snapshot: the region builds its own (`relay --regional-snapshots`), after one bootstrap
               snapshot; hosts read their region's store
  fireworks    the same relays copying every origin snapshot too, with the trainer snapshotting every
               --fireworks-every steps: a full snapshot shipped to every region every 25 steps, deltas
               between (Fireworks' policy)
  naive-full   every host pulls the newest full checkpoint from the origin, over its region's link
  naive-delta  every host pulls the deltas (and the first snapshot) from the origin, over its region's link

Links are emulated by a throttling wrapper around the store (ThrottledStore): a shared FIFO pipe per
cross-region link (every host of a region shares its region's link, as in a real deployment where
the region's egress is the bottleneck) with a bandwidth and a round-trip latency per request, and
one faster pipe per host inside a region. Stores are in memory, so the emulated links are the only
cost besides CPU. The weights are synthetic BF16 tensors stepped the way an RL trainer with AdamW
moves them (an update of about lr per element on FP32 master weights, ~1% of BF16 elements change).

    python scripts/bench_fanout.py --steps 10 --regions 3 --watchers 4

Prints a table per design and region: cold start (step 0), median and p90 publish-to-applied time of
steps 1..N (publish commit -> host holds a verified step >= it), and the bytes that crossed regions,
split by kind (deltas, records, snapshots, manifests: relay.traffic) as counted on each region's link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relay.fanout import Destination, Fanout
from relay.publisher import Publisher
from relay.store import ManifestRead, Store, open_store
from relay.traffic import Traffic, split
from relay.watcher import Reader

REGION_NAMES = ("us-west-2", "eu-west-1", "ap-northeast-1", "us-east-2", "eu-central-1")


class Link:
    """A shared pipe: requests queue FIFO at `bandwidth` bytes/s and each also waits one round trip."""

    def __init__(self, name: str, bandwidth: float, latency: float) -> None:
        self.name, self.bandwidth, self.latency = name, bandwidth, latency
        self.bytes = 0
        self.requests = 0
        self.traffic = Traffic()  # bytes by kind of key
        self._free_at = 0.0
        self._lock = threading.Lock()

    def transfer(self, n: int, key: str = "") -> None:
        self.traffic.add(key, n)
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / self.bandwidth
            done = self._free_at
            self.bytes += n
            self.requests += 1
        time.sleep(max(0.0, done - time.monotonic()) + self.latency)


class ThrottledStore(Store):
    """A store seen through a Link: every request pays the link's latency, every byte its bandwidth."""

    def __init__(self, inner: Store, link: Link) -> None:
        self.inner, self.link, self.url = inner, link, inner.url

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.link.transfer(len(data), key)
        return data

    def put_new(self, key: str, data: bytes) -> None:
        self.link.transfer(len(data), key)
        self.inner.put_new(key, data)

    def delete(self, keys: list[str]) -> None:
        self.link.transfer(0)
        self.inner.delete(keys)

    def list(self, prefix: str) -> dict[str, int]:
        self.link.transfer(0)
        return self.inner.list(prefix)

    def read_object(self, key: str, if_none_match: str | None = None):
        got = self.inner.read_object(key, if_none_match)
        self.link.transfer(len(got.data) if isinstance(got, ManifestRead) else 0, key)
        return got

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        self.link.transfer(len(data), key)
        return self.inner.commit_object(key, data, expected_etag)


def make_states(params: int, steps: int, lr: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """steps+1 BF16 states: pretrained-like weights (std 0.02) moved by lr per element per step (FP32 master)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1024, params // 4096), (1024, params // 4096), (2048, params // 4096)]
    master = {f"layer{i}.weight": torch.randn(s, generator=gen) * 0.02 for i, s in enumerate(shapes)}
    master["norm.weight"] = 1 + 0.01 * torch.randn(1024, generator=gen)
    out = []
    for step in range(steps + 1):
        if step:
            for t in master.values():  # Adam's normalised update: about lr in magnitude, random sign
                t.add_(torch.sign(torch.randn(t.shape, generator=gen)), alpha=lr)
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


@dataclass
class Host:
    region: str
    reader: Reader
    full: bool = False  # pull the newest full checkpoint every time, never a delta
    held_step: int | None = None
    held: dict | None = None
    applied: dict[int, float] = field(default_factory=dict)  # step -> monotonic time it was first covered
    error: str | None = None


def host_loop(h: Host, stop: threading.Event, poll: float, last_step: int) -> None:
    try:
        while not stop.is_set():
            if h.full:
                m = h.reader.read_manifest()
                if m is None or (h.held_step is not None and m.head <= h.held_step):
                    stop.wait(poll)
                    continue
                _, tensors, rec = h.reader.reach(None, None)  # nothing held: the plan is a snapshot
            else:
                _, tensors, rec = h.reader.reach(h.held_step, h.held)
            if tensors is not None:
                now = time.monotonic()
                start = -1 if h.held_step is None else h.held_step
                for s in range(start + 1, rec.step + 1):
                    h.applied[s] = now
                h.held_step, h.held = rec.step, tensors
                if rec.step >= last_step:
                    return
            else:
                stop.wait(poll)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        h.error = f"{type(exc).__name__}: {exc}"


def run_design(design: str, states: list[dict], regions: list[str], watchers: int, cross: dict[str, tuple],
               local: tuple, interval: float, poll: float, drain: float, snapshot_every: int = 10,
               fireworks_every: int = 25) -> dict:
    """Publish every state at `interval`, deliver it by `design`, return per-host timings and link bytes."""
    tag = uuid.uuid4().hex[:8]
    origin = open_store(f"memory://bench-{tag}/origin/run")
    links = {r: Link(f"cross-{r}", *cross[r]) for r in regions}
    hosts: list[Host] = []
    fans: list[Fanout] = []
    spool = tempfile.TemporaryDirectory(prefix="bench-fanout-")
    if design in ("deltarelay", "fireworks"):
        for r in regions:
            regional = open_store(f"memory://bench-{tag}/{r}/run")
            # the relay runs in its region: it reads the origin over the region's link, writes locally
            fans.append(Fanout(ThrottledStore(origin, links[r]), [Destination(r, regional.url, store=regional)],
                               poll_interval=poll, retry_initial=poll, retry_max=1.0,
                               regional_snapshots=design == "deltarelay", workdir=f"{spool.name}/{r}"))
            for i in range(watchers):
                hosts.append(Host(r, Reader(ThrottledStore(regional, Link(f"{r}-{i}", *local)), retry_initial=poll,
                                            retry_max=poll * 4)))
    every = {"naive-full": 1, "fireworks": fireworks_every, "deltarelay": snapshot_every}.get(design, 10 ** 6)
    pub = Publisher(origin.url, snapshot_every=every, background=False)
    stop = threading.Event()
    last = len(states) - 1
    threads = [threading.Thread(target=host_loop, args=(h, stop, poll, last), daemon=True) for h in hosts]
    fan_threads = [threading.Thread(target=fan.run, daemon=True) for fan in fans]
    for th in threads + fan_threads:
        th.start()
    published: dict[int, float] = {}
    publish_s = []
    next_at = time.monotonic()
    for step, state in enumerate(states):
        time.sleep(max(0.0, next_at - time.monotonic()))
        t0 = time.monotonic()
        pub.publish(state, step)
        published[step] = time.monotonic()
        publish_s.append(published[step] - t0)
        next_at = t0 + interval
    deadline = time.monotonic() + drain
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    for fan in fans:
        fan.stop()
    for th in fan_threads:
        th.join(30)
    pub.close()
    spool.cleanup()
    out = {"design": design, "regions": {}, "publish_s": statistics.median(publish_s[1:] or publish_s)}
    for r in regions:
        rh = [h for h in hosts if h.region == r]
        cold = [h.applied[0] - published[0] for h in rh if 0 in h.applied]
        warm = sorted(h.applied[s] - published[s] for h in rh for s in range(1, last + 1) if s in h.applied)
        missing = sum(1 for h in rh for s in range(last + 1) if s not in h.applied)
        out["regions"][r] = {
            "cold_s": statistics.median(cold) if cold else None,
            "median_s": statistics.median(warm) if warm else None,
            "p90_s": warm[min(len(warm) - 1, int(0.9 * len(warm)))] if warm else None,
            "cross_bytes": links[r].bytes, "missing": missing, "by_kind": split(links[r].traffic.bytes()),
            "errors": [h.error for h in rh if h.error],
        }
    out["cross_bytes"] = sum(link.bytes for link in links.values())
    return out


def format_table(results: list[dict], meta: dict) -> str:
    lines = [f"bench_fanout: {meta['steps']} steps after step 0, every {meta['interval']:g}s; "
             f"{len(meta['regions'])} regions x {meta['watchers']} hosts; model {meta['full_bytes'] / 1e6:.1f} MB BF16 "
             f"({meta['params'] / 1e6:.1f}M params), mean delta {meta['mean_delta'] / 1e3:.1f} KB",
             "links: " + "; ".join(f"{r} {bw / 1e6:g} MB/s {lat * 1e3:g} ms" for r, (bw, lat) in meta["cross"].items())
             + f"; in-region per host {meta['local'][0] / 1e6:g} MB/s {meta['local'][1] * 1e3:g} ms",
             "publish-to-applied: publish commit -> host holds a verified step >= it (medians over hosts and steps)",
             "",
             f"{'design':12} {'region':15} {'step 0 s':>9} {'median s':>9} {'p90 s':>8} {'cross-region':>13} {'notes'}"]

    def f(v):
        return "     -" if v is None else f"{v:9.2f}"

    for res in results:
        for r, v in res["regions"].items():
            notes = []
            if v["missing"]:
                notes.append(f"{v['missing']} host-steps never applied")
            if v["errors"]:
                notes.append(v["errors"][0][:60])
            lines.append(f"{res['design']:12} {r:15} {f(v['cold_s'])} {f(v['median_s'])} {f(v['p90_s'])[1:]} "
                         f"{v['cross_bytes'] / 1e6:10.2f} MB {'; '.join(notes)}")
        lines.append(f"{res['design']:12} {'all regions':15} {'':9} {'':9} {'':8} {res['cross_bytes'] / 1e6:10.2f} MB")
    lines += ["", "cross-region bytes by kind, per region (MB)",
              f"{'design':12} {'region':15} {'deltas':>9} {'records':>9} {'manifests':>9} {'snapshots':>10}"
              f" {'total':>9}"]
    for res in results:
        for r, v in res["regions"].items():
            k = v["by_kind"]
            lines.append(f"{res['design']:12} {r:15} " + " ".join(
                f"{k[c] / 1e6:{w}.3f}" for c, w in (("deltas", 9), ("records", 9), ("manifests", 9),
                                                     ("snapshots", 10), ("total", 9))))
    base = next((r["cross_bytes"] for r in results if r["design"] == "deltarelay"), None)
    if base:
        lines.append("")
        lines.append("cross-region bytes relative to deltarelay: " + ", ".join(
            f"{r['design']} {r['cross_bytes'] / base:.1f}x" for r in results))
    return "\n".join(lines)


def parse_list(text: str, n: int, scale: float) -> list[float]:
    vals = [float(x) * scale for x in text.split(",")]
    return [vals[i % len(vals)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="steps after the first (step 0 is the cold start)")
    p.add_argument("--regions", type=int, default=3)
    p.add_argument("--watchers", type=int, default=4, help="hosts per region")
    p.add_argument("--params", type=float, default=4e6, help="model size in parameters (BF16)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between published steps")
    p.add_argument("--cross-mbps", default="8,5,3", help="MB/s of each region's link to the origin (comma list)")
    p.add_argument("--cross-latency-ms", default="70,90,160", help="round trip per request, per region (ms)")
    p.add_argument("--local-mbps", type=float, default=100.0, help="MB/s of each host's link to its region's store")
    p.add_argument("--local-latency-ms", type=float, default=5.0)
    p.add_argument("--poll", type=float, default=0.05, help="manifest poll interval of relays and hosts")
    p.add_argument("--drain", type=float, default=120.0, help="seconds to wait for the last step after publishing")
    p.add_argument("--designs", default="deltarelay,fireworks,naive-delta,naive-full")
    p.add_argument("--snapshot-every", type=int, default=10, help="the deltarelay trainer's snapshot interval")
    p.add_argument("--fireworks-every", type=int, default=25, help="full snapshot interval of the fireworks design")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if not 1 <= a.regions <= len(REGION_NAMES):
        raise SystemExit(f"--regions must be 1..{len(REGION_NAMES)}")
    regions = list(REGION_NAMES[: a.regions])
    bws = parse_list(a.cross_mbps, a.regions, 1e6)
    lats = parse_list(a.cross_latency_ms, a.regions, 1e-3)
    cross = {r: (bws[i], lats[i]) for i, r in enumerate(regions)}
    local = (a.local_mbps * 1e6, a.local_latency_ms * 1e-3)
    states = make_states(int(a.params), a.steps, a.lr, a.seed)
    import codec

    deltas = [len(codec.encode(states[i], states[i + 1])) for i in range(min(3, a.steps))]
    meta = {"steps": a.steps, "interval": a.interval, "regions": regions, "watchers": a.watchers,
            "params": sum(t.numel() for t in states[0].values()),
            "full_bytes": sum(t.numel() * 2 for t in states[0].values()), "mean_delta": statistics.fmean(deltas),
            "cross": cross, "local": local}
    results = []
    for design in a.designs.split(","):
        print(f"running {design} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        results.append(run_design(design, states, regions, a.watchers, cross, local, a.interval, a.poll, a.drain,
                                  a.snapshot_every, a.fireworks_every))
        print(f"  {design}: {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    print(format_table(results, meta))
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": {**meta, "cross": {r: list(v) for r, v in cross.items()}},
                                            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
