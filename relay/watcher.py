"""Rollout side: follow a run's head into a local directory that always holds one verified step.

Reader plans the cheapest way from what is held to the head (apply the chain, or start from a
snapshot), downloads it in parallel, applies it and checks every step against the trainer's
record. Watcher persists the result: a new version directory under DIR/.versions, then one
atomic symlink swap of DIR/.current; the visible names in DIR are symlinks through .current, so a
reader (or a crash) sees the old step or the new one, never a mix.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, overload

import torch
from safetensors import SafetensorError

import codec
from relay import checkpoint, shards
from relay.manifest import (DestState, Manifest, ManifestError, ObjRef, Part, Record, Snapshot, Step, TensorInfo,
                            mismatches, safe_shard_name)
from relay.files import fsync_dir
from relay.retry import Backoff
from relay.signing import TrustedKeys
from relay.store import NOT_MODIFIED, ObjectMissing, Store, open_store

log = logging.getLogger(__name__)

STATE_NAME = "relay-state.json"
_TMP_PATTERNS = (".current.tmp-*", ".link.tmp-*")  # what a crash mid-swap leaves in DEST
_VERSION_NAME = re.compile(r"[0-9]+-[0-9a-f]{8}")  # .versions/<step>-<nonce>, as _persist names them
LOCK_NAME = ".lock"  # flock'ed for a Watcher's lifetime: one watcher per DEST


class SyncError(RuntimeError):
    """The watcher cannot reach the head (no verified path, another run, ...); DIR keeps its last good step."""


class SyncTimeout(SyncError, TimeoutError):
    """The head was not reached in the time allowed (objects still missing); DIR keeps its last good step."""


class DestLocked(SyncError):
    """Another watcher (process or object) holds DEST: two would delete each other's committed versions."""


class HotLoadError(SyncError):
    """The module could not take the held step; it stays entirely at its previous one, retried next sync."""


class _BadVersion(Exception):
    """A local version proven damaged (state file, shards, digests): the only kind start-up deletes."""


class _Reselect(Exception):
    """A partial replica holds other tensors than it selects at the head: it starts again from a snapshot."""


class _VerifyError(Exception):
    """Objects (by reference) whose bytes failed a check; the reader refetches them once, then backs off."""

    def __init__(self, refs: list[ObjRef], reason: str) -> None:
        super().__init__(reason)
        self.refs = refs


@dataclass
class Plan:
    """Start from `snapshot` (or from the held step when None), then apply `steps` in order.

    A partial replica's plan (`want` set) downloads only the parts covering tensors it selects and,
    from the snapshot, only `files` (the ones its index says hold them)."""

    snapshot: Snapshot | None
    steps: list[Step]
    cost: int  # bytes to download
    files: tuple[ObjRef, ...] | None = None  # the snapshot files to fetch; None: all of them
    want: shards.Selector | None = None

    def parts(self, s: Step) -> list[Part]:
        """The parts of chain step `s` this plan downloads and applies."""
        return [p for p in s.delta_parts if shards.needs_part(p, self.want)]  # steps of a chain: each has a delta

    def keys(self, m: Manifest) -> list[ObjRef]:
        refs: list[ObjRef] = []
        if self.snapshot is not None:
            files = self.snapshot.files if self.files is None else self.files
            refs += [self.snapshot.index, *files, m.step_of_snapshot(self.snapshot).record]
        for s in self.steps:
            refs += [p.ref for p in self.parts(s)]
        if self.steps:  # intermediate steps are checked by the payloads' own target digests
            refs.append(self.steps[-1].record)
        return refs


def plan_path(m: Manifest, held: int | None, excluded: Set[str] = frozenset(), *,
              want: shards.Selector | None = None,
              snapshot_files: Mapping[int, tuple[ObjRef, ...]] | None = None) -> Plan | None:
    """Cheapest path to the head in bytes: the chain from `held`, or any snapshot plus its chain.

    Linear in the manifest's length (suffix sums over the steps), so a long or hostile manifest
    cannot stall the reader: trying m.chain() from every snapshot would be quadratic. Ties go to
    the held step, then to the oldest snapshot. A partial replica (`want`) counts only the parts
    covering tensors it selects and, per snapshot step, the files `snapshot_files` gives (default all).
    """
    steps = m.steps
    n = len(steps)
    index = {s.step: i for i, s in enumerate(steps)}
    lowest = n - 1  # a chain from steps[i] reaches the head iff i >= lowest
    while lowest > 0 and steps[lowest].parts is not None and steps[lowest].parent == steps[lowest - 1].step:
        lowest -= 1
    tail = [0] * n  # bytes of the parts of every step after i
    for i in range(n - 1, 0, -1):
        parts = [p for p in steps[i].parts or () if shards.needs_part(p, want)]
        tail[i - 1] = tail[i] + sum(p.ref.size for p in parts)
        if i > lowest and any(p.ref.key in excluded for p in parts):
            lowest = i  # chains that apply an excluded part are out
    head = steps[-1].record
    best: Plan | None = None
    best_i = -1

    def consider(snap: Snapshot | None, i: int) -> None:
        nonlocal best, best_i
        if i < lowest:
            return
        files = None if snap is None or snapshot_files is None else snapshot_files.get(snap.step)
        refs = [] if snap is None else [snap.index, *(snap.files if files is None else files), steps[i].record]
        if i < n - 1:
            refs.append(head)
        if any(r.key in excluded for r in refs):
            return
        cost = tail[i] + sum(r.size for r in refs)
        if best is None or cost < best.cost:
            best, best_i = Plan(snap, [], cost, files, want), i

    if held is not None and held in index:
        consider(None, index[held])
    for snap in m.snapshots:
        consider(snap, index[snap.step])
    if best is not None:
        best.steps = steps[best_i + 1:]
    return best


@dataclass
class _Failure:
    """A reference that failed verification `count` times: not downloaded again before `retry_at` (monotonic)."""

    count: int
    retry_at: float


class Reader:
    """Brings a state (or nothing) to a run's head, verified; waits out objects that are not there yet.

    A reference (key, size and tags) that fails verification twice is planned around, and not
    downloaded again, for failure_backoff_initial seconds, doubling at each further failure up to
    failure_backoff_max: a persistently bad object costs a bounded number of downloads, not two per
    poll. Failures are remembered per ObjRef, so a manifest naming other bytes is a fresh try.

    `tensors` (names, or a predicate on names) makes a partial replica: it downloads only the delta
    parts and snapshot files that hold those tensors and returns and verifies exactly them.
    """

    def __init__(self, store: Store, *, workers: int = 8, retry_initial: float = 0.2, retry_max: float = 5.0,
                 reroute_after: float | None = 300.0, trusted_keys: Any = None,
                 failure_backoff_initial: float = 30.0, failure_backoff_max: float = 3600.0,
                 tensors: Any = None) -> None:
        self.store = store
        self.want = shards.selector(tensors)
        self._names = None if tensors is None or callable(tensors) else frozenset(tensors)
        self._indexes: dict[ObjRef, dict[str, set[str]]] = {}  # snapshot index -> its files' tensors (partial)
        self.trusted = TrustedKeys.from_option(trusted_keys)
        self.reroute_after = reroute_after
        self.workers = workers
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.waiting = Backoff(retry_initial, retry_max)  # for objects that are not there yet
        if failure_backoff_initial <= 0 or failure_backoff_max < failure_backoff_initial:
            raise ValueError("need 0 < failure_backoff_initial <= failure_backoff_max")
        self.failure_backoff = Backoff(failure_backoff_initial, failure_backoff_max)  # for objects that fail checks
        self.bytes_downloaded = 0
        self._count_lock = threading.Lock()
        self._cache: dict[ObjRef, bytes] = {}  # by reference: bytes are reused only for what they were checked against
        self._failures: dict[ObjRef, _Failure] = {}
        self._warned_unchecked = False

    def read_manifest(self) -> Manifest | None:
        """The current manifest; with trusted keys, only one they signed (SignatureError otherwise)."""
        got = self.store.read_manifest()
        if got is None:
            return None
        where = f"{self.store.url}/manifest.json"
        m = Manifest.parse(got.data, where)
        if self.trusted is not None:
            self.trusted.verify(m, where)
        elif m.signatures and not self._warned_unchecked:
            self._warned_unchecked = True  # once per Reader: the operator probably forgot the key
            log.warning("%s: run is signed but this watcher trusts no key; signatures are not checked; "
                        "pass --trusted-key", self.store.url)
        return m

    def _fetch_one(self, ref: ObjRef) -> bytes:
        if ref in self._cache:
            return self._cache[ref]
        data = self.store.get(ref.key)
        with self._count_lock:
            self.bytes_downloaded += len(data)
        problem = ref.matches(data)  # size, xxh3 and, in a signed manifest, SHA-256: before any byte is used
        if problem:
            raise _VerifyError([ref], f"{ref.key}: {problem}")
        self._cache[ref] = data
        return data

    def _fetch(self, refs: list[ObjRef]) -> dict[str, bytes]:
        with ThreadPoolExecutor(max(1, min(self.workers, len(refs)))) as pool:
            return dict(zip((r.key for r in refs), pool.map(self._fetch_one, refs)))

    def _record(self, data: bytes, ref: ObjRef, run: str, step: int) -> Record:
        key = ref.key
        try:
            rec = Record.parse(data, key)
        except ManifestError as exc:
            raise _VerifyError([ref], str(exc)) from None
        if rec.run != run or rec.step != step:
            raise _VerifyError([ref], f"{key}: record of run {rec.run} step {rec.step}, expected {run} step {step}")
        return rec

    def _execute(self, m: Manifest, plan: Plan,
                 held: dict[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], Record]:
        got = self._fetch(plan.keys(m))
        if plan.snapshot is not None:
            snap = plan.snapshot
            rec_ref = m.step_of_snapshot(snap).record
            rec = self._record(got[rec_ref.key], rec_ref, m.run, snap.step)
            files = snap.files if plan.files is None else plan.files
            try:  # row slices of a sharded trainer's files put together; whole tensors as they are
                tensors = shards.assemble([(f, got[f.key]) for f in files], rec.tensors, self.want)
            except shards.ShardError as exc:
                raise _VerifyError(exc.refs, str(exc)) from None
            bad = mismatches(tensors, self.expected(rec))
            if bad:
                # Blame the snapshot alone: a bad record fails again on whichever path checks it next, but a
                # good one (typically the head's) must stay usable for the chain from another snapshot.
                raise _VerifyError(list(snap.files), f"snapshot {snap.step} does not match its record "
                                                     f"(tensors {bad[:5]})")
        else:
            if held is None:
                raise SyncError("internal: chain plan without a held state")
            tensors = {k: v.clone() for k, v in held.items()}
            rec = None
        for s in plan.steps:
            covered: set[str] = set()
            try:  # every held tensor covered exactly once, whole or by row ranges (no overlap, no gap)
                shards.check_tiling(s.step, s.delta_parts, tensors)
            except shards.ShardError as exc:
                raise _VerifyError(exc.refs, str(exc)) from None
            for part in plan.parts(s):
                target = shards.part_targets(part, tensors)  # row ranges: views into the held tensors
                try:  # verifies every tensor it covers, or changes nothing
                    codec.apply_(target, got[part.ref.key], subset=self.want is not None)
                except codec.DeltaError as exc:
                    raise _VerifyError([part.ref], f"{part.ref.key}: {exc}") from None
                covered.update(target)
            if covered != set(tensors):
                raise _VerifyError([p.ref for p in s.delta_parts],
                                   f"step {s.step}: parts leave tensors unverified "
                                   f"{sorted(set(tensors) - covered)[:5]}")
        if plan.steps:
            last = plan.steps[-1]
            rec = self._record(got[last.record.key], last.record, m.run, last.step)
            expected = self.expected(rec)
            if plan.snapshot is None and set(expected) != set(tensors):
                raise _Reselect(f"step {last.step}: this replica's selection is {len(expected)} tensors, it "
                                f"holds {len(tensors)}; starting from a snapshot")
            bad = mismatches(tensors, expected)
            if bad:
                raise _VerifyError([p.ref for s in plan.steps for p in s.delta_parts] + [last.record],
                                   f"step {last.step} does not match its record (tensors {bad[:5]})")
        if rec is None:  # plan_path never plans nothing: held is below the head, so a chain plan has steps
            raise SyncError("internal: chain plan without steps")
        return tensors, rec

    def expected(self, rec: Record) -> dict[str, TensorInfo]:
        """What a reached state must hold: the record's tensors, or a partial replica's selection of them."""
        if self.want is None:
            return rec.tensors
        picked = {k: v for k, v in rec.tensors.items() if self.want(k)}
        missing = sorted((self._names or frozenset()) - set(rec.tensors))
        if missing or not picked:
            raise SyncError(f"{self.store.url}: step {rec.step} has no tensor(s) "
                            f"{missing[:5] if missing else 'this replica selects'}")
        return picked

    def _snapshot_files(self, m: Manifest) -> dict[int, tuple[ObjRef, ...]]:
        """Per snapshot, the files holding a tensor this partial replica selects, from the snapshot's index
        (fetched and checked once per index). A snapshot whose index cannot be read yet counts all files."""
        want = self.want
        out: dict[int, tuple[ObjRef, ...]] = {}
        if want is None:
            return out
        live = {snap.index for snap in m.snapshots}
        for ref in [r for r in self._indexes if r not in live]:
            del self._indexes[ref]
        for snap in m.snapshots:
            if snap.index not in self._indexes:
                try:
                    self._indexes[snap.index] = shards.index_files(self._fetch_one(snap.index), snap)
                except (ObjectMissing, _VerifyError, ManifestError) as exc:
                    log.info("%s: cannot read yet (%s); counting every file of snapshot %d", snap.index.key, exc,
                             snap.step)
                    continue
            holds = self._indexes[snap.index]
            out[snap.step] = tuple(f for f in snap.files if any(want(n) for n in holds.get(f.key, ())))
        return out

    def _backed_off(self, m: Manifest, now: float) -> set[str]:
        """Keys of this manifest's references still inside their failure backoff; forgets stale failures."""
        refs = set(m.refs())
        for ref in [r for r, f in self._failures.items() if r not in refs and f.retry_at <= now]:
            del self._failures[ref]  # bounded: only references of the current manifest or still backing off
        return {r.key for r in refs if r in self._failures and now < self._failures[r].retry_at}

    def _failed(self, refs: list[ObjRef], now: float) -> float:
        """Back off from `refs` (doubling per failure); returns the longest backoff now in force."""
        longest = 0.0
        for ref in refs:
            f = self._failures.get(ref)
            count = 1 if f is None else f.count + 1
            backoff = self.failure_backoff.delay(count)
            self._failures[ref] = _Failure(count, now + backoff)
            longest = max(longest, backoff)
        return longest

    # With nothing held the head is always new: the tensors and their record come back.
    @overload
    def reach(self, held_step: None, held: None, *, run: str | None = None,
              timeout: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor], Record]: ...

    @overload
    def reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, *, run: str | None = None,
              timeout: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]: ...

    def reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, *, run: str | None = None,
              timeout: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]:
        """(manifest, tensors, record) at the head; tensors None if already there (or the head is older)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waits = 0
        refetched: set[ObjRef] = set()
        failed_here: set[ObjRef] = set()  # failed twice in this call: out for the rest of it, whatever the backoff
        missing_since: dict[str, float] = {}
        rerouted: set[str] = set()  # missing for longer than reroute_after: try another complete path
        try:
            while True:
                m = self.read_manifest()
                waiting_for = None
                if m is None:
                    waiting_for = f"{self.store.url}/manifest.json (no run yet)"
                else:
                    if run is not None and held_step is not None and m.run != run:
                        raise SyncError(f"{self.store.url}: holds run {m.run}, the local step {held_step} is from run "
                                        f"{run}; refusing to mix runs")
                    if held_step is not None and held_step >= m.head:
                        if held_step > m.head:
                            log.warning("%s: head %d is older than the held step %d; keeping %d", self.store.url,
                                        m.head, held_step, held_step)
                        return m, None, None
                    excluded = self._backed_off(m, time.monotonic()) | {r.key for r in m.refs() if r in failed_here}
                    kw: dict[str, Any] = {}
                    if self.want is not None:
                        kw = {"want": self.want, "snapshot_files": self._snapshot_files(m)}
                    plan = (plan_path(m, held_step, excluded | rerouted, **kw)
                            or plan_path(m, held_step, excluded, **kw))
                    if plan is None:
                        raise SyncError(f"{self.store.url}: no verified path to head {m.head} "
                                        f"(objects that failed verification, not fetched again until their backoff "
                                        f"ends: {sorted(excluded)[:5]})")
                    try:
                        tensors, rec = self._execute(m, plan, held)
                    except _Reselect as exc:  # a partial replica whose held tensors are not its selection
                        log.warning("%s", exc)
                        held_step, held = None, None
                        continue
                    except ObjectMissing as exc:
                        waiting_for = str(exc)
                        if exc.key is not None and self.reroute_after is not None:
                            first = missing_since.setdefault(exc.key, time.monotonic())
                            if exc.key not in rerouted and time.monotonic() - first >= self.reroute_after:
                                rerouted.add(exc.key)
                                log.warning("%s missing for %.0fs; looking for another complete path (a newer "
                                            "snapshot), still waiting for it if there is none", exc,
                                            time.monotonic() - first)
                                continue
                    except _VerifyError as exc:
                        for ref in exc.refs:
                            self._cache.pop(ref, None)
                        if any(r not in refetched and r not in self._failures for r in exc.refs):
                            refetched.update(exc.refs)
                            log.warning("verification failed, discarding and refetching: %s", exc)
                        else:
                            failed_here.update(exc.refs)
                            backoff = self._failed(exc.refs, time.monotonic())
                            log.warning("verification failed again, planning around %s for %.0fs (snapshot "
                                        "fallback): %s", [r.key for r in exc.refs], backoff, exc)
                        continue
                    else:
                        for ref in plan.keys(m):
                            self._failures.pop(ref, None)
                        return m, tensors, rec
                waits += 1
                delay = self.waiting.delay(waits)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise SyncTimeout(f"gave up after {timeout:g}s waiting for {waiting_for}")
                log.info("waiting %.2fs for %s", delay, waiting_for)
                time.sleep(delay)
        finally:
            self._cache.clear()


def _remove_entry(p: Path) -> None:
    """Delete a directory tree, file or link without following a link: a link is unlinked (and logged)."""
    if p.is_symlink():
        log.warning("%s: a symlink (to %s) where the watcher keeps its own files; removing the link, its "
                    "target is left alone", p, os.readlink(p))
        p.unlink(missing_ok=True)
    elif p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


class Watcher:
    """Keeps `dest` on the head of the run at `url`.

    Contract for readers of `dest`: ignoring names that begin with '.', and following symlinks,
    it shows exactly one complete, verified step (safetensors in the published layout plus
    relay-state.json), or nothing before the first sync. It never moves to an older step.
    on_update(step, tensors) runs after each persisted step; `module` is updated in place too.
    With `trusted_keys` (PEM paths or Ed25519 public keys) only manifests signed by one of them are
    acted on, and every object is checked against the SHA-256 the signed manifest gives it (without
    keys a signed run is followed unchecked, with one warning).
    One Watcher per `dest`: it flocks DEST/.lock until close() (or `with Watcher(...)`), and a second
    one raises DestLocked. An object that fails verification twice is not downloaded again for
    failure_backoff_initial seconds, doubling per failure up to failure_backoff_max.
    An object the manifest names but the store lacks is waited for (backoff from retry_initial to
    retry_max seconds); after reroute_after seconds the watcher also considers other complete paths
    (a newer snapshot) that avoid it. It never skips a step of a path or applies part of a chain.
    `tensors` (names or a predicate) makes DEST a partial replica (a pipeline stage, an expert-parallel
    rank): only those tensors are downloaded, verified and written, and relay-state.json says
    `"partial": true`; a full watcher never takes a partial DEST's step as its own, nor the reverse.
    """

    def __init__(self, url: str, dest: str | os.PathLike, *, poll_interval: float = 1.0,
                 storage_options: dict | None = None, on_update: Callable[[int, dict], Any] | None = None,
                 module: torch.nn.Module | None = None, workers: int = 8, retry_initial: float = 0.2,
                 retry_max: float = 5.0, reroute_after: float | None = 300.0, trusted_keys: Any = None,
                 failure_backoff_initial: float = 30.0, failure_backoff_max: float = 3600.0,
                 tensors: Any = None) -> None:
        self.url = url
        self.dest = Path(dest)
        self.poll_interval = poll_interval
        self.on_update = on_update
        self.module = module
        self.store = open_store(url, storage_options)
        self.reader = Reader(self.store, workers=workers, retry_initial=retry_initial, retry_max=retry_max,
                             reroute_after=reroute_after, trusted_keys=trusted_keys,
                             failure_backoff_initial=failure_backoff_initial, failure_backoff_max=failure_backoff_max,
                             tensors=tensors)
        self._stop = threading.Event()
        self.step: int | None = None
        self.run_id: str | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.module_step: int | None = None  # the step `module` holds (set by a successful hot-load)
        self.delivered_step: int | None = None  # the last step on_update accepted
        self._module_tensors: dict[str, torch.Tensor] | None = None  # what the module holds, to restore from
        self._held_partial = False  # the loaded version's relay-state.json says "partial"
        self.dest.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    def _take_lock(self):
        """flock DEST/.lock (exclusive, non-blocking) before touching DEST; DestLocked if another watcher has it.

        A file object, so a Watcher that is dropped without close() still releases the lock when collected.
        """
        path = self.dest / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        f = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = f.read(32).decode("ascii", "replace").strip()
            f.close()
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            by = f" (pid {holder})" if holder.isdigit() else ""
            raise DestLocked(f"{self.dest}: another watcher is running on this directory{by}; it holds "
                             f"{path}. One watcher per directory: stop the other one first") from None
        f.truncate(0)
        f.write(str(os.getpid()).encode())
        f.flush()
        return f

    def close(self) -> None:
        """Stop run() and release DEST's lock; the Watcher cannot sync afterwards. Idempotent."""
        self._stop.set()
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.close()  # closing the descriptor releases the flock

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bytes_downloaded(self) -> int:
        return self.reader.bytes_downloaded

    # -- local directory ----------------------------------------------------------------------
    def _recover(self) -> None:
        """Load the held step (verified against its state file) and tidy what a crash left behind.

        Links are never followed while cleaning up: a symlinked .versions, a symlinked entry in it, or a
        .current naming anything but .versions/<version> is unlinked as a link (with a warning), so a
        planted link cannot make start-up delete or load a directory outside DEST. Only a proven-bad
        version (see _load_version) is removed; any other failure to load it (MemoryError, an I/O error)
        is raised and nothing is deleted.
        """
        versions = self.dest / ".versions"
        if versions.is_symlink():
            log.warning("%s: .versions is a symlink (to %s); removing the link, its target is left alone",
                        self.dest, os.readlink(versions))
            versions.unlink()
        name = self._current_name()
        keep = None
        if name is not None:
            try:
                self.step, self.run_id, self.tensors = self._load_version(versions / name)
                keep = name
                log.info("%s: holding step %d", self.dest, self.step)
                if not self._holds_selection(self.tensors):  # shown until the first sync replaces it, not built on
                    log.warning("%s: step %d holds %s than this watcher selects; starting from a snapshot", self.dest,
                                self.step, "other tensors" if self.reader.want else "only some tensors")
                    self.step = self.run_id = self.tensors = None
            except _BadVersion as exc:
                log.warning("%s: held step unusable (%s); removing it and starting fresh", self.dest, exc)
        self.module_step = self.delivered_step = self.step  # a held step counts as delivered (as before)
        if versions.is_dir():  # a real directory: the link case is gone above
            for v in versions.iterdir():
                if v.name != keep:
                    _remove_entry(v)
        for pattern in _TMP_PATTERNS:
            for p in self.dest.glob(pattern):
                _remove_entry(p)
        if keep is not None:
            self._link_visible(versions / keep, strict=False)
        self._drop_dangling()

    def _holds_selection(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a loaded version is this watcher's kind: full for a full watcher; for a partial one,
        partial and only tensors it selects (a chain then reaches exactly its selection, or it reselects)."""
        want = self.reader.want
        if want is None:
            return not self._held_partial
        return self._held_partial and all(want(k) for k in tensors)

    def _current_name(self) -> str | None:
        """The version .current names, if it is a link to .versions/<version name> that is a real directory."""
        current = self.dest / ".current"
        if not current.is_symlink():
            return None
        target = os.readlink(current)
        head, _, name = target.partition("/")
        if head != ".versions" or not _VERSION_NAME.fullmatch(name):
            log.warning("%s: .current points to %r, not into .versions; removing the link, its target is left "
                        "alone", self.dest, target)
            current.unlink()
            return None
        entry = self.dest / ".versions" / name
        if entry.is_symlink() or not entry.is_dir():
            return None  # a planted link is unlinked by the cleanup; a missing version is simply not held
        return name

    def _load_version(self, path: Path) -> tuple[int, str, dict[str, torch.Tensor]]:
        """(step, run, tensors) of a version directory, checked against its state file.

        _BadVersion only when the version is proven bad: its state file is missing or not valid, a shard
        is missing or not parseable by safetensors, or the digests differ from the state file. Anything
        else (MemoryError, an OSError other than a missing file) propagates: the version may be fine.
        """
        try:
            state = DestState.parse((path / STATE_NAME).read_bytes(), str(path / STATE_NAME))
        except FileNotFoundError:
            raise _BadVersion(f"no {STATE_NAME}") from None
        except ManifestError as exc:  # not JSON, or not the schema
            raise _BadVersion(f"{STATE_NAME} is not valid ({exc})") from None
        step, run, expected = state.step, state.run, state.tensors
        self._held_partial = state.partial
        try:
            tensors, _ = checkpoint.load(path)
        except FileNotFoundError as exc:
            raise _BadVersion(f"missing file ({exc})") from None
        except (SafetensorError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _BadVersion(f"unreadable checkpoint ({exc!r})") from None
        bad = mismatches(tensors, expected)
        if bad:
            raise _BadVersion(f"tensors {bad[:5]} do not match the state file")
        return step, run, tensors

    def _drop_dangling(self) -> None:
        for p in self.dest.iterdir():
            if p.is_symlink() and not p.name.startswith(".") and not p.exists():
                p.unlink()

    def _link_visible(self, version: Path, strict: bool = True) -> None:
        """Make each visible name of `version` exactly the link the watcher creates: .current/<name>.

        A missing name is created; a symlink pointing anywhere else (a Hugging Face hub download links into
        its blob cache) is replaced atomically (temporary link + rename), its target never touched; a name
        that is not a symlink stops the update (SyncError) when `strict`, else it is only logged.
        """
        names = sorted(f.name for f in version.iterdir())
        for name in names:
            link = self.dest / name
            if os.path.lexists(link) and not link.is_symlink():
                message = f"{link}: a regular file in the watcher's directory; the watcher owns {self.dest}"
                if strict:
                    raise SyncError(message)
                log.warning("%s; readers of this name do not see the held step", message)
        for name in names:
            link = self.dest / name
            want = os.path.join(".current", name)
            if link.is_symlink():
                target = os.readlink(link)
                if target == want:
                    continue
                tmp = self.dest / f".link.tmp-{uuid.uuid4().hex[:8]}"
                os.symlink(want, tmp)
                os.replace(tmp, link)
                log.warning("%s: replaced a symlink to %s (not the watcher's) with one through .current; its "
                            "target is left alone", link, target)
            elif not os.path.lexists(link):
                os.symlink(want, link)

    def _versions_dir(self) -> Path:
        """DEST/.versions as a real directory (a link planted since start-up is unlinked, never written through)."""
        versions = self.dest / ".versions"
        if versions.is_symlink():
            log.warning("%s: .versions is a symlink (to %s); removing the link, its target is left alone",
                        self.dest, os.readlink(versions))
            versions.unlink()
        versions.mkdir(exist_ok=True)
        return versions

    def _persist(self, m: Manifest, rec: Record, tensors: dict[str, torch.Tensor]) -> None:
        bad = sorted({v for v in rec.weight_map.values() if not safe_shard_name(v)})
        covers = set(rec.weight_map) >= set(tensors) if self.reader.want else set(rec.weight_map) == set(tensors)
        if bad or not covers:  # Record.parse refuses these; never write outside DEST
            raise SyncError(f"step {rec.step}: refusing to write shard names {[b[:100] for b in bad[:3]]} "
                            f"in {self.dest}")
        versions = self._versions_dir()
        name = f"{rec.step}-{uuid.uuid4().hex[:8]}"
        try:
            self._write_version(m, rec, tensors, versions, name)
        except BaseException:
            # A failed write (disk full, I/O error) must not leave a partial version behind: it would hold
            # the space the next attempt needs until a restart. Past the swap the new version is DEST's.
            if os.path.realpath(self.dest / ".current") != os.path.realpath(versions / name):
                shutil.rmtree(versions / f".{name}.tmp", ignore_errors=True)
                shutil.rmtree(versions / name, ignore_errors=True)
                for pattern in _TMP_PATTERNS:
                    for p in self.dest.glob(pattern):
                        p.unlink(missing_ok=True)
                self._drop_dangling()
            raise

    def _write_version(self, m: Manifest, rec: Record, tensors: dict[str, torch.Tensor], versions: Path,
                       name: str) -> None:
        """Write the step as .versions/<name>, then make it DEST's step with one atomic swap of .current."""
        tmp = versions / f".{name}.tmp"
        tmp.mkdir()
        checkpoint.write_dir(tensors, tmp, checkpoint.Layout(True, rec.weight_map, {"step": str(rec.step)}))
        partial = self.reader.want is not None  # then only the selected tensors, in their files of the layout
        infos = {k: rec.tensors[k] for k in tensors} if partial else rec.tensors
        (tmp / STATE_NAME).write_bytes(DestState(m.run, rec.step, self.url, infos, partial).to_bytes())
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = versions / name
        os.rename(tmp, final)
        fsync_dir(versions)
        self._link_visible(final)  # visible names: symlinks through .current (dangling until the swap)
        swap = self.dest / f".current.tmp-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join(".versions", name), swap)
        os.replace(swap, self.dest / ".current")  # the commit point
        fsync_dir(self.dest)
        self._drop_dangling()
        for v in versions.iterdir():
            if v.name != name:
                _remove_entry(v)

    # -- syncing ------------------------------------------------------------------------------
    def sync(self, timeout: float | None = None) -> int:
        """Bring `dest` to the head once and return the step held (raises SyncTimeout / SyncError).

        DEST is persisted first; then the module and on_update get the held step unless they already have
        it, so one that failed (HotLoadError, or on_update's own exception, raised here) is retried by the
        next sync even when the manifest has not changed.
        """
        if self._lock is None:
            raise SyncError(f"{self.dest}: this watcher is closed (it no longer holds {self.dest / LOCK_NAME})")
        m, tensors, rec = self.reader.reach(self.step, self.tensors, run=self.run_id, timeout=timeout)
        if tensors is not None:
            if rec is None:  # reach() returns the tensors with their record, or neither
                raise SyncError("internal: tensors without a record")
            if self.step is not None and (rec.step <= self.step or m.run != self.run_id):
                raise SyncError(f"{self.url}: refusing step {rec.step} of run {m.run}; {self.dest} holds step "
                                f"{self.step} of run {self.run_id} and never moves back or across runs")
            self._persist(m, rec, tensors)
            self.step, self.run_id, self.tensors = rec.step, m.run, tensors
            self._held_partial = self.reader.want is not None
            log.info("%s: now at step %d (%s)", self.dest, rec.step, self.url)
        self._deliver()
        if self.step is None:  # reach() returns nothing only when a step is held, and else the tensors we took
            raise SyncError("internal: no step held after a sync")
        return self.step

    def _deliver(self) -> None:
        """Hand the held step to the module and to on_update, each unless it already has it."""
        failure: BaseException | None = None
        if self.module is not None and self.step is not None and self.module_step != self.step:
            try:
                self._hot_load()
            except HotLoadError as exc:
                log.error("%s", exc)
                failure = exc
        # self.tensors is set with self.step; tested too so that on_update never gets None
        if (self.on_update is not None and self.step is not None and self.tensors is not None
                and self.delivered_step != self.step):
            try:
                self.on_update(self.step, self.tensors)
                self.delivered_step = self.step
            except Exception as exc:  # noqa: BLE001 - raised below, after the module's error if any
                log.error("%s: on_update(%d) failed, retried at the next sync: %s", self.dest, self.step, exc)
                failure = failure or exc
        if failure is not None:
            raise failure

    def _hot_load(self) -> None:
        """Copy the held step into the module, all or nothing.

        Every name, shape and dtype is checked first (exact: a broadcasting copy_ is refused), then the
        tensors are copied; if a copy fails anyway, those already copied are restored from the tensors the
        module held (when the watcher loaded them), so the module never mixes two steps.
        """
        if self.module is None or self.tensors is None:  # _deliver calls this with a module and a held step
            raise SyncError("internal: hot-load without a module or a held step")
        live = self.module.state_dict()
        new = self.tensors
        problems = [f"missing {sorted(set(live) - set(new))[:5]}"] if set(live) - set(new) else []
        problems += [f"not in the module {sorted(set(new) - set(live))[:5]}"] if set(new) - set(live) else []
        for k in sorted(set(live) & set(new)):
            if live[k].shape != new[k].shape or live[k].dtype != new[k].dtype:
                problems.append(f"{k}: module has shape {tuple(live[k].shape)} {live[k].dtype}, step has "
                                f"{tuple(new[k].shape)} {new[k].dtype}")
        where = f"{self.dest}: module not updated to step {self.step}, it stays at step {self.module_step}"
        if problems:
            raise HotLoadError(f"{where}: {'; '.join(problems[:5])}")
        done: list[str] = []
        try:
            with torch.no_grad():
                for k in live:
                    live[k].copy_(new[k])
                    done.append(k)
        except Exception as exc:
            previous = self._module_tensors
            if previous is None:
                raise HotLoadError(f"{self.dest}: module update to step {self.step} failed copying {k} ({exc}); "
                                   f"the module never took a step from this watcher, so the {len(done)} tensors "
                                   f"already copied cannot be restored") from exc
            with torch.no_grad():
                for d in done:
                    live[d].copy_(previous[d])
            raise HotLoadError(f"{where} (copying {k} failed: {exc}; {len(done)} copied tensors restored)") from exc
        self.module_step, self._module_tensors = self.step, new

    def run(self, sync_timeout: float | None = None) -> None:
        """Poll forever (until stop()): one conditional manifest read per interval, a sync when it changed.

        A failed sync is logged and retried at the next change or interval; with `sync_timeout`, a
        sync that cannot finish in time raises SyncTimeout instead.
        """
        etag = None
        while not self._stop.is_set():
            try:
                got = self.store.read_manifest(if_none_match=etag)
                if got is not NOT_MODIFIED and got is not None:
                    self.sync(timeout=sync_timeout)
                    etag = got.etag
            except SyncTimeout:
                if sync_timeout is not None:
                    raise
            except Exception as exc:  # noqa: BLE001 - a rollout host keeps serving its last good step
                log.error("%s: sync failed, keeping step %s: %s", self.dest, self.step, exc)
            self._stop.wait(self.poll_interval)

    def stop(self) -> None:
        self._stop.set()
