"""Crash safety of the watcher's directory: SIGKILL at random times and at each point of download, apply
and persist, then a restart; and a destination disk that fills up.

The watcher runs as a real process (`python -m relay.cli watch ...`) against a moto server. Kills at a
chosen point use a `sitecustomize` placed on PYTHONPATH for that process only: once `relay.watcher` is
imported it installs a profile hook that sends SIGKILL to its own process when the named function (or
builtin, such as os.replace) is called from the named caller. No relay code is changed or mocked. After
every kill DEST must show the old step or the new one, complete and bit-exact, never a mix; a restarted
watcher must clean up what the crash left and reach the head.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import save as st_save

import relay
from faultproxy import FaultProxy, Oracle
from relay import checkpoint

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 384  # ~170k BF16 parameters: big enough that a sync spans several requests and writes

SITECUSTOMIZE = r'''
import os, signal, sys, threading
_spec = os.environ.get("RELAY_KILL_AT")  # event:function:callers:count; callers "a|b", or "*" for any
if _spec:
    _event, _name, _caller, _count = _spec.split(":")
    _count, _seen, _lock = int(_count), [0], threading.Lock()

    def _hook(frame, event, arg):
        if event != _event:
            return
        if event.startswith("c_"):
            name, caller = getattr(arg, "__name__", ""), frame.f_code.co_name
        else:
            name, caller = frame.f_code.co_name, frame.f_back.f_code.co_name if frame.f_back else ""
        if name != _name or (_caller != "*" and caller not in _caller.split("|")):
            return
        with _lock:
            _seen[0] += 1
            if _seen[0] == _count:
                with open(os.environ["RELAY_KILL_MARK"], "w") as f:
                    f.write(_spec)
                os.kill(os.getpid(), signal.SIGKILL)

    class _Arm:
        def find_spec(self, name, path=None, target=None):
            if name == "relay.watcher":  # imported on the main thread: arm it and every later thread
                sys.meta_path.remove(self)
                sys.setprofile(_hook)
                threading.setprofile(_hook)
            return None

    sys.meta_path.insert(0, _Arm())
'''

# (label, event, function, caller, count, step DEST must show after the kill: "old" or "new")
KILL_POINTS = [
    ("download: between object GETs", "call", "_fetch_one", "*", 2, "old"),
    ("apply: codec.apply_ of the delta", "call", "apply_", "_apply_step", 1, "old"),
    ("persist: writing the shards", "call", "save_file", "write_dir", 1, "old"),
    ("persist: fsync of the new version", "c_call", "fsync", "_persist|_write_version", 1, "old"),
    ("persist: rename of the finished version", "c_call", "rename", "_persist|_write_version", 1, "old"),
    ("persist: visible symlinks created", "c_call", "symlink", "_persist|_write_version|_link_visible", 1, "old"),
    ("persist: just before the .current swap", "c_call", "replace", "_persist|_write_version", 1, "old"),
    ("persist: just after the .current swap", "c_return", "replace", "_persist|_write_version", 1, "new"),
    ("persist: removing the old version", "call", "rmtree", "_persist|_write_version|_remove_entry", 1, "new"),
]


# Journal mode (persist="journal"): one step is its payload files and a new state file in the held version;
# compaction (here after more than one journaled step) writes a new base and swaps it in. DEST must show the
# step it held until the state file's rename, the new one from then on, whatever compaction is doing.
JOURNAL_KILL_POINTS = [
    ("journal: writing the step's payload", "call", "_write_journal_file", "*", 1, "old"),
    ("journal: fsync of the payload", "c_call", "fsync", "_write_journal_file", 1, "old"),
    ("journal: rename of the payload", "c_call", "replace", "atomic_path", 1, "old"),
    ("journal: fsync of the journal directory", "call", "fsync_dir", "_append_journal", 1, "old"),
    ("journal: state file written, before its rename", "c_call", "replace", "_commit_state", 1, "old"),
    ("journal: just after the state file's rename", "c_return", "replace", "_commit_state", 1, "new"),
]
COMPACTION_KILL_POINTS = [
    ("compaction: streaming the new base", "call", "write", "materialize_into", 1, "new"),
    ("compaction: rename of the new version", "c_call", "rename", "_swap_compacted", 1, "new"),
    ("compaction: just before the .current swap", "c_call", "replace", "_swap_compacted", 1, "new"),
    ("compaction: just after the .current swap", "c_return", "replace", "_swap_compacted", 1, "new"),
    ("compaction: removing the old version", "call", "_remove_entry", "_after_swap", 1, "new"),
]


def watch_cmd(url: str, dest: Path, options: dict, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "relay.cli", "watch", url, "--dest", str(dest), "--poll-interval", "0.05",
            "--storage-options", json.dumps(options), *extra]


def leftovers(dest: Path) -> list[str]:
    """What a crash may leave and a restart must remove: extra or temporary versions, swap links, dangling names."""
    out = []
    versions = dest / ".versions"
    if versions.is_dir():
        current = os.path.basename(os.readlink(dest / ".current")) if (dest / ".current").is_symlink() else None
        out += [f".versions/{v.name}" for v in versions.iterdir() if v.name != current]
    out += [p.name for p in dest.glob(".current.tmp-*")]
    out += [p.name for p in dest.iterdir() if p.is_symlink() and not p.name.startswith(".") and not p.exists()]
    current = dest / ".current"
    state_path = current / "relay-state.json"
    if current.is_symlink() and state_path.exists():
        state = json.loads(state_path.read_bytes())
        if state.get("persist") == "journal":  # a torn tail: journal files the committed state does not name
            named = {e["file"] for e in state["journal"]}
            out += [f"journal/{p.name}" for p in (current / "journal").iterdir() if f"journal/{p.name}" not in named]
            out += [p.name for p in dest.iterdir() if not p.name.startswith(".") and p.name != "relay-state.json"]
    return sorted(out)


@pytest.fixture
def run(s3_run):
    return s3_run


def _kill_at_each_point(run, trainer, tmp_path, points, persist: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Watchers holding step 1 (one DEST per point, in `persist` mode) are each SIGKILLed at their point while
    reaching step 2; each DEST must show the step its point expects, complete and bit-exact, and a restarted
    watcher must leave nothing behind and reach step 2. Returns a row per point."""
    oracle, t = Oracle(), trainer(seed=30, width=WIDTH)
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir(parents=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook_dir), str(ROOT)])}
    pub = relay.Publisher(run.url, storage_options=run.options, snapshot_every=100, background=False)
    for step in range(2):
        oracle.published(step, state := t.step())
        pub.publish(state, step)
    dests = [tmp_path / f"dest{i}" for i in range(len(points))]
    for dest in dests:
        # each holds step 1; closed, so DEST's lock is free for the child at once (a dropped Watcher frees it
        # only when collected, and a traceback s3fs keeps can hold its frames for a while)
        with relay.Watcher(run.url, dest, storage_options=run.options, persist=persist) as w:
            w.sync()
    oracle.published(2, state := t.step())
    pub.publish(state, 2)
    rows = []
    for batch in range(0, len(points), 3):  # three processes at a time: independent DESTs, one head
        procs = {}
        for i in range(batch, min(batch + 3, len(points))):
            label, event, name, caller, count, _ = points[i]
            procs[i] = subprocess.Popen(
                watch_cmd(run.url, dests[i], run.options, ("--persist", persist, *extra)), cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**env, "RELAY_KILL_AT": f"{event}:{name}:{caller}:{count}",
                     "RELAY_KILL_MARK": str(tmp_path / f"killed{i}")})
        for i, proc in procs.items():
            try:
                # three children at once, each importing torch and the codec first: minutes on a loaded
                # 2-core CI box; a child ends at its kill point, so the bound only matters when it never gets there
                _, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            label = points[i][0]
            assert proc.returncode == -signal.SIGKILL and (tmp_path / f"killed{i}").exists(), \
                (label, proc.returncode, err[-2000:])
    for i, (label, *_, expect) in enumerate(points):
        dest = dests[i]
        shown = oracle.dest(dest, allowed={1 if expect == "old" else 2})
        left = leftovers(dest)
        w = relay.Watcher(run.url, dest, storage_options=run.options, on_update=oracle.hook(f"dest{i}"),
                          persist=persist)
        assert leftovers(dest) == [] and w.step == shown, (label, leftovers(dest))
        assert w.sync() == 2 and oracle.dest(dest) == 2
        w.close()
        rows.append(f"{label}: showed {shown}, left {len(left)}")
    pub.close()
    oracle.ok()
    return rows


@pytest.mark.slow
def test_sigkill_at_each_point_of_download_apply_persist(run, trainer, tmp_path, record_property):
    """For each point of a sync (a GET, the delta's apply, the shard writes, fsync, rename, symlinks, just before
    and after the atomic swap, the cleanup), a watcher process holding step k is SIGKILLed there while reaching
    k+1: DEST shows k before the swap and k+1 after it, complete and bit-exact; a restart tidies and converges."""
    rows = _kill_at_each_point(run, trainer, tmp_path, KILL_POINTS, "full")
    record_property("injected", f"SIGKILL at {len(KILL_POINTS)} points of one sync")
    record_property("observed", "; ".join(rows))


@pytest.mark.slow
def test_sigkill_at_each_point_of_a_journal_step_and_compaction(run, trainer, tmp_path, record_property):
    """Journal mode: SIGKILL at each point of a step's journal write (the payload, its fsync and rename, the
    journal directory's fsync, the state file before and after its rename) and of a compaction (streaming the
    new base, its rename, just before and after the .current swap, removing the old version): DEST shows the
    old step until the state file's rename and the new one after, never a mix; a restart removes the torn
    tail and any partial base, and converges."""
    rows = _kill_at_each_point(run, trainer, tmp_path / "journal", JOURNAL_KILL_POINTS, "journal")
    rows += _kill_at_each_point(dataclasses.replace(run, url=f"{run.url}-compaction"), trainer,
                                tmp_path / "compaction", COMPACTION_KILL_POINTS, "journal", ("--compact-steps", "1"))
    record_property("injected", f"SIGKILL at {len(JOURNAL_KILL_POINTS)} points of a journal step and "
                                f"{len(COMPACTION_KILL_POINTS)} of a compaction")
    record_property("observed", "; ".join(rows))


@pytest.mark.slow
def test_sigkill_at_random_times(run, trainer, tmp_path, record_property):
    """A watcher process behind a slow link is SIGKILLed at a random moment of each of 6 syncs and restarted:
    after every kill DEST holds the step it held or the new one, complete and bit-exact; it ends on the head."""
    rng = random.Random(31)
    oracle, t = Oracle(), trainer(seed=32, width=WIDTH)
    proxy = FaultProxy(run.region.endpoint, seed=33).start()
    proxy.add("delay", methods=("GET",), key=r"/(deltas|snapshots|records)/", seconds=0.08)
    opts = proxy.options(run.options)
    dest = tmp_path / "dest"
    pub = relay.Publisher(run.url, storage_options=run.options, snapshot_every=3, background=False)
    step, shown, outcomes = 0, None, []
    try:
        for rnd in range(6):
            log_path = tmp_path / f"watch{rnd}.log"  # a file, not a pipe: a chatty watcher must never block on it
            with open(log_path, "w") as log_file:
                proc = subprocess.Popen(watch_cmd(run.url, dest, opts), cwd=ROOT, stdout=subprocess.DEVNULL,
                                        stderr=log_file)
            try:
                if rnd > 0:  # wait until it is idle on the head, so the kill lands in the next sync
                    deadline = time.monotonic() + 240  # a restart imports torch and the codec first
                    while oracle.dest(dest) != step:
                        assert proc.poll() is None, f"watcher exited: {log_path.read_text()[-2000:]}"
                        assert time.monotonic() < deadline, \
                            f"restarted watcher did not reach step {step}: {log_path.read_text()[-2000:]}"
                        time.sleep(0.05)
                    step += 1
                old = oracle.dest(dest)
                oracle.published(step, state := t.step())
                pub.publish(state, step)
                time.sleep(rng.uniform(0.0, 0.5))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            shown = oracle.dest(dest, allowed={old, step} - {None} or None)
            outcomes.append("old" if shown == old else "new")
        w = relay.Watcher(run.url, dest, storage_options=run.options, on_update=oracle.on_update)
        assert leftovers(dest) == [] and w.sync() == step and oracle.dest(dest) == step
    finally:
        proxy.stop()
        pub.close()
    oracle.ok()
    record_property("injected", f"SIGKILL x{len(outcomes)} at random times (0-0.5 s after a publish)")
    record_property("observed", f"DEST showed old step x{outcomes.count('old')}, new step x{outcomes.count('new')}, "
                                f"never a mix; restart reached the head")


class DiskQuota:
    """A destination disk of `capacity` bytes, for the writes the watcher's persist path makes.

    Why not a real full filesystem: no small tmpfs or loop device is available to an unprivileged test, and
    filling the shared disk would hurt everything else on the machine. So the real code path runs and only
    its write primitives are wrapped: safetensors' save_file (the shards, via relay.checkpoint),
    Path.write_bytes (index and state file) and os.symlink under DEST. A write that does not fit writes what
    fits, then raises ENOSPC, as a filling disk does; nothing outside DEST is affected.
    """

    def __init__(self, dest: Path, capacity: int) -> None:
        self.dest = str(dest.resolve())
        self.capacity = capacity
        self.refusals = 0
        self._save_file = checkpoint.save_file
        self._write_bytes = Path.write_bytes
        self._symlink = os.symlink

    def used(self) -> int:
        total = 0
        for root, _, files in os.walk(self.dest):
            for f in files:
                p = os.path.join(root, f)
                if not os.path.islink(p):
                    total += os.path.getsize(p)
        return total

    def _mine(self, path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(self.dest + os.sep)

    def _write(self, path, data: bytes) -> None:
        room = self.capacity - self.used()
        with open(path, "wb") as f:
            f.write(data[:max(room, 0)])
        if len(data) > room:
            self.refusals += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    def save_file(self, tensors, filename, metadata=None):
        if not self._mine(filename):
            return self._save_file(tensors, filename, metadata=metadata)
        self._write(filename, st_save(tensors, metadata=metadata))

    def write_bytes(self, path_self, data):
        if not self._mine(path_self):
            return self._write_bytes(path_self, data)
        self._write(path_self, bytes(data))
        return len(data)

    def symlink(self, src, dst, *a, **kw):
        if self._mine(dst) and self.used() >= self.capacity:
            self.refusals += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(dst))
        return self._symlink(src, dst, *a, **kw)

    def install(self, monkeypatch) -> "DiskQuota":
        monkeypatch.setattr(checkpoint, "save_file", self.save_file)
        monkeypatch.setattr(Path, "write_bytes", lambda path, data: self.write_bytes(path, data))
        monkeypatch.setattr(os, "symlink", self.symlink)
        return self


def test_destination_disk_full(run, trainer, tmp_path, monkeypatch, caplog, record_property):
    """DEST's disk has room for the held step and half of the next: each sync fails with ENOSPC, is logged,
    leaves the held step readable and no partial version behind, and never calls on_update. Once there is room
    for exactly one more version, the watcher converges."""
    caplog.set_level(logging.INFO, logger="relay")
    oracle, t = Oracle(), trainer(seed=34, width=WIDTH)
    dest = tmp_path / "dest"
    pub = relay.Publisher(run.url, storage_options=run.options, snapshot_every=100, background=False)
    for step in range(3):
        oracle.published(step, state := t.step())
        pub.publish(state, step)
    w = relay.Watcher(run.url, dest, storage_options=run.options, on_update=oracle.on_update, poll_interval=0.02)
    assert w.sync() == 2
    size = DiskQuota(dest, 0).used()
    quota = DiskQuota(dest, capacity=size + size // 2).install(monkeypatch)
    for step in (3, 4):
        oracle.published(step, state := t.step())
        pub.publish(state, step)
        for _ in range(3):  # the watcher retries at every poll; the disk stays full
            with pytest.raises(OSError) as err:
                w.sync()
            assert err.value.errno == errno.ENOSPC
            assert oracle.dest(dest) == 2 and w.step == 2
            assert leftovers(dest) == [], "a failed persist left a partial version taking the space"
    runner = threading.Thread(target=w.run, daemon=True)  # as a rollout host runs it: failures are logged
    runner.start()
    time.sleep(0.3)
    w.stop()
    runner.join(10)
    assert "sync failed, keeping step 2" in caplog.text and "No space left on device" in caplog.text
    assert oracle.updates.get("watcher") == [2] and w.step == 2 and leftovers(dest) == []
    quota.capacity = 2 * size + size // 10  # room for the held version and one more, not for leftovers
    assert w.sync() == 4 and oracle.dest(dest) == 4 and leftovers(dest) == []
    pub.close()
    oracle.ok()
    record_property("injected", f"ENOSPC x{quota.refusals} on DEST writes (quota of 1.5 versions)")
    record_property("observed", "held step 2 through 6 failed syncs, no partial version left; reached 4 once "
                                "there was room for one version")
