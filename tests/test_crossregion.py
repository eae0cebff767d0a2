"""Only deltas cross a region boundary (issue #16): the relay in regional-snapshot mode, origin plus 3 regions.

A 60-step run with a snapshot every 10 steps on moto S3 (one server per region). After each region's
bootstrap (the one origin snapshot that crosses) what crosses into it is at most 1.15x the deltas and
records it needs, counted where the bytes move (the relay's writes into the region, its materialiser's
reads from the origin); no `snapshots/` object is ever in a region; fresh watchers in every region start
from the region's own snapshots, bit-exact; a regional snapshot whose content differs from the trainer's
record is refused and the watcher takes another path. A signed run works the same with a relay that
holds no key at all (neither a signing key nor trusted keys).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import relay
from conftest import same_bits
from relay.announce import read_announcement, update_announcement, Announcement
from relay.fanout import Destination, Fanout
from relay.manifest import Manifest, ObjRef
from relay.publisher import Publisher
from relay.signing import generate_keypair
from relay.store import open_store

REGIONS = ("us-west-2", "eu-west-1", "ap-northeast-1")
STEPS = 60
EVERY = 10
# What the CRR rules of infra/replication.tf replicate under a run: everything but snapshots/ (and regional/,
# which is each region's own); tests/test_infra.py checks the Terraform against this list.
CRR_REPLICATED = ("manifest.json", "records/", "deltas/")


def states(steps: int, params: int = 1 << 20, lr: float = 1e-5, seed: int = 0):
    """BF16 states of an RL-like run on FP32 master weights (std 0.02): ~8% of elements change per step, so
    a step's delta (~100 KB) is large next to its manifest entry, as with real models."""
    gen = torch.Generator().manual_seed(seed)
    master = {"a.weight": torch.randn(512, params // 1024, generator=gen) * 0.02,
              "b.weight": torch.randn(512, params // 1024, generator=gen) * 0.02,
              "norm.weight": 1 + 0.01 * torch.randn(512, generator=gen)}
    for step in range(steps):
        if step:
            for t in master.values():
                t.add_(torch.sign(torch.randn(t.shape, generator=gen)), alpha=lr)
        yield {k: v.to(torch.bfloat16) for k, v in master.items()}


def crossed(fan: Fanout) -> dict[str, dict[str, int]]:
    """Per region, bytes that crossed into it by kind: the relay's writes plus its materialiser's origin reads."""
    out = {}
    for name, r in fan.status()["regions"].items():
        w, b = r["bytes_by_kind"], r["bootstrap_bytes_by_kind"]
        out[name] = {k: w[k] + b[k] for k in ("deltas", "records", "snapshots", "manifests", "total")}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_only_deltas_cross_after_bootstrap(moto_regions, tmp_path, caplog, signed):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    origin = moto_regions("us-east-1")
    o_url = f"s3://{origin.new_bucket('origin')}/runs/x"
    dests = []
    for name in REGIONS:
        region = moto_regions(name)
        dests.append(Destination(name, f"s3://{region.new_bucket('region')}/runs/x", region.options))
    private, public, _ = generate_keypair(tmp_path / "keys" / "trainer")
    trusted = [public] if signed else None
    pub = Publisher(o_url, storage_options=origin.options, snapshot_every=EVERY, keep_snapshots=3, background=False,
                    signing_key=private if signed else None)
    # The relay holds no key: no signing key, and not even the trainer's public key.
    fan = Fanout(o_url, dests, source_options=origin.options, poll_interval=0.05, retry_initial=0.05, retry_max=0.5,
                 regional_snapshots=True, workdir=tmp_path / "materialise")
    o_store = open_store(o_url, origin.options)
    origin_snaps: set[int] = set()  # the steps the trainer snapshotted (its policy: about every EVERY steps)
    need: dict[int, int] = {}  # step -> bytes of its record and delta, as the origin manifest gives them
    head = None
    before: dict[str, dict[str, int]] = {}
    for step, state in enumerate(states(STEPS)):
        pub.publish(state, step)
        head = state
        om = Manifest.parse(o_store.read_manifest().data)
        s = om.step(step)
        need[step] = s.record.size + s.delta_bytes
        origin_snaps.update(x.step for x in om.snapshots)
        assert fan.sync_once(timeout=120), fan.status()
        if step == 0:
            before = crossed(fan)  # each region bootstrapped: one origin snapshot crossed into it
            for name, c in before.items():
                assert c["snapshots"] > 0, (name, c)
    pub.close()
    assert len(origin_snaps) >= STEPS // EVERY
    needed = sum(v for k, v in need.items() if k > 0)
    after = crossed(fan)
    for name in REGIONS:
        grew = {k: after[name][k] - before[name][k] for k in after[name]}
        print(f"{name}: after the bootstrap {grew} crossed, {grew['total'] / needed:.3f}x the {needed} bytes of "
              f"deltas and records")
        assert grew["snapshots"] == 0, (name, grew)
        assert grew["total"] <= 1.15 * needed, (name, grew, needed)
        region = open_store(dests[REGIONS.index(name)].url, dests[REGIONS.index(name)].storage_options)
        assert not region.list("snapshots/")  # no origin snapshot was ever copied into a region
        ann, _ = read_announcement(region)
        assert ann is not None
        assert [s.step for s in ann.snapshots] == sorted(origin_snaps)[-2:]
        # a fresh watcher starts from the region's own snapshot (there is no other) and reaches the head
        m, tensors, rec = relay.Reader(region, trusted_keys=trusted).reach(None, None, timeout=60)
        assert rec.step == STEPS - 1 and same_bits(tensors, head)
        assert (m.signatures != ()) == signed

    # A bucket writer replaces the newest regional snapshot with other weights and announces its tags: the
    # fresh watcher refuses it (not the record's content) and starts from the older one, then the chain.
    d = dests[0]
    region = open_store(d.url, d.storage_options)
    ann, _ = read_announcement(region)
    victim = ann.snapshots[-1]
    f = victim.files[0]
    data = bytearray(region.get(f.key))
    data[-64] ^= 0x40  # a tensor element's bits, deep in the data section: same size, valid file
    region.delete([f.key])
    region.put_new(f.key, bytes(data))
    forged = ObjRef.of(f.key, bytes(data), strong=f.sha256 is not None)
    swapped = type(victim)(victim.step, victim.index, (forged, *victim.files[1:]))
    update_announcement(region, lambda cur: Announcement(cur.run, (*cur.snapshots[:-1], swapped)))
    caplog.set_level(logging.WARNING)
    m, tensors, rec = relay.Reader(region, trusted_keys=trusted).reach(None, None, timeout=60)
    assert rec.step == STEPS - 1 and same_bits(tensors, head)
    assert any(f.key in r.getMessage() or f"{victim.step}" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING), [r.getMessage() for r in caplog.records]


def test_crr_mode_without_snapshots_watchers_start_from_regional_snapshots(moto_regions, tmp_path):
    """S3 CRR with rules that skip snapshots/ (the shuffled, late, manifest-first replicator, filtered by the
    prefixes infra/replication.tf replicates) plus a Materialiser in each region: fresh watchers in every
    region reach the head bit-exact from the region's own snapshots; only the bootstrap snapshot crosses."""
    from relay.regional import Materialiser
    from replicator import Replicator

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    east = moto_regions("us-east-1")
    src = east.new_bucket("crr-src")
    run = "runs/crr/"
    prefixes = tuple(run + k for k in CRR_REPLICATED)
    regions, reps, mats, threads = [], [], [], []
    for i, name in enumerate(REGIONS):
        region = moto_regions(name)
        dst = region.new_bucket("crr-dst")
        regions.append((region, dst))
        reps.append(Replicator(east.client(), src, region.client(), dst, seed=i, max_delay=0.02, prefixes=prefixes,
                               run_prefix=run).start())
        mat = Materialiser(f"s3://{dst}/{run}", tmp_path / f"mat-{name}", storage_options=region.options,
                           bootstrap_from=f"s3://{src}/{run}", bootstrap_options=east.options,
                           retry_initial=0.03, retry_max=0.3)
        mats.append(mat)
        threads.append(threading.Thread(target=mat.run, args=(0.05,), daemon=True))
        threads[-1].start()
    steps = 25
    try:
        with Publisher(f"s3://{src}/{run}", storage_options=east.options, snapshot_every=EVERY,
                       background=False) as pub:
            for step, state in enumerate(states(steps, params=1 << 16)):
                pub.publish(state, step)
                head = state
        for rep in reps:
            rep.drain(timeout=60)
        deadline = time.monotonic() + 120
        while not all(m.status()["step"] == steps - 1 and len(m.status()["regional_snapshots"]) == 2 for m in mats):
            assert time.monotonic() < deadline, [m.status() for m in mats]
            time.sleep(0.05)
    finally:
        for mat in mats:
            mat.stop()
        for th in threads:
            th.join(30)
        for rep in reps:
            rep.stop()
    for (region, dst), rep, mat in zip(regions, reps, mats):
        store = open_store(f"s3://{dst}/{run}", region.options)
        assert not store.list("snapshots/")  # the rules never replicate the trainer's snapshots
        assert rep.traffic.bytes()["snapshots"] == 0 and rep.manifest_ahead >= 1  # out of order, manifest first
        assert mat.status()["bootstraps"] == 1  # the one origin snapshot that crossed
        m, tensors, rec = relay.Reader(store, retry_initial=0.03, retry_max=0.3).reach(None, None, timeout=60)
        assert rec.step == steps - 1 and same_bits(tensors, head)
