"""The regional relay (relay/fanout.py, `deltarelay relay`): what each region ends up holding, in what order
it is written, and what happens when the relay crashes, an origin object is damaged or a region is down."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


import relay
from relay import cli
from relay.fanout import Destination, Fanout
from relay.manifest import Manifest
from relay.store import LocalStore, Store, open_store

ROOT = Path(__file__).resolve().parents[1]
FAST = {"poll_interval": 0.02, "retry_initial": 0.02, "retry_max": 0.2}


def fast_fail(options: dict) -> dict:
    """s3fs options that give up on an unreachable endpoint in a second instead of retrying for many."""
    return {**options, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}}


def regional_manifest(store: Store) -> Manifest | None:
    got = store.read_manifest()
    return None if got is None else Manifest.parse(got.data)


def assert_complete(store: Store) -> Manifest | None:
    """The protocol's promise to readers: every object the manifest names is there, with its size."""
    m = regional_manifest(store)
    if m is not None:
        listed = {}
        for prefix in ("deltas/", "records/", "snapshots/"):
            listed.update(store.list(prefix))
        for s in m.steps:
            refs = [s.record, *(p.ref for p in s.parts or ())]
            for ref in refs:
                assert listed.get(ref.key) == ref.size, f"{store.url}: manifest names {ref.key}, store lacks it"
        for snap in m.snapshots:
            for ref in (snap.index, *snap.files):
                assert listed.get(ref.key) == ref.size, f"{store.url}: manifest names {ref.key}, store lacks it"
    return m


class Crashing(LocalStore):
    """A real local store that dies after `budget` writes, and checks every manifest commit it sees."""

    def __init__(self, url: str, root: str, budget: int) -> None:
        super().__init__(url, root)
        self.budget = budget
        self.violations: list[str] = []  # recorded here too: the relay's worker would only log the raise

    def _spend(self) -> None:
        if self.budget <= 0:
            raise RuntimeError("injected crash")
        self.budget -= 1

    def put_new(self, key: str, data: bytes) -> None:
        self._spend()
        super().put_new(key, data)

    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        self._spend()
        m = Manifest.parse(data)
        missing = [k for k in m.referenced() if not self._path(k).is_file()]
        if missing:  # objects must come before the manifest that names them
            self.violations.append(f"manifest commit names {missing}, not written yet")
            raise AssertionError(self.violations[-1])
        return super().commit_manifest(data, expected_etag)


def publish_steps(pub: relay.Publisher, t, steps) -> None:
    for step in steps:
        pub.publish(t.step(), step)


def test_mirrors_into_s3_and_file_regions_seeded_from_the_newest_snapshot(moto_regions, trainer, bits_equal,
                                                                           tmp_path):
    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    origin = f"s3://{east.new_bucket('origin')}/runs/r1"
    s3_dest = f"s3://{west.new_bucket('west')}/runs/r1"
    file_dest = f"file://{tmp_path}/ap/runs/r1"
    t = trainer(seed=40)
    pub = relay.Publisher(origin, storage_options=east.options, snapshot_every=3, background=False)
    publish_steps(pub, t, range(7))
    fan = Fanout(origin, [Destination("eu-west-1", s3_dest, west.options), Destination("ap", file_dest)],
                 source_options=east.options, **FAST)
    assert fan.sync_once(timeout=30)

    om = regional_manifest(open_store(origin, east.options))
    total_origin = sum(r.size for s in om.steps for r in [s.record, *(p.ref for p in s.parts or ())])
    total_origin += sum(snap.bytes for snap in om.snapshots)
    for url, opts in ((s3_dest, west.options), (file_dest, None)):
        m = assert_complete(open_store(url, opts))
        assert m.run == om.run and m.head == 6
        assert [s.step for s in m.snapshots] == [6]  # a fresh region starts at the origin's newest snapshot
        w = relay.Watcher(url, tmp_path / f"w-{len(url)}", storage_options=opts)
        assert w.sync() == 6 and bits_equal(w.tensors, t.state())
    st = fan.status()
    assert st["origin"]["head"] == 6
    for r in st["regions"].values():
        assert r["head"] == 6 and r["lag_steps"] == 0 and r["lag_seconds"] == 0 and r["errors"] == 0
        assert 0 < r["bytes_copied"] < total_origin  # history before the newest snapshot never crossed
    # Each object crossed the origin's egress once even though two regions received it.
    assert st["source_bytes_read"] == st["regions"]["ap"]["bytes_copied"]

    publish_steps(pub, t, range(7, 11))
    before = {k: v["bytes_copied"] for k, v in st["regions"].items()}
    assert fan.sync_once(timeout=30)
    st = fan.status()
    for r in st["regions"].values():
        assert r["head"] == 10
        assert r["delays"] and all(d >= 0 for _, d in r["delays"])
    m = assert_complete(open_store(s3_dest, west.options))
    assert [s.step for s in m.snapshots] == [6, 9] and m.step(7).parent == 6
    grown = st["regions"]["ap"]["bytes_copied"] - before["ap"]
    assert grown == sum(r.size for s in m.steps if s.step > 6 for r in [s.record, *(p.ref for p in s.parts)]) + \
        m.snapshot(9).bytes  # exactly what was new: deltas, records and the new snapshot

    again = Fanout(origin, [Destination("eu-west-1", s3_dest, west.options), Destination("ap", file_dest)],
                   source_options=east.options, **FAST)
    assert again.sync_once(timeout=30)  # a restarted relay finds everything in place
    assert all(r["bytes_copied"] == 0 for r in again.status()["regions"].values())
    w = relay.Watcher(file_dest, tmp_path / "late", storage_options=None)
    assert w.sync() == 10 and bits_equal(w.tensors, t.state())


def test_a_crash_at_any_write_leaves_a_consistent_region_and_a_restart_converges(trainer, bits_equal, tmp_path):
    origin = f"file://{tmp_path}/origin/run"
    t = trainer(seed=41)
    pub = relay.Publisher(origin, snapshot_every=3, background=False)
    publish_steps(pub, t, range(2))
    root = tmp_path / "region"
    url = f"file://{root}/run"
    # A first relay brings the region to step 1; then the origin moves on to step 7 (two more snapshots).
    assert Fanout(origin, [Destination("r", url)], **FAST).sync_once(timeout=10)
    publish_steps(pub, t, range(2, 8))
    seed = tmp_path / "seed"
    shutil.copytree(root, seed)

    writes = 0
    while True:  # crash after 0, 1, 2, ... writes, each time from the same starting point
        shutil.rmtree(root)
        shutil.copytree(seed, root)
        store = Crashing(url, str(root / "run"), budget=writes)
        fan = Fanout(origin, [Destination("r", url, store=store)], **FAST)
        assert fan.poll_source()
        try:
            finished = fan.sync_region(fan.regions["r"])
        except RuntimeError as exc:
            assert "injected crash" in str(exc)
            finished = False
        assert not store.violations
        m = assert_complete(LocalStore(url, str(root / "run")))
        assert m is not None and m.head in (1, 7)
        # restart with no crash: converges from whatever the crash left
        store2 = Crashing(url, str(root / "run"), budget=10 ** 6)
        assert Fanout(origin, [Destination("r", url, store=store2)], **FAST).sync_once(timeout=10)
        m = assert_complete(store2)
        assert not store2.violations and m.head == 7 and [s.step for s in m.snapshots] == [0, 3, 6]
        w = relay.Watcher(url, tmp_path / f"w{writes}")
        assert w.sync() == 7 and bits_equal(w.tensors, t.state())
        if finished:
            break
        writes += 1
    assert writes > 8  # the loop really crashed between objects and between the two commits


def test_damaged_origin_object_is_never_copied(trainer, bits_equal, tmp_path, caplog):
    origin = f"file://{tmp_path}/origin/run"
    t = trainer(seed=42)
    pub = relay.Publisher(origin, snapshot_every=100, background=False)
    publish_steps(pub, t, range(3))
    dest = f"file://{tmp_path}/region/run"
    assert Fanout(origin, [Destination("r", dest)], **FAST).sync_once(timeout=10)
    publish_steps(pub, t, range(3, 5))
    path = tmp_path / "origin/run/deltas/4-0.drd"
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))

    fan = Fanout(origin, [Destination("r", dest)], **FAST)
    assert not fan.sync_once(timeout=0.5)
    r = fan.status()["regions"]["r"]
    assert r["head"] == 2 and r["errors"] >= 1 and "deltas/4-0.drd" in r["last_error"]
    assert not (tmp_path / "region/run/deltas/4-0.drd").exists()
    assert assert_complete(open_store(dest)).head == 2  # the region keeps its last consistent step
    assert "does not match the origin manifest" in caplog.text

    path.write_bytes(good)
    assert Fanout(origin, [Destination("r", dest)], **FAST).sync_once(timeout=10)
    w = relay.Watcher(dest, tmp_path / "w")
    assert w.sync() == 4 and bits_equal(w.tensors, t.state())


def test_an_unreachable_region_does_not_stall_the_others(moto_regions, trainer, bits_equal, tmp_path):
    from conftest import free_port

    east = moto_regions("us-east-1")
    origin = f"s3://{east.new_bucket('origin')}/run"
    t = trainer(seed=43)
    with relay.Publisher(origin, storage_options=east.options, snapshot_every=100) as pub:
        publish_steps(pub, t, range(4))
    dead = fast_fail({"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing"})
    good = f"file://{tmp_path}/good/run"
    fan = Fanout(origin, [Destination("down", "s3://nowhere/run", dead), Destination("up", good)],
                 source_options=east.options, **FAST)
    started = time.monotonic()
    assert not fan.sync_once(timeout=3)
    assert time.monotonic() - started < 15
    st = fan.status()["regions"]
    assert st["up"]["head"] == 3 and st["up"]["lag_steps"] == 0 and st["up"]["errors"] == 0
    assert st["down"]["head"] is None and st["down"]["failures"] >= 1 and st["down"]["last_error"]
    assert st["down"]["lag_seconds"] is not None and st["down"]["lag_seconds"] > 0
    w = relay.Watcher(good, tmp_path / "w")
    assert w.sync() == 3 and bits_equal(w.tensors, t.state())


def test_origin_rebase_and_gc_reach_the_region(trainer, bits_equal, tmp_path):
    origin = f"file://{tmp_path}/origin/run"
    dest = f"file://{tmp_path}/region/run"
    t = trainer(seed=44)
    pub = relay.Publisher(origin, snapshot_every=100, background=False)
    publish_steps(pub, t, range(3))
    fan = Fanout(origin, [Destination("r", dest)], **FAST)
    assert fan.sync_once(timeout=10)
    old = relay.Watcher(dest, tmp_path / "old")
    assert old.sync() == 2
    publish_steps(pub, t, range(3, 6))
    relay.rebase(origin)
    publish_steps(pub, t, range(6, 8))
    assert fan.sync_once(timeout=10)
    m = assert_complete(open_store(dest))
    assert [s.step for s in m.snapshots] == [0, 5] and m.head == 7
    assert old.sync() == 7 and bits_equal(old.tensors, t.state())  # the chain, not the snapshot
    relay.gc(origin, keep_snapshots=1)
    publish_steps(pub, t, range(8, 9))
    assert fan.sync_once(timeout=10)
    m = assert_complete(open_store(dest))
    assert [s.step for s in m.snapshots] == [5] and m.steps[0].step == 5 and m.steps[0].parent is None
    fresh = relay.Watcher(dest, tmp_path / "fresh")
    assert fresh.sync() == 8 and bits_equal(fresh.tensors, t.state())


def test_emptied_region_is_reseeded_while_running(trainer, bits_equal, tmp_path):
    import threading

    origin = f"file://{tmp_path}/origin/run"
    root = tmp_path / "region"
    dest = f"file://{root}/run"
    t = trainer(seed=45)
    pub = relay.Publisher(origin, snapshot_every=2, background=False)
    publish_steps(pub, t, range(3))
    fan = Fanout(origin, [Destination("r", dest)], recheck_interval=0.1, **FAST)
    th = threading.Thread(target=fan.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while fan.status()["regions"]["r"]["head"] != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        shutil.rmtree(root)  # the bucket was lost and recreated empty; the origin is idle meanwhile
        while not (root / "run/manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        m = assert_complete(open_store(dest))
        assert m.head == 2 and [s.step for s in m.snapshots] == [2]
    finally:
        fan.stop()
        th.join(10)
    w = relay.Watcher(dest, tmp_path / "w")
    assert w.sync() == 2 and bits_equal(w.tensors, t.state())


def test_cli_config_file_once_and_status_file(moto_regions, trainer, bits_equal, tmp_path, capsys):
    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    origin = f"s3://{east.new_bucket('origin')}/run"
    west_url = f"s3://{west.new_bucket('west')}/run"
    t = trainer(seed=46)
    with relay.Publisher(origin, storage_options=east.options) as pub:
        publish_steps(pub, t, range(3))
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f"""
[source]
url = "{origin}"
storage_options = {{ endpoint_url = "{east.endpoint}", key = "testing", secret = "testing" }}

[[dest]]
name = "eu-west-1"
url = "{west_url}"
storage_options = {{ endpoint_url = "{west.endpoint}", key = "testing", secret = "testing" }}

[[dest]]
url = "file://{tmp_path}/local/run"
""")
    status = tmp_path / "status.json"
    assert cli.main(["relay", "--config", str(cfg), "--once", "--timeout", "30", "--poll-interval", "0.05",
                     "--status-file", str(status)]) == 0
    out = capsys.readouterr().out
    assert "eu-west-1" in out and "local" in out and out.count(" ok ") == 2
    doc = json.loads(status.read_text())
    assert doc["origin"]["head"] == 2 and set(doc["regions"]) == {"eu-west-1", f"file://{tmp_path}/local/run"}
    assert all(r["head"] == 2 and r["bytes_copied"] > 0 for r in doc["regions"].values())
    w = relay.Watcher(west_url, tmp_path / "w", storage_options=west.options)
    assert w.sync() == 2 and bits_equal(w.tensors, t.state())

    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\nurl = "file:///x"\n[[dest]]\nurl = "file:///y"\nregion = "eu"\n')
    assert cli.main(["relay", "--config", str(bad), "--once"]) == 1
    assert "dest[0]: unknown field(s) ['region']" in capsys.readouterr().err
    assert cli.main(["relay", "--source", origin, "--once"]) == 1
    assert "--dest" in capsys.readouterr().err


def test_cli_subprocess_per_url_options_and_exit_code(moto_regions, trainer, tmp_path):
    east = moto_regions("us-east-1")
    origin = f"s3://{east.new_bucket('origin')}/run"
    with relay.Publisher(origin, storage_options=east.options) as pub:
        publish_steps(pub, trainer(seed=47), range(2))
    from conftest import free_port

    dead = fast_fail({"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing"})
    cmd = [sys.executable, "-m", "relay.cli", "relay", "--source", origin, "--poll-interval", "0.05", "--once",
           "--dest", f"file://{tmp_path}/b/run", "--dest", "s3://gone/run",
           "--storage-options", json.dumps(east.options),
           "--storage-options", "{}", "--storage-options", json.dumps(dead), "--timeout", "3"]
    failed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2, failed.stderr
    assert "not every destination reached step 1 within 3s" in failed.stderr
    lines = {line.split()[0]: line for line in failed.stdout.splitlines()}
    assert " ok " in lines[f"file://{tmp_path}/b/run"] and "BEHIND" in lines["gone"]
    assert (tmp_path / "b/run/manifest.json").exists()  # the reachable region got there anyway


def test_two_relays_on_one_region_agree(trainer, bits_equal, tmp_path):
    import threading

    origin = f"file://{tmp_path}/origin/run"
    dest = f"file://{tmp_path}/region/run"
    t = trainer(seed=48)
    pub = relay.Publisher(origin, snapshot_every=3, background=False)
    publish_steps(pub, t, range(8))
    fans = [Fanout(origin, [Destination("r", dest)], **FAST) for _ in range(2)]
    results = []
    threads = [threading.Thread(target=lambda f=f: results.append(f.sync_once(timeout=20))) for f in fans]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert results == [True, True]  # create-only objects and a compare-and-swap manifest: no loser corrupts
    m = assert_complete(open_store(dest))
    assert m.head == 7 and [s.step for s in m.snapshots] == [6]
    w = relay.Watcher(dest, tmp_path / "w")
    assert w.sync() == 7 and bits_equal(w.tensors, t.state())
