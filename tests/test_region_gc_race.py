"""A region's gc racing the regional relay that fills it (and the watchers that read it).

gc commits its trimmed manifest by compare-and-swap and deletes only what that manifest no longer names;
the relay copies first and commits by compare-and-swap after. Whatever the interleaving, the regional
manifest never names an object the region lacks, and a watcher there reaches the head bit-exact. Both
tests drive the real relay, gc and watcher: one puts a whole gc at each point of the relay's round where it reads
or writes the region, the other runs all three free on their own threads while a trainer
publishes.
"""

from __future__ import annotations

import threading
import time

import pytest

import relay
from relay.fanout import Destination, Fanout
from relay.store import MANIFEST_KEY, LocalStore, open_store
from relay.verify import verify

from test_fanout import FAST, assert_complete

KEEP = 1


class GcAt(LocalStore):
    """The relay's view of the region: a real local store that runs a whole region gc (through its own store,
    as an operator would) at `point` of the relay's next round, each time `armed` is set."""

    def __init__(self, url: str, root: str, point: str) -> None:
        super().__init__(url, root)
        self.point, self.armed, self.ran = point, False, 0

    def _maybe_gc(self, point: str) -> None:
        if self.armed and point == self.point:
            self.armed = False
            relay.gc(self.url, keep_snapshots=KEEP)
            self.ran += 1

    # the primitives the relay's own wrapper (relay.traffic.CountingStore) calls
    def read_object(self, key, if_none_match=None):  # type: ignore[no-untyped-def]
        got = super().read_object(key, if_none_match)
        if key == MANIFEST_KEY:
            self._maybe_gc("after_read")  # the relay now works from a manifest gc is about to replace
        return got

    def put_new(self, key: str, data: bytes) -> None:
        self._maybe_gc("put")
        super().put_new(key, data)

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        if key == MANIFEST_KEY:
            self._maybe_gc("commit")
        return super().commit_object(key, data, expected_etag)


@pytest.mark.parametrize("point", ["after_read", "put", "commit"])
def test_gc_inside_each_relay_round_never_leaves_the_region_naming_a_deleted_object(point, trainer, bits_equal,
                                                                                    tmp_path):
    origin = f"file://{tmp_path}/origin/run"
    root = tmp_path / "region" / "run"
    root.mkdir(parents=True)
    dest = f"file://{root}"
    region = GcAt(dest, str(root), point)
    t = trainer(seed=61)
    pub = relay.Publisher(origin, snapshot_every=2, background=False)
    pub.publish(t.state(), 0)
    fan = Fanout(origin, [Destination("r", dest, store=region)], recheck_interval=0.0, **FAST)
    assert fan.sync_once(timeout=30)
    w = relay.Watcher(dest, tmp_path / "w")
    assert w.sync() == 0
    state = None
    for step in range(1, 9):
        state = t.step()
        pub.publish(state, step)
        region.armed = True
        # a round whose commit lost to gc's reports False; the next one re-reads the region and finishes
        for _ in range(3):
            if fan.sync_once(timeout=30):
                break
        m = assert_complete(open_store(dest))
        assert m is not None and m.head == step, (step, m and m.head)
        assert w.sync() == step and bits_equal(w.tensors, state)
    assert region.ran >= 4, region.ran  # gc really ran inside the rounds, not only beside them
    relay.gc(dest, keep_snapshots=KEEP)
    m = assert_complete(open_store(dest))
    assert len(m.snapshots) == KEEP and m.snapshots[0].step == 8
    report = verify(dest)
    assert not report.problems, report.problems
    fresh = relay.Watcher(dest, tmp_path / "fresh")
    assert fresh.sync() == 8 and bits_equal(fresh.tensors, state)


def test_gc_relay_and_watcher_running_free_on_one_region(trainer, bits_equal, tmp_path):
    origin = f"file://{tmp_path}/origin/run"
    dest = f"file://{tmp_path}/region/run"
    t = trainer(seed=62)
    pub = relay.Publisher(origin, snapshot_every=2, background=False)
    pub.publish(t.state(), 0)
    fan = Fanout(origin, [Destination("r", dest)], recheck_interval=0.05, **FAST)
    relay_thread = threading.Thread(target=fan.run, daemon=True)
    relay_thread.start()
    stop = threading.Event()
    errors: list[BaseException] = []
    gcs = [0]

    def gc_loop() -> None:
        while not stop.is_set():
            if open_store(dest).read_manifest() is not None:
                try:
                    relay.gc(dest, keep_snapshots=KEEP)
                    gcs[0] += 1
                except Exception as exc:  # noqa: BLE001 - collected and failed below
                    errors.append(exc)
            stop.wait(0.01)

    w = relay.Watcher(dest, tmp_path / "w")
    held: list[int] = []

    def watch_loop() -> None:
        while not stop.is_set():
            try:
                held.append(w.sync(timeout=5))
            except Exception:  # noqa: BLE001 - a watcher mid-gc retries; only the end state is judged
                pass
            stop.wait(0.01)

    threads = [threading.Thread(target=f, daemon=True) for f in (gc_loop, watch_loop)]
    for th in threads:
        th.start()
    state = None
    try:
        for step in range(1, 13):
            state = t.step()
            pub.publish(state, step)
            time.sleep(0.15)
        deadline = time.monotonic() + 30
        while fan.status()["regions"]["r"]["head"] != 12 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        fan.stop()
        relay_thread.join(30)
    assert not errors, errors
    assert gcs[0] >= 5, gcs  # gc really ran while the relay was copying
    assert fan.status()["regions"]["r"]["head"] == 12
    assert held and held == sorted(held)  # the watcher only ever moved forward
    m = assert_complete(open_store(dest))
    assert m.head == 12 and len(m.snapshots) == KEEP
    report = verify(dest)
    assert not report.problems, report.problems
    assert w.sync(timeout=30) == 12 and bits_equal(w.tensors, state)
    fresh = relay.Watcher(dest, tmp_path / "fresh")
    assert fresh.sync(timeout=30) == 12 and bits_equal(fresh.tensors, state)
