"""The watcher's journal persistence (docs/PROTOCOL.md §6.1) under the failures and leftovers an adversarial
review found uncovered (docs/RELIABILITY.md has each finding, before and after). Each test states the
guarantee it checks.

Faults are injected by raising from a monkeypatched primitive at the point of interest (an fsync, a
rename), or by leaving in DEST what a crash or a copy of DEST leaves there.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import relay.watcher as watcher_mod
from relay import checkpoint, dest
from relay.watcher import STATE_NAME, Watcher

from conftest import same_bits
from test_watcher_journal import Run, version_of, visible

NO_AUTO_COMPACT = {"compact_steps": 1000, "compact_fraction": 1000.0}


@pytest.fixture
def run(file_run):
    r = Run(file_run.url)  # one snapshot (step 0), then a chain
    yield r
    r.close()


def _journal_watcher_at_step_2(run, url: str, d: Path) -> Watcher:
    """A journal-mode watcher (no automatic compaction) that took snapshot 0 and then the chain to step 2."""
    run.step()
    w = Watcher(url, d, persist="journal", **NO_AUTO_COMPACT)
    assert w.sync() == 0
    for step in (1, 2):
        run.step()
        assert w.sync() == step
    return w


def _shown_full(d: Path) -> tuple[int, dict]:
    """What a reader of the visible names gets: (relay-state.json's step, the visible shards' tensors)."""
    state = json.loads((d / STATE_NAME).read_bytes())
    tensors, _ = checkpoint.load(d)
    return state["step"], tensors


def test_failed_switch_from_journal_to_full_leaves_visible_base_shards_under_the_head_state(
        run, file_run, tmp_path, monkeypatch):
    """journal -> full: a full version's visible links (.current/<shard>) made before the .current swap would
    resolve at once, into the journal version's base (an older step's safetensors), next to a state file of
    the journal's head; and, since they do not dangle, they would stay if the swap then failed (ENOSPC
    making the swap link; a crash there is the same until a restart). They are made after the swap: DEST
    shows one step throughout, and the switch completes once the disk has room."""
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal", **NO_AUTO_COMPACT) as w:
        assert w.sync() == 0
        for step in (1, 2):
            run.step()
            assert w.sync() == step
    assert visible(d) == [STATE_NAME]
    run.step()
    real_symlink = os.symlink

    def no_space_for_the_swap(src, dst, *a, **kw):
        if os.path.basename(os.fspath(dst)).startswith(".current.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(dst))
        return real_symlink(src, dst, *a, **kw)

    with Watcher(file_run.url, d, persist="full") as w:
        assert w.step == 2
        monkeypatch.setattr(os, "symlink", no_space_for_the_swap)
        with pytest.raises(OSError):
            w.sync()
        monkeypatch.setattr(os, "symlink", real_symlink)
        assert w.step == 2 and dest.open_head(d)[0] == 2  # the watcher and open_head both say step 2
        # what the journal version showed before, and nothing else: no shard links, which would resolve
        # into its base (step 0's safetensors) next to step 2's state file
        assert visible(d) == [STATE_NAME], visible(d)
        assert w.sync() == 3  # the disk has room again: the switch completes
        step, tensors = _shown_full(d)
        assert step == 3 and same_bits(tensors, run.states[3])


def test_compaction_whose_swap_is_committed_but_fsync_fails_keeps_dest_and_watcher_on_one_version(
        run, file_run, tmp_path, monkeypatch):
    """_swap_compacted: .current is replaced (the commit point), then fsync_dir(DEST) raises (EIO). Had the
    watcher not taken the new version as its own at the swap, it would keep appending later steps to the
    *old* version, which .current no longer names: DEST would stay on the compacted step while the watcher
    (on_update, fleet) moved on, and a restart would remove the old version with every step journaled
    since. Like _commit_state after its rename, a .current swap is committed once made."""
    d = tmp_path / "dest"
    w = _journal_watcher_at_step_2(run, file_run.url, d)
    real = watcher_mod.fsync_dir
    failed = []

    def eio_on_dest_once(path):
        if Path(path) == d and not failed:
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real(path)

    monkeypatch.setattr(watcher_mod, "fsync_dir", eio_on_dest_once)
    assert w.compact() is True  # committed at the swap: the fsync failure after it is logged, not raised
    assert failed
    run.step()
    assert w.sync() == 3 and same_bits(w.tensors, run.states[3])
    shown = dest.open_head(d)[0]
    w.close()
    restarted = Watcher(file_run.url, d, persist="journal", **NO_AUTO_COMPACT)
    held = restarted.step
    restarted.close()
    assert (shown, held) == (3, 3), \
        f"watcher committed step 3, but DEST shows step {shown} and a restart holds step {held}"


def test_journal_version_without_its_empty_journal_directory_does_not_wedge(run, file_run, tmp_path):
    """A journal version whose journal is empty (a cold sync, a fresh compaction) loses its empty journal/
    directory: a copy or restore of DEST that skips empty directories, or a stray file left there
    (_tidy_journal removes a non-directory `journal` when the state names no entry). Every chain step used
    to fail then ("not the watcher's journal directory"), at every sync and after every restart; the
    directory is made again, and the watcher moves on."""
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.sync() == 0
    journal = version_of(d) / "journal"
    assert journal.is_dir() and not list(journal.iterdir())
    journal.rmdir()
    run.step()
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.step == 0
        errors = []
        for _ in range(2):
            try:
                w.sync()
            except Exception as exc:  # noqa: BLE001 - collected to show it repeats
                errors.append(f"{type(exc).__name__}: {exc}")
        assert errors == [] and w.step == 1, errors


def test_a_symlink_in_place_of_a_named_journal_file_does_not_wedge_start_up(run, file_run, tmp_path):
    """A named journal file replaced by a symlink (here to a file with the very same bytes) is read with
    O_NOFOLLOW: ELOOP. Taken for an I/O error, it made start-up refuse at every start, until an operator
    edited DEST. A link where the watcher wrote a regular file proves the version is not its own (as a
    symlinked journal/ directory does): BadVersion, the version is dropped (the link, never its target)
    and the watcher syncs afresh."""
    run.step()
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal") as w:
        assert w.sync() == 1
    named = version_of(d) / "journal" / "1-0.drd"
    copy = tmp_path / "elsewhere.drd"
    copy.write_bytes(named.read_bytes())
    named.unlink()
    named.symlink_to(copy)
    try:
        w = Watcher(file_run.url, d, persist="journal")
    except OSError as exc:
        pytest.fail(f"start-up refused, and will be at every start: {exc!r}")
    try:
        assert w.sync() == 1 and same_bits(w.tensors, run.states[1])
    finally:
        w.close()
    assert copy.exists()  # the link's target is left alone


def test_restart_removes_a_state_file_temporary_left_in_the_journal_version(run, file_run, tmp_path):
    """A kill inside _commit_state (after temporary_sibling created .relay-state.json.<rand>.tmp in the held
    version, before its rename) leaves that temporary in the version; a restart removes it (it used to stay
    for as long as the version lived, one more per such crash)."""
    run.step()
    run.step()
    d = tmp_path / "dest"
    with Watcher(file_run.url, d, persist="journal", **NO_AUTO_COMPACT) as w:
        assert w.sync() == 1
    version = version_of(d)
    left = version / f".{STATE_NAME}.k3v9q1zz.tmp"  # the name tempfile.mkstemp gives it
    left.write_bytes((version / STATE_NAME).read_bytes())
    with Watcher(file_run.url, d, persist="journal", **NO_AUTO_COMPACT) as w:
        assert w.step == 1
        leftover = sorted(p.name for p in version_of(d).iterdir() if p.name.endswith(".tmp"))
    assert leftover == [], f"left in the held version after a restart: {leftover}"


def test_open_head_racing_the_removal_of_a_compacted_version_resolves_again(run, file_run, tmp_path,
                                                                            monkeypatch):
    """open_head resolves .current to V and reads it; the watcher compacts meanwhile and removes V, whose
    rmtree unlinks V's files before V itself. A read failing in that window used to see V still existing
    and report DEST damaged; what decides is whether .current still names V (in materialize too)."""
    d = tmp_path / "dest"
    w = _journal_watcher_at_step_2(run, file_run.url, d)
    real_payload, real_remove = dest.journal_payload, watcher_mod._remove_entry
    raced = []

    def midway(p):  # the watcher's rmtree of the old version, caught after its journal files went
        if raced and p == raced[0]:
            for f in (p / "journal").iterdir():
                f.unlink()
            return
        real_remove(p)

    def racing(version, entry):
        if not raced:
            raced.append(version)
            assert w.compact() is True  # the watcher swaps a new base in while this reader is at V
        return real_payload(version, entry)

    monkeypatch.setattr(watcher_mod, "_remove_entry", midway)
    monkeypatch.setattr(dest, "journal_payload", racing)
    try:
        step, tensors = dest.open_head(d)
    finally:
        w.close()
    assert step == 2 and same_bits(tensors, run.states[2])


def test_a_held_version_damaged_on_disk_is_replaced_from_memory_not_appended_to(run, file_run, tmp_path):
    """The journal version's base shard is damaged on disk after start-up (the watcher holds verified tensors
    in memory). A compaction reads the version's files, finds the damage, and fails; it used to be retried at
    every sync while every step was still appended to the damaged version, its journal growing without bound
    (and a restart would find nothing loadable). The next step is written as a new version from memory."""
    d = tmp_path / "dest"
    w = _journal_watcher_at_step_2(run, file_run.url, d)
    damaged = version_of(d)
    shard = next(p for p in damaged.iterdir() if p.name.endswith(".safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a tensor byte, not the header
    shard.write_bytes(bytes(data))
    with pytest.raises(dest.BadVersion):
        w.compact()
    run.step()
    assert w.sync() == 3 and same_bits(w.tensors, run.states[3])
    assert version_of(d) != damaged and not damaged.exists()
    state = json.loads((d / STATE_NAME).read_bytes())
    assert state["step"] == 3 and state["base"]["step"] == 3 and state["journal"] == []
    step, tensors = dest.open_head(d)
    assert step == 3 and same_bits(tensors, run.states[3])
    run.step()
    assert w.sync() == 4 and len(json.loads((d / STATE_NAME).read_bytes())["journal"]) == 1  # appending again
    w.close()
