"""Load: a watcher behind a slow link under a burst of 200 steps, and a publisher under store throttling.

Memory is measured as the resident set of a real watcher process (`python -m relay.cli watch`), read
from /proc while it runs, because the weights live in torch storage that tracemalloc does not see.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

import relay
from faultproxy import FaultProxy, Oracle
from relay.manifest import Manifest
from relay.store import content_tag, open_store

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def held_step(dest: Path) -> int | None:
    try:
        return json.loads((dest / "relay-state.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def named_objects_present(store) -> Manifest:
    """Every object the manifest names exists with the size and hash it gives (read without the proxy)."""
    m = Manifest.parse(store.read_manifest().data)
    refs = [r for s in m.steps for r in (s.record, *(p.ref for p in s.parts or ()))]
    refs += [r for snap in m.snapshots for r in (snap.index, *snap.files)]
    for ref in refs:
        data = store.get(ref.key)
        assert (len(data), content_tag(data)) == (ref.size, ref.xxh3), f"manifest names {ref.key}, not in the store"
    return m


@pytest.mark.slow
def test_burst_of_200_steps_slow_region(s3_run, trainer, tmp_path, record_property):
    """200 steps published back to back while a watcher process reads through a link that adds 80 ms to every
    object GET: its resident memory stays flat (no growth with the steps it falls behind or catches up), it
    never shows a wrong step, and it reaches the head soon after the burst."""
    proxy = FaultProxy(s3_run.region.endpoint, seed=40).start()
    proxy.add("delay", methods=("GET",), key=r"/(deltas|snapshots|records)/", seconds=0.08)
    dest = tmp_path / "dest"
    oracle, t = Oracle(), trainer(seed=41)
    pub = relay.Publisher(s3_run.url, storage_options=s3_run.options, snapshot_every=25)
    oracle.published(0, state := t.step())
    pub.publish(state, 0)
    cmd = [sys.executable, "-m", "relay.cli", "watch", s3_run.url, "--dest", str(dest), "--poll-interval", "0.05",
           "--storage-options", json.dumps(proxy.options(s3_run.options))]
    with open(tmp_path / "watch.log", "w") as log_file:  # a file, not a pipe: the watcher must never block on it
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file)
    samples: list[tuple[int, int]] = []  # (step held, RSS)
    try:
        deadline = time.monotonic() + 60
        while held_step(dest) != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "watcher did not start"
            time.sleep(0.05)
        start, max_behind = time.monotonic(), 0
        for step in range(1, 201):
            oracle.published(step, state := t.step())
            pub.publish(state, step)
            samples.append((held_step(dest) or 0, rss_bytes(proc.pid)))
            max_behind = max(max_behind, step - (held_step(dest) or 0))
        pub.flush()
        burst_s = time.monotonic() - start
        behind_at_end = 200 - (held_step(dest) or 0)
        deadline = time.monotonic() + 60
        while held_step(dest) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"stuck at {held_step(dest)}: {(tmp_path / 'watch.log').read_text()[-2000:]}"
            samples.append((held_step(dest) or 0, rss_bytes(proc.pid)))
            time.sleep(0.05)
        catch_up_s = time.monotonic() - start - burst_s
        samples.append((200, rss_bytes(proc.pid)))
    finally:
        proc.kill()
        proc.wait(10)
        pub.close()
        proxy.stop()
    assert oracle.dest(dest) == 200
    oracle.ok()
    warm = max(r for s, r in samples if s <= 40)  # after ~40 steps every code path has run at least once
    peak = max(r for _, r in samples)
    mib = 1 << 20
    assert peak - warm < 48 * mib, f"RSS grew from {warm / mib:.0f} MiB to {peak / mib:.0f} MiB over the burst"
    record_property("injected", f"200 steps in {burst_s:.1f}s; 80 ms on each of {len(proxy.log)} object GETs")
    record_property("observed", f"RSS {warm / mib:.0f} MiB after 40 steps, peak {peak / mib:.0f} MiB; up to "
                                f"{max_behind} steps behind during the burst, {behind_at_end} at its end, on the head "
                                f"{catch_up_s:.1f}s later")


def test_publisher_under_throttling(s3_run, trainer, tmp_path, caplog, record_property):
    """503 SlowDown on 35% of the publisher's PUTs and 15% of its GETs for 10 steps, then every PUT of one delta
    throttled until the retries run out: requests are retried with growing waits; a publish that fails leaves the
    manifest naming only objects that were written (checked after every attempt); the same step then succeeds."""
    caplog.set_level(logging.DEBUG, logger="s3fs")
    proxy = FaultProxy(s3_run.region.endpoint, seed=42).start()
    opts = proxy.options(s3_run.options, retries={"total_max_attempts": 1}, read_timeout=5)  # s3fs's 5 tries only
    direct = open_store(s3_run.url, s3_run.options)
    oracle, t = Oracle(), trainer(seed=43)
    failures, attempts = 0, 0
    pub = relay.Publisher(s3_run.url, storage_options=opts, snapshot_every=4)
    proxy.add("error", methods=("PUT",), status=503, code="SlowDown", probability=0.35)
    proxy.add("error", methods=("GET",), status=503, code="SlowDown", probability=0.15)
    try:
        for step in range(10):
            oracle.published(step, state := t.step())
            while True:
                attempts += 1
                try:
                    pub.publish(state, step)
                    break
                except Exception:  # noqa: BLE001 - retried by the trainer loop, as in production
                    failures += 1
                    assert attempts < 60
                finally:
                    if direct.read_manifest() is not None:
                        named_objects_present(direct)
        try:
            pub.flush()
        except Exception:  # noqa: BLE001 - a background snapshot that ran out of retries
            failures += 1
        proxy.clear()
        named_objects_present(direct)
        throttled = len(proxy.injected("error"))

        # hard throttling of one object: every try refused until s3fs's retries run out
        proxy.add("error", methods=("PUT",), key=r"/deltas/10-0\.drd$", status=503, code="SlowDown", times=5)
        oracle.published(10, state := t.step())
        with pytest.raises(OSError, match="reduce your request rate"):
            pub.publish(state, 10)
        m = named_objects_present(direct)
        assert m.head == 9 and m.step(10) is None
        tries = [i.at for i in proxy.injected("error", r"/deltas/10-0\.drd$")]
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert len(tries) == 5 and all(b > a for a, b in zip(gaps, gaps[1:])), gaps  # exponential backoff
        pub.publish(state, 10)  # the throttling is over: the same step goes through
        pub.flush()
    finally:
        pub.close()
        proxy.stop()
    m = named_objects_present(direct)
    assert m.head == 10
    w = relay.Watcher(s3_run.url, tmp_path / "dest", storage_options=s3_run.options, on_update=oracle.on_update)
    assert w.sync() == 10
    oracle.ok()
    assert "SlowDown" in caplog.text or "reduce your request rate" in caplog.text
    record_property("injected", f"503 SlowDown x{throttled} at random, then x5 in a row on one delta")
    record_property("observed", f"{failures} of {attempts} publish calls failed and were retried; retry gaps "
                                f"{', '.join(f'{g:.2f}' for g in gaps)} s; manifest never named a missing object")
