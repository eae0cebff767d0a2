"""The watcher's journal persist mode (docs/PROTOCOL.md §6.1): DEST keeps a base plus the verified payloads
applied since, each step writes only its payloads and a new state file, and compaction swaps in a new base.

Also the in-place held state every mode now has: the held tensors are the same objects from step to step,
a failed persist reverts them exactly, and `relay.dest.open_head` / `deltarelay dest materialize` read DEST
in either mode. Real file:// stores and real processes; nothing of relay is mocked.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay import checkpoint, dest
from relay.manifest import DestState, ManifestError
from relay.publisher import Publisher
from relay.watcher import STATE_NAME, Watcher

from conftest import Trainer, same_bits

ROOT = Path(__file__).resolve().parents[1]


def version_of(d: Path) -> Path:
    return d / ".versions" / os.path.basename(os.readlink(d / ".current"))


def visible(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


class Run:
    """A small trainer publishing into a file:// run, one step at a time."""

    def __init__(self, url: str, snapshot_every: int = 100, seed: int = 11) -> None:
        self.trainer = Trainer(seed=seed)
        self.pub = Publisher(url, background=False, snapshot_every=snapshot_every)
        self.states: list[dict] = []

    def step(self) -> dict:
        state = self.trainer.state() if not self.states else self.trainer.step()
        self.pub.publish(state, len(self.states))
        self.states.append(state)
        return state

    def close(self) -> None:
        self.pub.close()


@pytest.fixture
def run(file_run):
    r = Run(file_run.url)
    yield r
    r.close()


def test_journal_mode_steps_write_only_payloads_and_the_state(run, file_run, tmp_path):
    """Cold sync: the snapshot's files become the base as downloaded; each later step adds its payload to the
    journal and replaces the state file, in the same version; only relay-state.json is visible (saying
    persist journal), and open_head gives exactly the trainer's step."""
    run.step()
    d = tmp_path / "dest"
    w = Watcher(file_run.url, d, persist="journal", compact_steps=1000, compact_fraction=1000.0)
    assert w.sync() == 0
    version = version_of(d)
    base_files = {p.name: p.stat().st_mtime_ns for p in version.iterdir() if p.is_file() and p.name != STATE_NAME}
    assert visible(d) == [STATE_NAME]
    held = w.tensors
    for step in (1, 2, 3):
        run.step()
        assert w.sync() == step
        assert w.tensors is held  # the same tensors, updated in place
        assert version_of(d) == version  # no new version: the state file is the commit point
        state = json.loads((d / STATE_NAME).read_bytes())
        assert state["persist"] == "journal" and state["step"] == step and state["base"]["step"] == 0
        assert [e["step"] for e in state["journal"]] == list(range(1, step + 1))
        got_step, tensors = dest.open_head(d)
        assert got_step == step and same_bits(tensors, run.states[step])
        assert same_bits(w.tensors, run.states[step])
    assert {p.name: p.stat().st_mtime_ns for p in version.iterdir()
            if p.is_file() and p.name != STATE_NAME} == base_files  # the base was never rewritten
    assert visible(d) == [STATE_NAME]
    w.close()
    again = Watcher(file_run.url, d, persist="journal")  # restart: base + journal, verified
    assert again.step == 3 and same_bits(again.tensors, run.states[3])
    again.close()


def test_materialize_command_and_modes_switch(run, file_run, tmp_path):
    """`deltarelay dest materialize` writes the head of a journal DEST as a plain shard directory; a DEST
    restarted in the other mode converts at its next step, each time showing exactly one step."""
    for _ in range(3):
        run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.sync() == 2
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "dest", "materialize", str(d), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tensors, _ = checkpoint.load(out)
    assert same_bits(tensors, run.states[2])
    run.step()
    with Watcher(file_run.url, d, persist="full") as w:  # journal -> full at the next step
        assert w.step == 2 and w.sync() == 3
    assert STATE_NAME in visible(d) and len(visible(d)) > 1
    assert same_bits(checkpoint.load(d)[0], run.states[3])
    run.step()
    with Watcher(file_run.url, d, persist="journal") as w:  # full -> journal: the held state as the base
        assert w.sync() == 4
    assert visible(d) == [STATE_NAME]
    assert dest.open_head(d)[0] == 4 and same_bits(dest.open_head(d)[1], run.states[4])


def test_restart_in_full_mode_shows_the_held_step_complete_without_a_new_step(run, file_run, tmp_path):
    """journal -> full, no engine, nothing new in the store (processes): the full-mode watcher's first sync
    rewrites the held journal version as a full one, so DEST's visible names are a complete checkpoint of the
    held step at once, as full mode promises (and an engine would stage those files)."""
    for _ in range(3):
        run.step()
    d = tmp_path / "dest"
    cmd = [sys.executable, "-m", "relay.cli", "watch", file_run.url, "--dest", str(d), "--once", "--no-report",
           "--no-progress", "--persist"]
    for persist in ("journal", "full"):
        proc = subprocess.run(cmd + [persist], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        state = dest.read_state(version_of(d))
        assert (state.step, state.persist) == (2, persist), (state.step, state.persist, state.base)
    assert STATE_NAME in visible(d) and len(visible(d)) > 1
    assert same_bits(checkpoint.load(d)[0], run.states[2])


def test_torn_journal_tail_is_removed_and_a_bad_journal_is_proven_bad(run, file_run, tmp_path):
    """A journal file the committed state does not name (a crash between the payload and the state file) is
    removed at start; a named journal file that was altered makes the version proven bad (removed)."""
    run.step()
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.sync() == 1
    version = version_of(d)
    torn = version / "journal" / "2-0.drd"
    torn.write_bytes(b"a payload written but never committed")
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.step == 1 and not torn.exists()
    named = version / "journal" / "1-0.drd"
    data = bytearray(named.read_bytes())
    data[len(data) // 2] ^= 1
    named.write_bytes(bytes(data))
    with pytest.raises(dest.BadVersion):
        dest.open_head(d)
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.step is None and not version.exists()
        assert w.sync() == 1 and same_bits(w.tensors, run.states[1])


def test_compaction_swaps_in_a_verified_base(run, file_run, tmp_path):
    """Past compact_steps journaled steps a compaction materialises the head from the files as the new base
    (streamed, verified) and swaps it in; steps journaled meanwhile carry over; DEST shows the same step."""
    run.step()
    d = tmp_path / "dest"
    w = Watcher(file_run.url, d, persist="journal", compact_steps=2, compact_fraction=1000.0)
    assert w.sync() == 0
    for _ in range(3):
        run.step()
        w.sync()
    if w._compactor is not None:
        w._compactor.join()
    assert w.compactions >= 1 and w.last_compaction_error is None
    state = DestState.parse((d / STATE_NAME).read_bytes())
    assert state.persist == "journal" and state.base >= 2 and state.step == 3
    assert len(os.listdir(d / ".versions")) == 1
    assert dest.open_head(d)[0] == 3 and same_bits(dest.open_head(d)[1], run.states[3])
    run.step()
    assert w.sync() == 4
    assert w.compact() is True
    state = DestState.parse((d / STATE_NAME).read_bytes())
    assert state.base == 4 and state.journal == ()
    assert same_bits(dest.open_head(d)[1], run.states[4]) and same_bits(w.tensors, run.states[4])
    w.close()


@pytest.mark.parametrize("persist", ["full", "journal"])
def test_failed_persist_reverts_the_held_state_exactly(run, file_run, tmp_path, monkeypatch, persist):
    """The chain is applied to the held tensors in place; a persist that fails (here: ENOSPC at the state
    file) reverts them bit for bit, DEST keeps its step, and the next sync lands the step."""
    run.step()
    d = tmp_path / "dest"
    w = Watcher(file_run.url, d, persist=persist)
    assert w.sync() == 0
    run.step()
    real = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        w.sync()
    monkeypatch.setattr(os, "fsync", real)
    assert w.step == 0 and same_bits(w.tensors, run.states[0])
    assert dest.open_head(d)[0] == 0
    assert w.sync() == 1 and same_bits(w.tensors, run.states[1]) and dest.open_head(d)[0] == 1
    leftovers = [p.name for p in (d / ".versions").iterdir()]
    assert len(leftovers) == 1 and not list((version_of(d) / "journal").glob("*")) or persist == "journal"
    w.close()


def test_state_file_parsing_is_strict(run, file_run, tmp_path):
    run.step()
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal") as w:
        w.sync()
    doc = json.loads((d / STATE_NAME).read_bytes())
    DestState.parse(json.dumps(doc).encode())
    doc.pop("check")  # its checksum would refuse any edit: each rule below is under test on its own
    DestState.parse(json.dumps(doc).encode())
    for edit in (lambda x: x.update(persist="mirror"),
                 lambda x: x["journal"][0].update(file="../../etc/passwd"),
                 lambda x: x["journal"][0].update(step=7),
                 lambda x: x.update(step=5),
                 lambda x: x["base"].update(step=1),
                 lambda x: x["journal"].append(dict(x["journal"][0])),
                 lambda x: x.pop("base"),
                 lambda x: x["journal"][0].update(extra=1)):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(ManifestError):
            DestState.parse(json.dumps(bad).encode())


def test_reader_reverts_the_held_state_when_the_head_record_disagrees(run, file_run):
    """Reader.reach applies the chain to the held tensors themselves; the head's record (consistent tags, other
    digests: a bucket writer) fails the final check after three steps were applied in place: every held tensor
    is back to its exact bits before the error leaves, and the same objects are still held."""
    import dataclasses

    from relay.manifest import Manifest, ObjRef, Record
    from relay.store import open_store
    from relay.watcher import Reader, SyncError

    for _ in range(4):
        run.step()
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    rec = Record.parse(store.get("records/3.json"))
    name = next(iter(rec.tensors))
    rec.tensors[name] = dataclasses.replace(rec.tensors[name], digest="0" * 32)
    forged = rec.to_bytes()
    path = Path(file_run.url.removeprefix("file://")) / "records/3.json"
    path.unlink()
    path.write_bytes(forged)
    i = next(i for i, s in enumerate(m.steps) if s.step == 3)
    m.steps[i] = dataclasses.replace(m.steps[i], record=ObjRef.of("records/3.json", forged))
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    held = {k: v.clone() for k, v in run.states[0].items()}
    objects = dict(held)
    reader = Reader(store, retry_initial=0.001, retry_max=0.01, failure_backoff_initial=60)
    with pytest.raises(SyncError):
        reader.reach(0, held, run=m.run, timeout=5)
    assert same_bits(held, run.states[0]) and all(held[k] is objects[k] for k in held)
