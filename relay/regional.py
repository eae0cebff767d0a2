"""A region's materialiser: build the region's own snapshots from the chain it already holds.

Why: in a multi-region fleet most of the bytes that cross a region boundary are full snapshots, and
every region already holds the whole chain of deltas. The materialiser follows one regional store
like a watcher (relay.watcher.Reader: every step verified against the trainer's record, the chain
applied in place, one model copy in memory, snapshot files spooled in a work directory), and at the
steps the origin's snapshot policy names (the steps of the snapshots in the manifest; optionally
every N steps of its own) writes a snapshot of the held state into the region, create-only and
streamed, under `regional/snapshots/<step>/`, then announces it by compare-and-swap on
`regional/snapshots.json` (relay/announce.py, docs/PROTOCOL.md §8.1). So after a region's bootstrap
no snapshot crosses a region boundary.

Bootstrap: with nothing held it starts from the region's newest announced snapshot; if there is none
(or none verifies) it reads one origin snapshot, from the region if it is there, else from
`bootstrap_from` (the origin's URL): the only snapshot that crosses. The materialiser needs no
signing key: readers accept a regional snapshot only if it matches the trainer's record (BLAKE3 in
signed runs), and the materialiser checks that itself before it writes one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from relay import announce
from relay.announce import Announcement, regional_prefix
from relay.checkpoint import StreamedFile, index_bytes_of, safetensors_stream
from relay.manifest import INDEX_NAME, Manifest, Record, Snapshot, strong_mismatches
from relay.publisher import store_files
from relay.store import NOT_MODIFIED, ConflictError, ManifestRead, ObjectMissing, Store, open_store
from relay.watcher import Reader, SyncError, SyncTimeout

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 120.0  # run(): one sync waits this long for objects that are not there yet, then polls again


def snapshot_files(step: int, tensors: Mapping[str, torch.Tensor], rec: Record) -> dict[str, StreamedFile]:
    """Key -> streamed bytes of the region's snapshot of `step`: safetensors shards in the record's layout
    (what the trainer's snapshot holds, byte for byte) and the index the record implies. The one place the
    regional snapshot format is chosen."""
    prefix = regional_prefix(step)
    files = {}
    for shard in sorted(set(rec.weight_map.values())):
        part = {k: tensors[k] for k, s in rec.weight_map.items() if s == shard}
        files[prefix + shard] = safetensors_stream(part, {"step": str(step)})
    files[prefix + INDEX_NAME] = StreamedFile(index_bytes_of(rec.tensors, rec.weight_map, step=step))
    return files


def write_snapshot(store: Store, step: int, tensors: Mapping[str, torch.Tensor], rec: Record,
                   workers: int = 4) -> Snapshot:
    """Write the region's snapshot of `step` (create-only, streamed) and return its entry for the
    announcement. A file already there with other bytes (a torn or tampered leftover: no reader accepts it)
    is replaced, since what we write was verified against the record."""
    files = snapshot_files(step, tensors, rec)

    def put(key: str, chunks: Any, size: int, xxh3: str) -> None:
        try:
            store.put_immutable_stream(key, chunks, size, xxh3)
        except ConflictError:
            log.warning("%s/%s: holds other bytes than the verified step %d; replacing it", store.url, key, step)
            store.delete([key])
            store.put_immutable_stream(key, chunks, size, xxh3)

    refs = store_files(files, put, workers)
    index_key = regional_prefix(step) + INDEX_NAME
    return Snapshot(step, refs[index_key], tuple(refs[k] for k in sorted(refs) if k != index_key))


def upto(m: Manifest, step: int) -> Manifest:
    """`m` as if `step` were its head: the steps and snapshots up to it (a reader then stops there)."""
    return dataclasses.replace(m, head=step, steps=[s for s in m.steps if s.step <= step],
                               snapshots=[s for s in m.snapshots if s.step <= step])


class _Bootstrap(Store):
    """The region, except that the trainer's snapshot objects missing there are read from the origin (and
    counted): what a fresh region's first snapshot is read through. It announces nothing (the reader plans
    from the manifest's snapshots) and writes nothing."""

    def __init__(self, region: Store, origin: Store | None) -> None:
        self.region, self.origin = region, origin
        self.url = region.url
        self.transfer = region.transfer
        self.origin_bytes = 0
        self._lock = threading.Lock()

    def _from_origin(self, key: str) -> bool:
        return self.origin is not None and key.startswith("snapshots/")

    def _count(self, n: int) -> None:
        with self._lock:
            self.origin_bytes += n

    def get(self, key: str) -> bytes:
        try:
            return self.region.get(key)
        except ObjectMissing:
            if self.origin is None or not self._from_origin(key):
                raise
        data = self.origin.get(key)
        self._count(len(data))
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        try:
            return self.region.get_at_most(key, limit)
        except ObjectMissing:
            if self.origin is None or not self._from_origin(key):
                raise
        data = self.origin.get_at_most(key, limit)
        self._count(len(data))
        return data

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        try:
            yield from self.region.iter_chunks(key)
            return
        except ObjectMissing:
            if self.origin is None or not self._from_origin(key):
                raise
        for chunk in self.origin.iter_chunks(key):
            self._count(len(chunk))
            yield chunk

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        try:
            return self.region.download(key, fd, size)
        except ObjectMissing:
            if self.origin is None or not self._from_origin(key):
                raise
        got = self.origin.download(key, fd, size)
        self._count(got)
        return got

    def read_object(self, key: str, if_none_match: str | None = None) -> Any:
        if key == announce.ANNOUNCE_KEY:
            return None
        return self.region.read_object(key, if_none_match)

    def put_new(self, key: str, data: bytes) -> None:
        raise PermissionError(f"{self.url}: the bootstrap view is read-only")

    def delete(self, keys: list[str]) -> None:
        raise PermissionError(f"{self.url}: the bootstrap view is read-only")

    def list(self, prefix: str) -> dict[str, int]:
        return self.region.list(prefix)

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        raise PermissionError(f"{self.url}: the bootstrap view is read-only")


class _StepReader(Reader):
    """A Reader that reaches the step the materialiser names: its manifest is the view it is given (read and
    verified once per sync by the materialiser), truncated to that step."""

    view: Manifest | None = None

    def read_manifest(self) -> Manifest | None:
        return self.view


class Materialiser:
    """Follows the regional store `region` and keeps its own snapshots there (see the module docstring).

    `workdir`: a directory for snapshot downloads (spooled and verified there before use). `bootstrap_from`:
    the origin's URL (or Store), read for one snapshot when the region has none to start from.
    `every`: also materialise when a step is this many steps past the region's newest snapshot. `keep`: the
    regional snapshots kept (older ones leave the announcement, then their objects are deleted).
    `trusted_keys`: only manifests signed by one of these are followed (the materialiser signs nothing).
    `reroute_after`: seconds an object the region's chain needs may be missing (a replication that failed for
    good, an expired regional snapshot) before the materialiser bootstraps past it from the origin's newest
    snapshot. What it announces never decides which snapshots the region's readers use (PROTOCOL §8.1).
    """

    def __init__(self, region: str | Store, workdir: str | os.PathLike, *, bootstrap_from: str | Store | None = None,
                 every: int | None = None, keep: int = 2, trusted_keys: Any = None,
                 storage_options: dict | None = None, bootstrap_options: dict | None = None, workers: int = 4,
                 retry_initial: float = 0.2, retry_max: float = 5.0, reroute_after: float | None = 300.0) -> None:
        if every is not None and every < 1:
            raise ValueError("every must be >= 1")
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.store = region if isinstance(region, Store) else open_store(region, storage_options)
        self.origin = (bootstrap_from if isinstance(bootstrap_from, Store) or bootstrap_from is None
                       else open_store(bootstrap_from, bootstrap_options))
        if self.origin is not None and self.origin.url == self.store.url:
            raise ValueError(f"{self.store.url}: bootstrap_from is the region itself")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.every, self.keep, self.workers = every, keep, workers
        self.reroute_after = reroute_after
        options = {"trusted_keys": trusted_keys, "workers": workers, "retry_initial": retry_initial,
                   "retry_max": retry_max, "reroute_after": reroute_after}
        self._reader = _StepReader(self.store, **options)
        self._boot_store = _Bootstrap(self.store, self.origin)
        self._boot = _StepReader(self._boot_store, **options)
        self._manifest_reader = Reader(self.store, **options)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sync at a time
        self.step: int | None = None
        self.run_id: str | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.head: int | None = None
        self.snapshots_written = 0
        self.bytes_written = 0
        self.bootstraps = 0
        self.errors = 0
        self.last_error: str | None = None
        self._announced: Announcement | None = None
        self._record: Record | None = None  # the held step's record

    # -- reaching steps -----------------------------------------------------------------------
    def _reach(self, reader: _StepReader, m: Manifest, target: int, deadline: float | None) -> bool:
        """Bring the held state to `target` with `reader` (in place along the chain, or from a snapshot);
        True if it moved. The held state is unchanged if it fails."""
        reader.view = upto(m, target)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with tempfile.TemporaryDirectory(prefix=".spool-", dir=self.workdir) as spool:
            got, tensors, rec = reader.reach(self.step, self.tensors, run=self.run_id, timeout=timeout, spool=spool)
        if tensors is None or rec is None:
            return False
        self.tensors, self.step, self.run_id = tensors, rec.step, got.run
        self._record = rec
        return True

    def _start(self, m: Manifest, deadline: float | None) -> None:
        """Nothing held: the region's newest announced snapshot, else (or if none verifies) one of the trainer's
        snapshots, from the region if it is there, else from the origin (the bootstrap)."""
        ann = self._announcement(m)
        listed = {s.step for s in m.steps}
        regional = [s.step for s in (ann.snapshots if ann is not None else ()) if s.step in listed]
        if regional and not self._rerouted(m, None):
            try:
                self._reach(self._reader, m, regional[-1], deadline)
                return
            except SyncTimeout:
                if not self._rerouted(m, None):
                    raise
                log.warning("%s: the region's snapshot %d has had an object missing for over %.0fs; "
                            "bootstrapping from a trainer's snapshot", self.store.url, regional[-1],
                            self.reroute_after)
            except SyncError as exc:
                log.warning("%s: no regional snapshot to start from (%s); bootstrapping from a trainer's snapshot",
                            self.store.url, exc)
        before = self._boot_store.origin_bytes
        self._reach(self._boot, m, m.snapshots[-1].step, deadline)
        self.bootstraps += 1
        self._reader.forget_missing()  # what was missing below the snapshot is not needed any more
        log.info("%s: bootstrapped at step %d (%d bytes read from the origin %s)", self.store.url, self.step,
                 self._boot_store.origin_bytes - before, None if self.origin is None else self.origin.url)

    def _next(self, m: Manifest, deadline: float | None) -> None:
        """One step forward: the chain from the held step; a step only a snapshot reaches (a new tensor set)
        from the region's snapshots or, failing that, a trainer's snapshot (as in a bootstrap)."""
        held = self.step
        nxt = next(s for s in m.steps if held is None or s.step > held)
        if self._rerouted(m, held):
            self._bootstrap_past(m, deadline)
            return
        try:
            self._reach(self._reader, m, nxt.step, deadline)
            return
        except SyncTimeout:
            if not self._rerouted(m, held):
                raise
            self._bootstrap_past(m, deadline)
            return
        except SyncError as exc:
            if nxt.parts is not None and nxt.parent == held:
                raise
            log.info("%s: step %d has no delta from %s (%s); reading its snapshot", self.store.url, nxt.step, held, exc)
        self.step = self.tensors = self.run_id = None
        self._reach(self._boot, m, nxt.step, deadline)
        self.bootstraps += 1

    def _rerouted(self, m: Manifest, held: int | None) -> bool:
        """Whether an object the region's path needs has been missing for reroute_after (across syncs) and the
        origin's newest snapshot lies past the held step: then only a bootstrap gets past it."""
        since = self._reader.missing_since()
        return (since is not None and self.reroute_after is not None and self.origin is not None
                and time.monotonic() - since >= self.reroute_after
                and (held is None or m.snapshots[-1].step > held))

    def _bootstrap_past(self, m: Manifest, deadline: float | None) -> None:
        """A held step the region's chain cannot leave (an object missing for good): the origin's newest
        snapshot, as in a bootstrap. The held state stays if that fails."""
        target = m.snapshots[-1].step
        log.warning("%s: an object the chain from step %s needs has been missing for over %.0fs; bootstrapping "
                    "at the trainer's snapshot %d", self.store.url, self.step, self.reroute_after, target)
        held = self.step, self.tensors, self.run_id
        self.step = self.tensors = self.run_id = None
        try:
            self._reach(self._boot, m, target, deadline)
        except BaseException:
            self.step, self.tensors, self.run_id = held
            raise
        self.bootstraps += 1
        self._reader.forget_missing()

    # -- the region's snapshots ---------------------------------------------------------------
    def _announcement(self, m: Manifest) -> Announcement | None:
        ann, _ = announce.read_announcement(self.store)
        self._announced = ann if ann is not None and ann.run == m.run else None
        return self._announced

    def _due(self, m: Manifest) -> bool:
        """Whether the held step gets a regional snapshot: a step the trainer snapshotted, `every` steps past
        the region's newest, or the first step past a trainer's snapshot the region missed (committed late)."""
        step = self.step
        if step is None:
            return False
        ann = self._announced
        # an announced step past the head is no region's snapshot yet (a bucket writer's entry, say): it
        # must not count as the newest, or nothing would ever be due again
        have = [] if ann is None else [s.step for s in ann.snapshots if s.step <= m.head]
        if step in have:
            return False
        newest = max(have, default=None)
        if newest is not None and step < newest:  # a newer one serves every reader; announcing is refused anyway
            return False
        origin = {s.step for s in m.snapshots}
        if step in origin:
            return True
        if self.every is not None and (newest is None or step - newest >= self.every):
            return True
        return any((newest is None or newest < o) and o < step for o in origin)

    def _materialise(self, m: Manifest) -> None:
        """Write and announce the region's snapshot of the held step (checked against its record first)."""
        rec, tensors = self._record, self.tensors
        if tensors is None or rec is None or rec.step != self.step:
            raise SyncError("internal: materialising without the held step's record")
        bad = strong_mismatches(tensors, rec.tensors)
        if bad:  # the chain reached the record's xxh3 digests but not its BLAKE3: never write that
            self.step = self.tensors = self.run_id = None
            raise SyncError(f"{self.store.url}: step {rec.step} does not match the BLAKE3 of its record "
                            f"(tensors {bad[:5]}); dropped the held state")
        snap = write_snapshot(self.store, rec.step, tensors, rec, self.workers)
        run, keep = m.run, self.keep
        overtaken: list[int] = []

        now = announce.region_head(self.store)  # read again: a materialiser behind works from an older one
        head = max(m.head, now[0] if now is not None and now[1] == run else -1)

        def add(cur: Announcement | None) -> Announcement | None:
            overtaken.clear()
            base = cur if cur is not None and cur.run == run else Announcement(run)
            if base.snapshot(snap.step) == snap:
                return None
            # Entries past the head read here count for nothing (not newer, no place among the `keep`: a forged
            # one at step 10^6 must not block us) but stay announced as they are, as in announce.collect: with
            # an older manifest replayed into the region they are its genuine newer snapshots.
            past = [s for s in base.snapshots if s.step > head]
            base = Announcement(run, tuple(s for s in base.snapshots if s.step <= head))
            newer = [s.step for s in base.snapshots if s.step > snap.step]
            if newer:
                # Another materialiser announced a newer snapshot while we wrote this one, and a collect since
                # may have deleted our files (unnamed, below the newest): announcing now could name objects
                # the region lacks (PROTOCOL §8.1 item 4).
                overtaken.append(max(newer))
                return None
            snaps = sorted([s for s in base.snapshots if s.step != snap.step] + [snap], key=lambda s: s.step)[-keep:]
            return Announcement(run, tuple(snaps + past[:announce.MAX_REGIONAL_SNAPSHOTS - len(snaps)]))

        self._announced = announce.update_announcement(self.store, add)
        if overtaken:
            log.info("%s: step %d's snapshot not announced: step %d's was announced while it was written; its "
                     "objects are left to the regional gc", self.store.url, snap.step, overtaken[0])
            announce.collect(self.store, keep)
            return
        self.snapshots_written += 1
        self.bytes_written += snap.bytes
        log.info("%s: regional snapshot of step %d written and announced (%d bytes)", self.store.url, snap.step,
                 snap.bytes)
        announce.collect(self.store, keep)  # objects of snapshots that left the announcement

    # -- driving ------------------------------------------------------------------------------
    def sync_once(self, timeout: float | None = None) -> bool:
        """Follow the region to its head, step by step, materialising where due; True when it did something
        (moved, or wrote a snapshot). Raises SyncTimeout / SyncError; the held state stays the last good step."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                return self._sync(deadline)
            except Exception as exc:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                raise

    def _sync(self, deadline: float | None) -> bool:
        m = self._manifest_reader.read_manifest()
        if m is None:
            return False
        self.head = m.head
        if self.run_id is not None and m.run != self.run_id:
            log.warning("%s: the region now holds run %s (was %s); starting again", self.store.url, m.run,
                        self.run_id)
            self.step = self.tensors = self.run_id = None
        if self.step is not None and self.step > m.head:
            return False
        did = False
        if self.step is None or m.step(self.step) is None:
            self.step = self.tensors = self.run_id = None
            self._start(m, deadline)
            did = True
        else:
            self._announcement(m)
        while True:
            if self._due(m):
                self._materialise(m)
                did = True
            if self.step is None or self.step >= m.head or self._stop.is_set():
                return did
            self._next(m, deadline)
            did = True

    def run(self, poll_interval: float = 1.0) -> None:
        """Poll the region's manifest (conditional reads) and sync on every change, until stop(). Failures are
        logged and retried at the next poll."""
        etag = None
        self._stop.clear()
        while not self._stop.is_set():
            try:
                got = self.store.read_manifest(if_none_match=self._manifest_reader.refused_etag or etag)
                if got is not NOT_MODIFIED and got is not None:
                    self.sync_once(timeout=SYNC_TIMEOUT)
                    if isinstance(got, ManifestRead):
                        etag = got.etag
            except Exception as exc:  # noqa: BLE001 - the region keeps its snapshots; retried next poll
                log.error("%s: materialiser sync failed, holding step %s: %s", self.store.url, self.step, exc)
            self._stop.wait(poll_interval)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop and let go of the held state."""
        self.stop()
        with self._lock:
            self.step = self.tensors = self.run_id = None

    def __enter__(self) -> "Materialiser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict:
        """Where it stands: the step held and the region's head, the announced snapshots, what it wrote and
        what it read from the origin."""
        ann = self._announced
        return {"region": self.store.url, "run": self.run_id, "step": self.step, "head": self.head,
                "regional_snapshots": [] if ann is None else [s.step for s in ann.snapshots],
                "snapshots_written": self.snapshots_written, "bytes_written": self.bytes_written,
                "bootstraps": self.bootstraps, "bootstrap_bytes": self._boot_store.origin_bytes,
                "bytes_downloaded": self._reader.bytes_downloaded + self._boot.bytes_downloaded,
                "errors": self.errors, "last_error": self.last_error}


__all__ = ["Materialiser", "write_snapshot", "snapshot_files", "upto"]
