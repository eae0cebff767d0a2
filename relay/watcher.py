"""Rollout side: follow a run's head into a local directory that always holds one verified step.

Reader plans the cheapest way from what is held to the head (apply the chain, or start from a
snapshot), downloads it in parallel, applies it and checks every step against the trainer's
record. A chain is applied to the held tensors in place (codec.UndoLog takes it back exactly on
any failure: no copy of the model); a snapshot is spooled to disk, verified there, and read
straight into tensors. Watcher persists the result (docs/PROTOCOL.md §6.1): in "full" mode a new
version directory under DIR/.versions, then one atomic symlink swap of DIR/.current; in
"journal" mode the step's verified payloads and a new state file in the held version (the state
file's rename is the commit point), compacted into a new base in the background. A reader (or a
crash) sees the old step or the new one, never a mix.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Collection, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, overload

import torch

import codec
import xxhash

from relay import announce, checkpoint, fleet, shards
from relay import dest as dest_mod
from relay.dest import JOURNAL_DIR
from relay.engines import Engine, EngineError, Update, changed_names
from relay.manifest import (INDEX_NAME, MAX_RECORD_BYTES, PERSIST_MODES, DestState, JournalEntry, Manifest,
                            ManifestError, ObjRef,
                            Part, Record, Snapshot, Step, TensorInfo, mismatches, safe_shard_name,
                            strong_mismatches)
from relay.files import atomic_path, fsync_dir, temporary_sibling
from relay.progress import STEP_LOG
from relay.retry import Backoff
from relay.signing import TrustedKeys
from relay.store import NOT_MODIFIED, ManifestRead, ObjectMissing, Store, Unchanged, open_store

log = logging.getLogger(__name__)

STATE_NAME = "relay-state.json"
_TMP_PATTERNS = (".current.tmp-*", ".link.tmp-*")  # what a crash mid-swap leaves in DEST
_HASH_CHUNK = 8 << 20  # bytes per read when checking a downloaded file's tags
_VERSION_NAME = re.compile(r"[0-9]+-[0-9a-f]{8}")  # .versions/<step>-<nonce>, as _persist names them
LOCK_NAME = ".lock"  # flock'ed for a Watcher's lifetime: one watcher per DEST
# run(): first and longest wait (s) before a held step the module, engine or on_update refused is offered
# again with no new manifest (at least poll_interval each)
DELIVERY_RETRY = (1.0, 60.0)
NO_RUN_WARNING = 60.0  # seconds between repeats of the "no run / no bucket at URL" warning (the first: at once)


class SyncError(RuntimeError):
    """The watcher cannot reach the head (no verified path, another run, ...); DIR keeps its last good step."""


class SyncTimeout(SyncError, TimeoutError):
    """The head was not reached in the time allowed (objects still missing); DIR keeps its last good step."""


class DestLocked(SyncError):
    """Another watcher (process or object) holds DEST: two would delete each other's committed versions."""


class HotLoadError(SyncError):
    """The module could not take the held step; it stays entirely at its previous one, retried next sync."""


class _Abandoned(Exception):
    """A compaction stopped because the watcher is closing."""


_RANK_FILE = re.compile(r"rank-[0-9]{5}-of-[0-9]{5}-[0-9]{5}\.safetensors")  # a sharded trainer's (§5.4)


class _Reselect(Exception):
    """A partial replica holds other tensors than it selects at the head: it starts again from a snapshot."""


class _VerifyError(Exception):
    """Objects (by reference) whose bytes failed a check; the reader refetches them once, then backs off."""

    def __init__(self, refs: list[ObjRef], reason: str) -> None:
        super().__init__(reason)
        self.refs = refs


def older_head_step(value: object) -> int | None:
    """Check an `accept_older_head` value: the one older step a repair may go back to, or None. The boolean
    form (any older head, armed until a move back happened) is refused: left in a unit file after a repair it
    let a replayed manifest roll a host back later."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"accept_older_head={value!r}: name the step to go back to, e.g. accept_older_head=4 "
                         f"(`deltarelay watch --accept-older-head 4`); the boolean form is no longer accepted")
    return value


def _blame(snap: Snapshot, files: tuple[ObjRef, ...] | None) -> list[ObjRef]:
    """What a snapshot that fails a check is blamed for: its index and the files the plan fetched (`files`, a
    partial replica's; None: all). Never empty, and always objects the plan fetches: blaming only others
    would leave the same plan to be chosen again, and again."""
    return [snap.index, *(snap.files if files is None else files)]


@dataclass
class Plan:
    """Start from `snapshot` (or from the held step when None), then apply `steps` in order.

    A partial replica's plan (`want` set) downloads only the parts covering tensors it selects and,
    from the snapshot, only `files` (the ones its index says hold them)."""

    snapshot: Snapshot | None
    steps: list[Step]
    cost: int  # bytes to download
    price: int  # what the plan is chosen by: cost, with a snapshot counted at no less than what it decodes to
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


@dataclass
class Trail:
    """What a successful reach() used, for a caller that persists it as is (the watcher's journal mode):
    the snapshot it started from (with its record and its files, verified, in the spool) and every delta
    part it applied, in order, with the payload's bytes (checked against the manifest). `files` is empty
    when the snapshot's tensors were assembled (row slices, or a partial replica's selection): they are
    then not the record's layout and cannot become a version's files as they are."""

    snapshot: Snapshot | None = None
    snapshot_record: Record | None = None
    index: bytes | None = None
    files: list[Path] = field(default_factory=list)
    parts: list[tuple[Step, Part, bytes]] = field(default_factory=list)

    def reset(self) -> None:
        self.snapshot = self.snapshot_record = self.index = None
        self.files, self.parts = [], []


def plan_path(m: Manifest, held: int | None, excluded: Set[str] = frozenset(), *,
              want: shards.Selector | None = None,
              snapshot_files: Mapping[ObjRef, tuple[ObjRef, ...]] | None = None,
              snapshot_bytes: int = 0) -> Plan | None:
    """Cheapest path to the head in bytes: the chain from `held`, or any snapshot plus its chain.

    A snapshot is priced at no less than `snapshot_bytes`, the tensor bytes the head's record implies (what
    any snapshot decodes to, a second copy of the model beside what a holder has): its declared sizes are a
    bucket writer's to choose where the snapshot is a region's own (unsigned), and a compressed one costs
    its decoded size in memory and work whoever wrote it.

    Linear in the manifest's length (suffix sums over the steps), so a long or hostile manifest
    cannot stall the reader: trying m.chain() from every snapshot would be quadratic. Ties go to
    the held step, then to the oldest snapshot. A partial replica (`want`) counts only the parts
    covering tensors it selects and, per snapshot (by its index), the files `snapshot_files` gives (default all).
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
        files = None if snap is None or snapshot_files is None else snapshot_files.get(snap.index)
        refs = [] if snap is None else [snap.index, *(snap.files if files is None else files), steps[i].record]
        if i < n - 1:
            refs.append(head)
        if any(r.key in excluded for r in refs):
            return
        declared = sum(r.size for r in refs)
        cost = tail[i] + declared
        price = cost if snap is None else tail[i] + max(declared, snapshot_bytes)
        if best is None or price < best.price:
            best, best_i = Plan(snap, [], cost, price, files, want), i

    if held is not None and held in index:
        consider(None, index[held])
    for snap in m.snapshots:
        consider(snap, index[snap.step])
    if best is not None:
        best.steps = steps[best_i + 1:]
    return best


@dataclass
class _Failure:
    """A source that failed verification `count` times: not downloaded from again before `retry_at` (monotonic)."""

    count: int
    retry_at: float


def _source(ref: ObjRef) -> ObjRef | str:
    """What a failure of `ref` is remembered under: the reference itself where the (trusted) manifest chose it;
    for a region's own snapshot objects, their step's prefix (regional/snapshots/<step>/): the unsigned
    announcement chooses their references, so a forger rotating them must not buy a fresh download and decode
    each time, while the steps a reader plans from are the manifest's (so at most one try per listed step
    per backoff), and a forgery at one step leaves the region's other snapshots usable."""
    if not ref.key.startswith(announce.REGIONAL_PREFIX):
        return ref
    return announce.regional_prefix(int(ref.key[len(announce.REGIONAL_PREFIX):].split("/", 1)[0]))


def _file_matches(fd: int, ref: ObjRef) -> str | None:
    """None if the file open at `fd` holds exactly `ref`'s object (size, xxh3 and, when set, SHA-256), read back
    in chunks (memory stays small whatever the object's size); else what differs."""
    import hashlib

    import xxhash

    size = os.fstat(fd).st_size
    if size != ref.size:
        return f"{size} bytes, manifest says {ref.size}"
    tag = xxhash.xxh3_128()
    strong = hashlib.sha256() if ref.sha256 is not None else None
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    offset = 0
    while offset < size:
        got = os.preadv(fd, [view[:min(_HASH_CHUNK, size - offset)]], offset)
        if got <= 0:
            return f"ends at {offset} bytes, manifest says {ref.size}"
        tag.update(view[:got])
        if strong is not None:
            strong.update(view[:got])
        offset += got
    if tag.hexdigest() != ref.xxh3:
        return f"xxh3 {tag.hexdigest()}, manifest says {ref.xxh3}"
    if strong is not None and strong.hexdigest() != ref.sha256:
        return f"sha256 {strong.hexdigest()}, manifest says {ref.sha256}"
    return None


def _head_mismatches(tensors: dict[str, torch.Tensor], expected: dict[str, TensorInfo],
                     verified: dict[str, bytes]) -> list[str]:
    """Names whose dtype, shape or digest differ from `expected`, the head's record (or a partial replica's
    selection of it), plus missing and extra names.

    A tensor the chain's last apply_ verified against the payload's target digest (`verified`, from the
    UndoLog) is compared by that digest: hashing the whole model again would cost a full pass per step.
    The others are hashed."""
    if set(tensors) != set(expected):
        return sorted(set(tensors) ^ set(expected))
    bad = []
    rest = {}
    for name, info in expected.items():
        t = tensors[name]
        d = verified.get(name)
        if d is None or info.slices is not None:  # a sliced tensor's digest is made of its slices' (hashed)
            rest[name] = t
            continue
        dt = codec.tensors.BY_TORCH.get(t.dtype)
        if dt is None or dt.name != info.dtype or tuple(t.shape) != info.shape or d.hex() != info.digest:
            bad.append(name)
    if rest:
        bad += mismatches(rest, {k: expected[k] for k in rest}, strong=False)  # a chain: its deltas are the trainer's
    return bad


def _check_compressed_index(ref: ObjRef, path: Path, rec: Record) -> None:
    """A compressed snapshot file's own index (a few KiB at its end) against the step's record, before any
    tensor is decoded: every tensor it lists is one the record has, with the record's dtype and shape (rows
    of it, for a row slice) and, for a whole tensor, the record's digest (the same xxh3 of its elements).
    A file of anything else, a forger's few KB of zeros included, is refused without decoding; one that
    passes yields each tensor only once its digest (the record's) verifies, so a lie costs one tensor."""
    try:
        entries = codec.read_snapshot_index(path, where=ref.key)
    except codec.SnapshotError as exc:
        raise _VerifyError([ref], f"{ref.key}: not a snapshot file ({exc})") from None
    for e in entries:
        info = rec.tensors.get(e.name)
        if info is None or e.dtype != info.dtype or (
                e.shape != info.shape if info.slices is None else e.shape[1:] != info.shape[1:]) or (
                info.slices is None and e.digest.hex() != info.digest):
            raise _VerifyError([ref], f"{ref.key}: lists tensor {e.name[:200]!r} ({e.dtype} {list(e.shape)[:8]}), "
                                      f"which record {rec.step} does not have as such; not decoded")


class Reader:
    """Brings a state (or nothing) to a run's head, verified; waits out objects that are not there yet.

    A reference (key, size and tags) that fails verification twice is planned around, and not
    downloaded again, for failure_backoff_initial seconds, doubling at each further failure up to
    failure_backoff_max: a persistently bad object costs a bounded number of downloads, not two per
    poll. Failures are remembered per ObjRef, so a manifest naming other bytes is a fresh try; a region's
    own snapshot (chosen by an unsigned announcement) is backed off per step, at its first failure (_source).

    `tensors` (names, or a predicate on names) makes a partial replica: it downloads only the delta
    parts and snapshot files that hold those tensors and returns and verifies exactly them.

    In a region that announces its own snapshots (regional/snapshots.json, PROTOCOL §8.1) it plans from
    those, checked against the record (index, digests, BLAKE3 with trusted keys), and from the manifest's
    snapshots, whichever the region holds: a trainer's snapshot object missing there is planned around at
    once (the region may never get it), and waited for only when no other path reaches the head.
    """

    def __init__(self, store: Store, *, workers: int = 8, retry_initial: float = 0.2, retry_max: float = 5.0,
                 reroute_after: float | None = 300.0, trusted_keys: Any = None,
                 failure_backoff_initial: float = 30.0, failure_backoff_max: float = 3600.0,
                 tensors: Any = None, apply_workers: int = 2) -> None:
        self.store = store
        self.want = shards.selector(tensors)
        self._names = None if tensors is None or callable(tensors) else frozenset(tensors)
        self._indexes: dict[ObjRef, dict[str, set[str]]] = {}  # snapshot index -> its files' tensors (partial)
        self.apply_workers = apply_workers  # codec.apply_ threads (its kernels release the GIL)
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
        self.verify_failures = 0  # objects that failed a check (each refetch or backoff counts one)
        self.head_seen: int | None = None  # the head of the last manifest read (for lag: fleet, metrics)
        self.manifest_reads = 0  # manifests read, parsed and (with keys) verified
        self.heads_seen: dict[int, float] = {}  # head -> unix time first read (the newest 256)
        self._count_lock = threading.Lock()
        self._plan: tuple[int, int] | None = None  # while reaching: (bytes_downloaded at the plan's start, its cost)
        self._inflight: dict[int, int] = {}  # spool files being downloaded: fd -> size
        self._cache: dict[ObjRef, bytes] = {}  # by reference: bytes are reused only for what they were checked against
        self._spooled: dict[ObjRef, Path] = {}  # snapshot files verified on disk in this reach(), by reference
        self._refused: dict[ObjRef, _VerifyError] = {}  # the head's record, refused while pricing (_implied_bytes)
        self._failures: dict[ObjRef | str, _Failure] = {}  # by _source()
        self._warned_unchecked = False
        self._announced: tuple[str | None, announce.Announcement | None] = (None, None)  # (ETag, parsed)
        # the last refused manifest version: ETag, error, refusals of it in a row, monotonic time it may be read again
        self._refused_manifest: tuple[str, type[ManifestError], str, int, float] | None = None
        self._own_snapshots = False  # the last planning view holds a region's own snapshots
        # key -> monotonic time it was first found missing, across reach() calls: a host that syncs with
        # short timeouts (between rollouts) must still reroute once an object has been gone reroute_after
        self._missing_since: dict[str, float] = {}

    def missing_since(self) -> float | None:
        """The monotonic time the longest-missing object was first found missing, across reach() calls since
        the last one that reached the head; None if nothing is missing."""
        return min(self._missing_since.values(), default=None)

    def forget_missing(self) -> None:
        """Forget what was found missing (the caller got past it another way: a bootstrap from elsewhere)."""
        self._missing_since.clear()

    def progress(self) -> tuple[int, int] | None:
        """(bytes downloaded, bytes planned) of the reach in progress, None between reaches: for progress bars
        (relay.progress). Snapshot files count as they land (their allocated blocks), other objects when read."""
        plan = self._plan
        if plan is None:
            return None
        done = self.bytes_downloaded - plan[0]
        for fd, size in list(self._inflight.items()):
            try:
                done += min(os.fstat(fd).st_blocks * 512, size)
            except OSError:  # closed meanwhile: counted in bytes_downloaded
                pass
        return min(done, plan[1]), plan[1]

    @property
    def refused_etag(self) -> str | None:
        """The ETag of the manifest version last refused, while its backoff runs (None otherwise): pollers read
        conditionally on it, so a refused version is not downloaded again until it changes or the backoff ends."""
        refused = self._refused_manifest
        return None if refused is None or time.monotonic() >= refused[4] else refused[0]

    def read_manifest(self) -> Manifest | None:
        """The current manifest; with trusted keys, only one they signed (SignatureError otherwise). A version
        refused is refused again from memory (one conditional read) for `failure_backoff`, growing while the same
        version keeps failing; then it is read again, since bytes damaged in flight fail under the stored
        version's ETag too, and that version must not stay refused until the publisher's next commit."""
        etag = self.refused_etag
        got = self.store.read_manifest(if_none_match=etag)
        where = f"{self.store.url}/manifest.json"
        if got is NOT_MODIFIED:
            refused = self._refused_manifest
            assert refused is not None
            raise refused[1](f"{refused[2]} (this version, ETag {refused[0]}, was refused already)")
        if got is None:
            self._refused_manifest = None
            return None
        try:
            m = Manifest.parse(got.data, where)
            if self.trusted is not None:
                self.trusted.verify(m, where)
        except ManifestError as exc:  # SignatureError included
            prev = self._refused_manifest
            times = prev[3] + 1 if prev is not None and prev[0] == got.etag else 1
            self._refused_manifest = (got.etag, type(exc), str(exc), times,
                                      time.monotonic() + self.failure_backoff.delay(times))
            raise
        self._refused_manifest = None
        self.head_seen = m.head
        self.manifest_reads += 1
        if m.head not in self.heads_seen:
            self.heads_seen[m.head] = time.time()
            while len(self.heads_seen) > 256:
                del self.heads_seen[min(self.heads_seen)]
        if m.signatures and self.trusted is None and not self._warned_unchecked:
            self._warned_unchecked = True  # once per Reader: the operator probably forgot the key
            log.warning("%s: run is signed but this watcher trusts no key; signatures are not checked; "
                        "pass --trusted-key", self.store.url)
        return m

    def _planning_view(self, m: Manifest) -> Manifest:
        """The manifest as this store offers it (PROTOCOL §8.1): with the region's announced snapshots of steps
        the manifest lists, besides the trainer's (the announcement only adds candidates: no unsigned object
        takes a snapshot the region holds out of planning). Without an announcement of this run: `m`."""
        self._own_snapshots = False
        etag, ann = self._announced
        got = self.store.read_object(announce.ANNOUNCE_KEY, if_none_match=etag)
        if got is None:
            self._announced = (None, None)
            return m
        if got is not NOT_MODIFIED:
            try:
                ann = announce.Announcement.parse(got.data, f"{self.store.url}/{announce.ANNOUNCE_KEY}")
            except ManifestError as exc:
                log.error("%s: ignoring the regional snapshot announcement: %s", self.store.url, exc)
                ann = None
            self._announced = (got.etag, ann)
        if ann is None or ann.run != m.run:
            return m
        listed = {s.step for s in m.steps}
        own = [s for s in ann.snapshots if s.step in listed]
        self._own_snapshots = bool(own)
        snaps = own + list(m.snapshots)
        snaps.sort(key=lambda s: (s.step, not announce.is_regional(s)))  # a region's own first at equal cost
        return dataclasses.replace(m, snapshots=snaps)

    def _maybe_never(self, key: str) -> bool:
        """Whether a missing `key` may never arrive here: a trainer's snapshot object in a region that builds
        its own (one fed by CRR or a regional-snapshot relay is never sent them; a plain relay copies them)."""
        return self._own_snapshots and key.startswith("snapshots/")

    def _fetch_one(self, ref: ObjRef) -> bytes:
        if ref in self._cache:
            return self._cache[ref]
        refused = self._refused.pop(ref, None)  # refused while pricing: the plan meets that, not a second download
        if refused is not None:
            raise refused
        data = ref.read(self.store)
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

    def _spool_one(self, ref: ObjRef, spool: Path) -> Path:
        """Download `ref` into spool/<its file name> and check it (size, xxh3, SHA-256 when the manifest
        gives one) by reading it back in chunks, before any of its bytes is used. The file is removed if
        the check fails; a verified file is reused for the same reference within one reach()."""
        # one directory per reference: files of other snapshots (or a region's) share names, and one must not
        # overwrite another's verified bytes behind its entry in _spooled
        slot = spool / xxhash.xxh3_64_hexdigest(f"{ref.key}\0{ref.size}\0{ref.xxh3}\0{ref.sha256}".encode())
        slot.mkdir(exist_ok=True)
        path = slot / ref.key.rsplit("/", 1)[-1]
        if self._spooled.get(ref) == path and path.is_file() and not path.is_symlink():
            return path
        self._spooled.pop(ref, None)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            self._inflight[fd] = ref.size  # progress() reads how much of it has landed
            try:
                got = self.store.download(ref.key, fd, ref.size)
            except ValueError as exc:  # another size than the manifest's: nothing beyond it is trusted
                raise _VerifyError([ref], f"{ref.key}: {exc}") from None
            finally:
                self._inflight.pop(fd, None)
            with self._count_lock:
                self.bytes_downloaded += got
            problem = _file_matches(fd, ref)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        if problem:
            path.unlink(missing_ok=True)
            raise _VerifyError([ref], f"{ref.key}: {problem}")
        self._spooled[ref] = path
        return path

    def _stream_one(self, ref: ObjRef, max_bytes: int | None = None, bound: checkpoint.HeaderBound | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, bytes]]:
        """`ref`'s safetensors object read from the store straight into new tensors (no file, no copy of its
        bytes), with each tensor's digest (checkpoint.stream_into); its size, xxh3 and (when the manifest
        gives one) SHA-256 are checked over the same bytes before anything is returned. A header declaring
        more than `max_bytes` of tensors (what the step's record lists) is refused before they are allocated, one
        larger than `bound` (what the record's tensors imply) before it is read."""
        import hashlib

        import xxhash

        tag = xxhash.xxh3_128()
        strong = hashlib.sha256() if ref.sha256 is not None else None
        seen = 0

        def feed(view: memoryview) -> None:
            nonlocal seen
            seen += len(view)
            tag.update(view)
            if strong is not None:
                strong.update(view)

        chunks = iter(self.store.iter_chunks(ref.key))
        malformed = None
        try:
            part, meta, digests = checkpoint.stream_into(chunks, ref.size, ref.key, feed, max_bytes=max_bytes,
                                                           bound=bound)
        except checkpoint.SafetensorsError as exc:
            malformed = exc
            for chunk in chunks:  # the rest, to say whether the object is the manifest's at all
                if seen > ref.size:
                    break
                feed(memoryview(chunk).cast("B"))
        finally:
            with self._count_lock:
                self.bytes_downloaded += seen
        if seen != ref.size:
            raise _VerifyError([ref], f"{ref.key}: {seen}{'+' if seen > ref.size else ''} bytes, manifest says "
                                      f"{ref.size}")
        if tag.hexdigest() != ref.xxh3:
            raise _VerifyError([ref], f"{ref.key}: xxh3 {tag.hexdigest()}, manifest says {ref.xxh3}")
        if strong is not None and strong.hexdigest() != ref.sha256:
            raise _VerifyError([ref], f"{ref.key}: sha256 {strong.hexdigest()}, manifest says {ref.sha256}")
        if malformed is not None:
            raise _VerifyError([ref], f"{ref.key}: not a safetensors file ({malformed})")
        return part, meta, digests

    def _record(self, data: bytes, ref: ObjRef, run: str, step: int) -> Record:
        key = ref.key
        try:
            rec = Record.parse(data, key)
        except ManifestError as exc:
            raise _VerifyError([ref], str(exc)) from None
        if rec.run != run or rec.step != step:
            raise _VerifyError([ref], f"{key}: record of run {rec.run} step {rec.step}, expected {run} step {step}")
        return rec

    def _load_snapshot(self, m: Manifest, snap: Snapshot, spool: Path | None, trail: Trail,
                       files: tuple[ObjRef, ...] | None = None) -> tuple[dict[str, torch.Tensor], Record]:
        """The snapshot's tensors (a partial replica's selection), checked against its step's record. Its
        files (`files`: the ones a partial replica needs; default all) are downloaded into `spool` (verified
        from disk before use), then read straight into new tensors: one copy of the model in memory, never
        the files' bytes as well. Without a spool (nothing will keep the files: a publisher resuming) they
        are streamed from the store into the tensors, verified and digested on the way: one read of each
        file instead of a download, a read-back and a read. A sharded trainer's row slices are put together
        into whole tensors; only a full snapshot of whole tensors in the record's layout keeps its spooled
        files for the version (trail)."""
        rec_ref = m.step_of_snapshot(snap).record
        rec = self._record(self._fetch_one(rec_ref), rec_ref, m.run, snap.step)
        index = self._fetch_one(snap.index)  # part of the snapshot's cost and of what a reader checks
        if announce.is_regional(snap):
            self._check_regional(snap, rec, index)
        if spool is None and checkpoint.declares_compressed(index):
            # compressed files are decoded from a file (codec.decode_snapshot), not streamed into tensors:
            # spooled for this read only (an index that hides its format is refused by stream_into instead)
            with tempfile.TemporaryDirectory(prefix=".deltarelay-snapshot-") as tmp:
                return self._snapshot_tensors(snap, rec, Path(tmp), trail, files)
        return self._snapshot_tensors(snap, rec, spool, trail, files)

    def _snapshot_tensors(self, snap: Snapshot, rec: Record, spool: Path | None, trail: Trail,
                          files: tuple[ObjRef, ...] | None) -> tuple[dict[str, torch.Tensor], Record]:
        """_load_snapshot's files, once its record and index are read and checked."""
        layout = {f: {k for k, v in rec.weight_map.items() if v == f} for f in set(rec.weight_map.values())}
        names = [f.key.rsplit("/", 1)[-1] for f in snap.files]
        # A sharded trainer's snapshot (one set of files per rank: row slices, or whole tensors by owner) and a
        # partial replica's selection are assembled and written in the record's layout; any other snapshot's
        # files become the version's files as they are, so they must be exactly the record's layout.
        sharded = (any(info.slices is not None for info in rec.tensors.values())
                   or (bool(names) and all(_RANK_FILE.fullmatch(n) for n in names)))
        direct = not sharded and self.want is None and files is None
        # A region's own snapshot is vouched for by nobody: in a signed run its tensors are checked (BLAKE3),
        # but its files' headers (metadata, layout) are a bucket writer's bytes, so DEST gets files written
        # from the verified tensors instead
        direct = direct and not (self.trusted is not None and announce.is_regional(snap))
        if not sharded and sorted(names) != sorted(layout):
            raise _VerifyError(_blame(snap, files), f"snapshot {snap.step}: files {sorted(names)[:5]} are not the "
                                                    f"record's layout {sorted(layout)[:5]}")
        fetch = snap.files if files is None else files
        paths: list[Path] = []
        streamed: list[tuple[dict[str, torch.Tensor], dict[str, str], dict[str, bytes]]] = []
        budget = checkpoint.tensor_bytes(rec.tensors)  # what the files may decode to, all of them together
        bound = checkpoint.header_bound(rec.tensors)  # what each file's header may be (any subset of the tensors)
        # nor may they be much larger: the tensors and a header each (compressed ones are smaller). Checked
        # before any download, so an announced (unsigned) terabyte costs no egress and no disk
        declared = sum(f.size for f in fetch)
        if declared > budget + len(fetch) * checkpoint.MAX_HEADER_BYTES:
            raise _VerifyError(list(fetch), f"snapshot {snap.step}: its files declare {declared} bytes, for "
                                            f"{budget} bytes of tensors in its record")
        with ThreadPoolExecutor(max(1, min(self.workers, len(fetch)))) as pool:
            if spool is None:  # each file at most the whole budget (they arrive at once)
                streamed = list(pool.map(lambda f: self._stream_one(f, budget, bound), fetch))
            else:
                paths = list(pool.map(lambda f: self._spool_one(f, spool), fetch))
        # compressed snapshot files (codec's DRSN objects, detected by their magic) are decoded, never kept:
        # DEST holds safetensors, written from the tensors in the record's layout
        formats = [checkpoint.snapshot_file_format(p) for p in paths]
        direct = direct and all(f == "safetensors" for f in formats)
        for f, p, kind in zip(fetch, paths, formats):
            if kind == "compressed":
                _check_compressed_index(f, p, rec)
        tensors: dict[str, torch.Tensor] = {}
        digests: dict[str, bytes] = {}  # of the streamed tensors, made as they arrived
        read = []
        for i, f in enumerate(fetch):
            if spool is None:
                part, meta, made = streamed[i]
                streamed[i] = ({}, {}, {})  # held once, in `tensors` or `read`
            else:
                made = {}
                try:
                    part, meta = checkpoint.read_snapshot_file(paths[i], f.key, max_bytes=max(budget, 0),
                                                                bound=bound)
                except checkpoint.SafetensorsError as exc:
                    raise _VerifyError([f], f"{f.key}: not a snapshot file ({exc})") from None
            budget -= sum(t.nbytes for t in part.values())
            if direct:
                if set(part) != layout[f.key.rsplit("/", 1)[-1]]:
                    raise _VerifyError([f], f"{f.key}: holds other tensors than the record's layout places there")
                tensors.update(part)
                digests.update(made)
            else:
                try:
                    read.append((f, shards.metadata_rows(meta, f), part))
                except shards.ShardError as exc:
                    raise _VerifyError(exc.refs, str(exc)) from None
        if not direct:
            try:  # row slices of a sharded trainer's files put together; whole tensors as they are
                tensors = shards.assemble_read(read, rec.tensors, self.want)
            except shards.ShardError as exc:
                raise _VerifyError(exc.refs, str(exc)) from None
        # streamed whole tensors are checked by the digests made on the way; the others are hashed. Either
        # way BLAKE3 too, where the record has it (PROTOCOL §6): xxh3 is not collision resistant, and this
        # path also feeds a keyed rebase or resume, which would sign what it loads
        if digests:
            bad = _head_mismatches(tensors, self.expected(rec), digests)
            bad = bad or strong_mismatches(tensors, self.expected(rec))
        else:
            bad = mismatches(tensors, self.expected(rec))
        if bad:
            # Blame the snapshot alone: a bad record fails again on whichever path checks it next, but a
            # good one (typically the head's) must stay usable for the chain from another snapshot.
            raise _VerifyError(_blame(snap, files), f"snapshot {snap.step} does not match its record "
                                                    f"(tensors {bad[:5]})")
        trail.snapshot, trail.snapshot_record = snap, rec
        if direct and spool is not None:
            trail.files = paths
            trail.index = checkpoint.index_bytes_of(rec.tensors, rec.weight_map)  # from the record, not the store
        return tensors, rec

    def _check_regional(self, snap: Snapshot, rec: Record, index: bytes) -> None:
        """A region's own snapshot (PROTOCOL §8.1) is vouched for by nobody: its index must be exactly the one
        its step's record implies, and in a run read with trusted keys the record must carry BLAKE3 digests
        (its tensors are then checked against them; xxh3 alone is not collision resistant)."""
        if index != checkpoint.index_bytes_of(rec.tensors, rec.weight_map, step=snap.step):
            raise _VerifyError([snap.index], f"{snap.index.key}: not the index of the record of step {snap.step}")
        if self.trusted is not None and any(info.blake3 is None for info in self.expected(rec).values()):
            raise _VerifyError(_blame(snap, None), f"regional snapshot {snap.step}: record {rec.step} of this signed "
                                                 f"run carries no BLAKE3 digests, so a snapshot nobody signed "
                                                 f"cannot be checked; refused")

    def _apply_step(self, s: Step, parts: list[Part], tensors: dict[str, torch.Tensor], got: dict[str, bytes],
                    undo: codec.UndoLog) -> None:
        """Apply `parts` (those of step `s` this reader needs) to `tensors` in place (each verifies the tensors
        it covers and changes nothing if one fails; `undo` logs what they overwrote); the step's parts must
        cover every held tensor exactly once, whole or by row ranges that tile it (checked before any write).
        A part with rows is applied to views of the held tensors' rows; a partial replica applies only the
        records of the tensors it holds (`only`)."""
        try:
            shards.check_tiling(s.step, s.delta_parts, tensors)
        except shards.ShardError as exc:
            raise _VerifyError(exc.refs, str(exc)) from None
        covered: set[str] = set()
        for part in parts:
            target = shards.part_targets(part, tensors)  # row ranges: views into the held tensors
            if self.want is None and part.tensors is not None and len(target) != len(part.tensors):
                raise _VerifyError([part.ref], f"{part.ref.key}: names tensors that are not held")
            only = set(target) if self.want is not None else None
            try:
                codec.apply_(target, got[part.ref.key], workers=self.apply_workers, undo=undo, only=only)
            except codec.DeltaError as exc:
                raise _VerifyError([part.ref], f"{part.ref.key}: {exc}") from None
            covered.update(target)
        if covered != set(tensors):
            raise _VerifyError([p.ref for p in s.delta_parts],
                               f"step {s.step}: parts leave tensors unverified {sorted(set(tensors) - covered)[:5]}")

    def _execute(self, m: Manifest, plan: Plan, held: dict[str, torch.Tensor] | None, undo: codec.UndoLog,
                 spool: Path | None, trail: Trail) -> tuple[dict[str, torch.Tensor], Record]:
        """Run `plan`: from the snapshot (new tensors) or from `held` itself, applied in place. Whatever fails,
        `held` is back to its exact bits (from `undo`) before the exception leaves."""
        try:
            return self._execute_logged(m, plan, held, undo, spool, trail)
        except BaseException:
            undo.revert()  # a snapshot plan wrote only into its own tensors: then there is nothing logged for held
            raise

    def _execute_logged(self, m: Manifest, plan: Plan, held: dict[str, torch.Tensor] | None, undo: codec.UndoLog,
                        spool: Path | None, trail: Trail) -> tuple[dict[str, torch.Tensor], Record]:
        rec: Record | None = None
        trail.reset()  # what this attempt used, only
        self._fetch_one(m.steps[-1].record)  # every plan needs the head's record: a problem with it ends the plan here
        if plan.snapshot is not None:
            tensors, rec = self._load_snapshot(m, plan.snapshot, spool, trail, plan.files)
            chain_log = codec.UndoLog()  # the snapshot's tensors are new: a failure just drops them
        else:
            if held is None:
                raise SyncError("internal: chain plan without a held state")
            tensors, chain_log = held, undo
        refs = [p.ref for s in plan.steps for p in plan.parts(s)]
        if plan.steps:
            refs.append(plan.steps[-1].record)
        got = self._fetch(refs)
        for s in plan.steps:
            self._apply_step(s, plan.parts(s), tensors, got, chain_log)
            if chain_log is not undo:
                chain_log.accept()  # the snapshot's own tensors: nothing to take back, only the digests to keep
        if plan.steps:
            last = plan.steps[-1]
            rec = self._record(got[last.record.key], last.record, m.run, last.step)
            expected = self.expected(rec)
            if plan.snapshot is None and set(expected) != set(tensors):
                raise _Reselect(f"step {last.step}: this replica's selection is {len(expected)} tensors, it "
                                f"holds {len(tensors)}; starting from a snapshot")
            # a digest apply_ verified for a row range is the slice's, not the tensor's: those are hashed
            rowed = {n for p in plan.parts(last) for n in (p.rows or {})}
            verified = {k: d for k, d in chain_log.verified().items() if k not in rowed}
            bad = _head_mismatches(tensors, expected, verified)
            if bad:
                raise _VerifyError([p.ref for s in plan.steps for p in s.delta_parts] + [last.record],
                                   f"step {last.step} does not match its record (tensors {bad[:5]})")
        if rec is None:  # plan_path never plans nothing: held is below the head, so a chain plan has steps
            raise SyncError("internal: chain plan without steps")
        trail.parts = [(s, p, got[p.ref.key]) for s in plan.steps for p in plan.parts(s)]
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

    def _snapshot_files(self, m: Manifest, excluded: Set[str]) -> dict[ObjRef, tuple[ObjRef, ...]]:
        """Per snapshot (by its index: a region may list its own and the trainer's at one step), the files holding
        a tensor this partial replica selects, from the snapshot's index (fetched and checked once per index).
        A snapshot whose index cannot be read yet counts all files. An index that is `excluded` is not fetched;
        one over the parser's cap, or that fails its checks, is backed off like any failed object (an unsigned
        announcement may name one of any size: it must cost bounded egress, once per backoff)."""
        want = self.want
        out: dict[ObjRef, tuple[ObjRef, ...]] = {}
        if want is None:
            return out
        live = {snap.index for snap in m.snapshots}
        for ref in [r for r in self._indexes if r not in live]:
            del self._indexes[ref]
        for snap in m.snapshots:
            if snap.index not in self._indexes:
                if snap.index.key in excluded:
                    continue
                try:
                    if snap.index.size > MAX_RECORD_BYTES:
                        raise _VerifyError([snap.index], f"{snap.index.key}: {snap.index.size} bytes, over the "
                                                         f"{MAX_RECORD_BYTES} an index may have; not downloaded")
                    self._indexes[snap.index] = shards.index_files(self._fetch_one(snap.index), snap)
                except ObjectMissing as exc:
                    log.info("%s: cannot read yet (%s); counting every file of snapshot %d", snap.index.key, exc,
                             snap.step)
                    continue
                except (_VerifyError, ManifestError) as exc:
                    backoff = self._failed([snap.index], time.monotonic())
                    log.warning("%s: refused (%s); snapshot %d is not planned for %.0fs", snap.index.key, exc,
                                snap.step, backoff)
                    continue
            holds = self._indexes[snap.index]
            out[snap.index] = tuple(f for f in snap.files if any(want(n) for n in holds.get(f.key, ())))
        return out

    def _backed_off(self, m: Manifest, now: float) -> set[str]:
        """Keys of this manifest's references still inside their (or their source's) failure backoff; forgets
        stale failures."""
        refs = set(m.refs())
        live = {_source(r) for r in refs}
        for src in [k for k, f in self._failures.items() if k not in live and f.retry_at <= now]:
            del self._failures[src]  # bounded: only sources of the current manifest or still backing off
        out = set()
        for r in refs:
            f = self._failures.get(_source(r))
            if f is not None and now < f.retry_at:
                out.add(r.key)
        return out

    def _failed(self, refs: list[ObjRef], now: float) -> float:
        """Back off from the sources of `refs` (doubling per failure, once per source per call); returns the
        longest backoff now in force."""
        longest = 0.0
        for src in dict.fromkeys(_source(r) for r in refs):
            f = self._failures.get(src)
            count = 1 if f is None else f.count + 1
            backoff = self.failure_backoff.delay(count)
            self._failures[src] = _Failure(count, now + backoff)
            longest = max(longest, backoff)
        return longest

    def _implied_bytes(self, m: Manifest) -> int:
        """The tensor bytes the head's record implies (a partial replica's selection of them): what any snapshot
        plan decodes, whatever its files declare. 0 when the record cannot be read or checked yet: every plan
        reads it first (`_execute_logged`) and meets the same problem there, before any snapshot work."""
        head = m.steps[-1]
        try:
            return checkpoint.tensor_bytes(self.expected(self._record(self._fetch_one(head.record), head.record,
                                                                      m.run, head.step)))
        except _VerifyError as exc:
            self._refused[head.record] = exc
            return 0
        except (ObjectMissing, SyncError):
            return 0

    # With nothing held the head is always new: the tensors and their record come back.
    @overload
    def reach(self, held_step: None, held: None, *, run: str | None = None, timeout: float | None = None,
              undo: codec.UndoLog | None = None, spool: str | os.PathLike | None = None,
              trail: Trail | None = None, accept_older_head: int | None = None
              ) -> tuple[Manifest, dict[str, torch.Tensor], Record]: ...

    @overload
    def reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, *, run: str | None = None,
              timeout: float | None = None, undo: codec.UndoLog | None = None,
              spool: str | os.PathLike | None = None, trail: Trail | None = None,
              accept_older_head: int | None = None
              ) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]: ...

    def reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, *, run: str | None = None,
              timeout: float | None = None, undo: codec.UndoLog | None = None,
              spool: str | os.PathLike | None = None, trail: Trail | None = None,
              accept_older_head: int | None = None
              ) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]:
        """(manifest, tensors, record) at the head; tensors None if already there (or the head is older; an
        older head that is exactly step `accept_older_head`, an operator's repair, is reached as from nothing
        held, as long as it is the only head this Reader has read: a repair is of the head found at start).

        A chain is applied to `held` itself, in place (no copy of the model): the returned tensors are then
        `held`, at the head. If anything fails (a bad part, the head's record, an object missing mid-chain,
        MemoryError), `held` is back to its exact bits before the exception leaves. With `undo` (an empty
        codec.UndoLog), a successful in-place reach leaves there what it overwrote, so the caller can still
        take the step back (its persist failed, say). A snapshot plan returns new tensors, `held` untouched.
        Snapshot files are downloaded into `spool` (a directory the caller owns and cleans; the watcher
        passes its next version's) or, without one, streamed from the store straight into the tensors
        (verified on the way; no file is written: a publisher resuming keeps none).
        `trail`, if given, is filled with what the successful plan used (Trail).
        """
        if undo is None:
            undo = codec.UndoLog()
        elif len(undo):
            raise ValueError("reach() needs an empty UndoLog: it reverts everything logged there on failure")
        trail = Trail() if trail is None else trail
        older_head_step(accept_older_head)
        return self._reach(held_step, held, run, timeout, undo, None if spool is None else Path(spool), trail,
                           accept_older_head)

    def _reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, run: str | None,
               timeout: float | None, undo: codec.UndoLog, spool: Path | None, trail: Trail,
               accept_older_head: int | None = None
               ) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        waits = 0
        refetched: set[ObjRef] = set()
        failed_here: set[ObjRef] = set()  # failed twice in this call: out for the rest of it, whatever the backoff
        missing_since = self._missing_since
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
                    if (held_step is not None and held_step > m.head and m.head == accept_older_head
                            and self.heads_seen.keys() == {m.head}):  # the only head this reader has read
                        log.warning("%s: head %d is older than the held step %d; taking it (accept_older_head=%d)",
                                    self.store.url, m.head, held_step, m.head)
                        held_step, held = None, None  # from a snapshot, as a fresh host would
                    if held_step is not None and held_step >= m.head:
                        if held_step > m.head:
                            log.warning("%s: head %d is older than the held step %d; keeping %d", self.store.url,
                                        m.head, held_step, held_step)
                        missing_since.clear()
                        return m, None, None
                    as_read, m = m, self._planning_view(m)  # with a region's own snapshots (§8.1); as_read is returned
                    excluded = self._backed_off(m, time.monotonic()) | {r.key for r in m.refs() if r in failed_here}
                    kw: dict[str, Any] = {}
                    if self.want is not None:
                        kw.update(want=self.want, snapshot_files=self._snapshot_files(m, excluded))
                        excluded |= self._backed_off(m, time.monotonic())  # indexes refused just now
                    plan = (plan_path(m, held_step, excluded | rerouted, **kw)
                            or plan_path(m, held_step, excluded, **kw))
                    if plan is not None and plan.snapshot is not None:
                        # priced again at what a snapshot decodes to. The head's record is read only once a plan
                        # exists (every plan reads it; with every path backed off a poll downloads nothing), and a
                        # chain chosen at declared sizes stays chosen when snapshots cost more
                        kw["snapshot_bytes"] = self._implied_bytes(m)
                        plan = (plan_path(m, held_step, excluded | rerouted, **kw)
                                or plan_path(m, held_step, excluded, **kw))
                    if plan is None:
                        raise SyncError(f"{self.store.url}: no verified path to head {m.head} "
                                        f"(objects that failed verification, not fetched again until their backoff "
                                        f"ends: {sorted(excluded)[:5]})")
                    self._plan = (self.bytes_downloaded, plan.cost)
                    try:
                        tensors, rec = self._execute(m, plan, held, undo, spool, trail)
                    except _Reselect as exc:  # a partial replica whose held tensors are not its selection
                        log.warning("%s", exc)
                        held_step, held = None, None
                        continue
                    except ObjectMissing as exc:
                        waiting_for = str(exc)
                        if exc.key is not None and exc.key not in rerouted and self._maybe_never(exc.key):
                            rerouted.add(exc.key)
                            log.info("%s: not in this region (it holds snapshots of its own); planning from what "
                                     "it holds, waiting for it only if nothing else reaches the head", exc)
                            continue
                        if exc.key is not None and self.reroute_after is not None:
                            first = missing_since.setdefault(exc.key, time.monotonic())
                            if exc.key not in rerouted and time.monotonic() - first >= self.reroute_after:
                                rerouted.add(exc.key)
                                log.warning("%s missing for %.0fs; looking for another complete path (a newer "
                                            "snapshot), still waiting for it if there is none", exc,
                                            time.monotonic() - first)
                                continue
                    except _VerifyError as exc:
                        self.verify_failures += 1
                        for ref in exc.refs:
                            self._cache.pop(ref, None)
                            self._spooled.pop(ref, None)
                        # refetched once (a torn or flipped read), except what an unsigned announcement chose
                        if any(r not in refetched and _source(r) == r and r not in self._failures for r in exc.refs):
                            refetched.update(exc.refs)
                            log.warning("verification failed, discarding and refetching: %s", exc)
                        else:
                            if not set(exc.refs) & set(plan.keys(m)):  # excluding them leaves this same plan
                                raise SyncError(f"{self.store.url}: verification failed ({exc}), blaming objects "
                                                f"the path to head {m.head} does not fetch") from None
                            failed_here.update(exc.refs)
                            backoff = self._failed(exc.refs, time.monotonic())
                            log.warning("verification failed again, planning around %s for %.0fs (snapshot "
                                        "fallback): %s", [r.key for r in exc.refs], backoff, exc)
                        if deadline is not None and time.monotonic() > deadline:
                            raise SyncTimeout(f"gave up after {timeout:g}s: verification kept failing "
                                              f"({exc})") from None
                        continue
                    else:
                        for ref in plan.keys(m):
                            self._failures.pop(_source(ref), None)
                        missing_since.clear()  # at the head: what was missing is either here or not needed
                        return as_read, tensors, rec
                waits += 1
                delay = self.waiting.delay(waits)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise SyncTimeout(f"gave up after {timeout:g}s waiting for {waiting_for}")
                log.info("waiting %.2fs for %s", delay, waiting_for)
                time.sleep(delay)
        finally:
            self._plan = None
            self._cache.clear()
            self._spooled.clear()
            self._refused.clear()


def _failure_reason(exc: BaseException) -> str:
    """The `reason` a failed sync is counted under (metrics, the fleet ledger)."""
    if isinstance(exc, SyncTimeout):
        return "timeout"
    if isinstance(exc, HotLoadError):
        return "hotload"
    if isinstance(exc, SyncError):
        return "sync"
    if isinstance(exc, (OSError, ConnectionError)):
        return "store"
    return "other"


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
    relay-state.json), or nothing before the first sync. It never moves to an older step, except for an
    operator's repair: `accept_older_head=STEP` lets the first successful sync take the store's head if it is
    exactly STEP (same run) and no other head was read before, and is spent by that sync whether it moved back
    or not.
    on_update(step, tensors) runs after each persisted step with the live held tensors (updated in place
    by the next sync: valid until then); `module` is updated in place too. `persist` is "full" (every step a
    complete checkpoint under the visible names) or "journal" (a base plus the verified deltas since, only
    relay-state.json visible; read with relay.dest.open_head), compacted past compact_fraction of the
    model's bytes or compact_steps steps. `apply_workers` threads apply each delta (codec.apply_).
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
    Fleet (relay.fleet, PROTOCOL §9): the watcher reports its held step to the store it follows, as
    `fleet/hosts/<host>.json` (`host` defaults to <hostname>-<hash of DEST>), after every sync and every
    `report_interval` seconds while run() runs (None: no reports); advisory, a failed write never stops a
    sync. `metrics_port` (0: any free port, `metrics_port` attribute once bound) serves Prometheus metrics
    on `metrics_addr`; `metrics_registry` registers them there instead (relay.metrics).
    """

    def __init__(self, url: str, dest: str | os.PathLike, *, poll_interval: float = 1.0,
                 storage_options: dict | None = None, on_update: Callable[[int, dict], Any] | None = None,
                 module: torch.nn.Module | None = None, workers: int = 8, retry_initial: float = 0.2,
                 retry_max: float = 5.0, reroute_after: float | None = 300.0, trusted_keys: Any = None,
                 failure_backoff_initial: float = 30.0, failure_backoff_max: float = 3600.0,
                 tensors: Any = None, persist: str = "full", compact_fraction: float = 0.5,
                 compact_steps: int = 64, apply_workers: int = 2, host: str | None = None,
                 region: str | None = None, report_interval: float | None = fleet.DEFAULT_INTERVAL,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 metrics_registry: Any = None, engine: Engine | None = None,
                 accept_older_head: int | None = None) -> None:
        if persist not in PERSIST_MODES:
            raise ValueError(f"persist must be one of {PERSIST_MODES}, got {persist!r}")
        if compact_fraction <= 0 or compact_steps < 1:
            raise ValueError("need compact_fraction > 0 and compact_steps >= 1")
        if persist == "journal" and tensors is not None:
            # a journal replays whole payloads over its base (relay.dest); a partial DEST holds only some of
            # their tensors, which dest's replay and compaction do not select yet
            raise ValueError("a partial replica (tensors=..., --tensors) needs persist=\"full\" (--persist full)")
        if engine is not None and (persist != "full" or tensors is not None):
            raise ValueError("an engine loads complete steps from DEST: it needs persist=\"full\" and no tensors=")
        self.url = url
        self.dest = Path(dest)
        self.persist = persist
        # One-shot operator repair, named by its step: the first successful sync may take the store's head
        # (same run) if it is exactly that step, older than DEST's; then (moved or not) the permission is
        # gone. A watcher otherwise never moves back (a replayed or lagging manifest must not roll it back),
        # so one that a forged manifest moved past the trainer (an unsigned run, a watcher without keys)
        # would refuse every real head forever. Spent at once: a flag left in a unit file never arms a
        # watcher against a manifest replayed later.
        self.accept_older_head = older_head_step(accept_older_head)
        # (step, run) DEST held before a start that could not build on it (another tensor selection): the first
        # sync must still not move back from it or across runs
        self._floor: tuple[int, str] | None = None
        self.compact_fraction = compact_fraction  # journal bytes over this fraction of the model: compact
        self.compact_steps = compact_steps  # or more journaled steps than this
        self.apply_workers = apply_workers
        self.poll_interval = poll_interval
        self.on_update = on_update
        self.module = module
        self.engine = engine
        self.store = open_store(url, storage_options)
        self.reader = Reader(self.store, workers=workers, retry_initial=retry_initial, retry_max=retry_max,
                             reroute_after=reroute_after, trusted_keys=trusted_keys,
                             failure_backoff_initial=failure_backoff_initial, failure_backoff_max=failure_backoff_max,
                             tensors=tensors, apply_workers=apply_workers)
        self._stop = threading.Event()
        self.step: int | None = None
        self.run_id: str | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.module_step: int | None = None  # the step `module` holds (set by a successful hot-load)
        self.delivered_step: int | None = None  # the last step on_update accepted
        self.engine_step: int | None = None  # the step `engine` serves (set by a successful commit)
        self._engine_losses = 0  # times in a row the engine was found no longer serving the step it took
        self._engine_lost_next = 0.0  # run() looks for a lost engine again from this monotonic time
        self._engine_tensors: dict[str, TensorInfo] | None = None  # that step's record entries (what changed)
        self._engine_version: Path | None = None  # that step's version directory, kept for the engine's rollback
        self._module_tensors: dict[str, torch.Tensor] | None = None  # the dict the module took its step from
        # ... and the undo logs of the in-place syncs that have moved that dict on since (restore = revert them)
        # the in-place syncs since the module's step, to rebuild it on a failed hot-load; None once they would
        # outgrow a copy of the model (the next hot-load then keeps a copy of what it replaces instead)
        self._module_logs: list[codec.UndoLog] | None = []
        self._held_partial = False  # the loaded version's relay-state.json says "partial"
        self._state: DestState | None = None  # the held version's state file, and the version itself
        self._version: Path | None = None
        self._dest_lock = threading.Lock()  # the sync thread and a compaction never write DEST at once
        self._compactor: threading.Thread | None = None
        self._compacting: str | None = None  # the compaction's temporary version name (cleanup spares it)
        self.compactions = 0
        self.last_compaction_error: BaseException | None = None
        # the held journal version proved damaged on disk (a compaction's read of it failed its checks): the
        # next step is persisted as a new version from the verified tensors in memory, not appended to it
        self._version_damaged: Path | None = None
        self.failures: Counter[str] = Counter()  # failed syncs by reason (failure_counts() adds the reader's)
        self.last_error: str | None = None
        self._last_failure: BaseException | None = None
        self.listeners: list[Callable[[Watcher], Any]] = []  # called after every sync attempt (fleet, metrics)
        self.fleet = None if report_interval is None else fleet.FleetReporter(self, host=host, region=region,
                                                                              interval=report_interval)
        self.metrics: Any = None
        self.metrics_port: int | None = None
        self.dest.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        try:
            self._recover()
            if metrics_port is not None or metrics_registry is not None:
                from relay import metrics  # prometheus_client only for a watcher that exports metrics

                self.metrics = metrics.WatcherMetrics(self, registry=metrics_registry)
                if metrics_port is not None:
                    self.metrics_port = self.metrics.serve(metrics_port, metrics_addr)
        except BaseException:
            self.close()
            raise
        # once DEST is ours and its step loaded: a fresh host compiles the decoder while its first snapshot
        # downloads (a refused or failed start compiles nothing); then the compressed snapshot decoder, for a
        # run that publishes compressed snapshots (~0.4 s from a warm kernel cache, as long as apply_'s from a
        # cold one; the same background thread, after apply_)
        codec.warm_up(("apply_", "snapshot_decode"))

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
        """Stop run() and any compaction, and release DEST's lock; the Watcher cannot sync afterwards. Idempotent."""
        self._stop.set()
        compactor = getattr(self, "_compactor", None)
        if compactor is not None:
            compactor.join()  # it gives up at its next batch once _stop is set
        reporter, metrics = getattr(self, "fleet", None), getattr(self, "metrics", None)
        if reporter is not None:
            reporter.stop()
        if metrics is not None:
            metrics.close()
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

    def failure_counts(self) -> dict[str, int]:
        """Failures by reason: failed syncs (timeout, sync, hotload, store, ...) and objects that failed a check."""
        return {**self.failures, "verify": self.reader.verify_failures}

    def _engine_state(self) -> dict | None:
        """The engine adapter's state() (kind, step, weight_version, status, last_pause_s) for the fleet ledger
        and the metrics; None without an engine."""
        engine = getattr(self, "engine", None)
        return None if engine is None else engine.state()

    def _notify(self) -> None:
        for listener in list(self.listeners):
            try:
                listener(self)
            except Exception as exc:  # noqa: BLE001 - observers never break the sync
                log.warning("%s: a sync listener failed: %s", self.dest, exc)
        if self.fleet is not None:
            self.fleet.poke()

    # -- local directory ----------------------------------------------------------------------
    def _recover(self) -> None:
        """Load the held step (verified against its state file) and tidy what a crash left behind.

        Links are never followed while cleaning up: a symlinked .versions, a symlinked entry in it, or a
        .current naming anything but .versions/<version> is unlinked as a link (with a warning), so a
        planted link cannot make start-up delete or load a directory outside DEST. In journal mode the
        journal files the state file does not name (a torn tail) are removed before the base and the
        journal are loaded and verified. Only a proven-bad version (dest.BadVersion) is removed; any other
        failure to load it (MemoryError, an I/O error) is raised and nothing is deleted.
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
                self._tidy_journal(versions / name)
                state, self.tensors = dest_mod.load_version(versions / name, workers=self.apply_workers)
                self.step, self.run_id = state.step, state.run
                self._state, self._version = state, versions / name
                keep = name
                self._held_partial = state.partial
                log.info("%s: holding step %d (persist %s)", self.dest, self.step, state.persist)
                if not self._holds_selection(self.tensors):  # shown until the first sync replaces it, not built on
                    log.warning("%s: step %d holds %s than this watcher selects; starting from a snapshot", self.dest,
                                self.step, "other tensors" if self.reader.want else "only some tensors")
                    self._floor = (state.step, state.run)  # not built on, but still never moved back from
                    self.step = self.run_id = self.tensors = None
            except dest_mod.BadVersion as exc:
                log.warning("%s: held step unusable (%s); removing it and starting fresh", self.dest, exc)
                self._floor = self._damaged_floor(versions / name)
        self.module_step = self.delivered_step = self.step  # a held step counts as delivered (as before)
        if versions.is_dir():  # a real directory: the link case is gone above
            for v in versions.iterdir():
                if v.name != keep:
                    _remove_entry(v)
        for pattern in _TMP_PATTERNS:
            for p in self.dest.glob(pattern):
                _remove_entry(p)
        if keep is not None:  # a state file's temporary (a crash inside _commit_state, before its rename)
            for p in (versions / keep).glob(f".{STATE_NAME}.*.tmp"):
                _remove_entry(p)
        shown = None
        if keep is not None and self._state is not None:
            journal = self._state.persist == "journal"
            self._link_visible(versions / keep, strict=False, journal=journal)
            shown = self._visible_names(versions / keep, journal)
        self._drop_dangling(shown)

    def _damaged_floor(self, version: Path) -> tuple[int, str] | None:
        """(step, run) a damaged version held, when its state file still proves it (its check and its version's
        name agree): the floor a fresh start keeps, so a replayed older manifest cannot roll DEST back."""
        try:
            state = dest_mod.read_state(version)
        except (dest_mod.BadVersion, OSError):
            return None
        if not dest_mod.name_agrees(version, state):
            return None
        log.info("%s: never moving below step %d of run %s, which the damaged version held", self.dest, state.step,
                 state.run)
        return state.step, state.run

    def _tidy_journal(self, version: Path) -> None:
        """Remove the journal files of a journal-mode version that its state file does not name: a step
        written but not committed (a crash, a failed persist). Never follows a link."""
        state = dest_mod.read_state(version)
        journal = version / JOURNAL_DIR
        if state.persist != "journal":
            return
        if os.path.lexists(journal) and (journal.is_symlink() or not journal.is_dir()):
            _remove_entry(journal)
            if state.journal:
                raise dest_mod.BadVersion(f"{JOURNAL_DIR} is not a directory")
        if not os.path.lexists(journal):
            if state.journal:
                return  # its entries are missing: loading the version proves it bad
            # empty, and gone (a copy of DEST that skips empty directories): made again, or no step could append
            journal.mkdir()
            fsync_dir(version)
            return
        named = {e.file for e in state.journal}
        for f in journal.iterdir():
            if f"{JOURNAL_DIR}/{f.name}" not in named:
                log.info("%s: removing %s, a journal file the committed state does not name", self.dest, f.name)
                _remove_entry(f)

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

    def _drop_dangling(self, visible: Collection[str] | None = None, dangling: bool = True) -> None:
        """Remove visible links that dangle (unless not `dangling`: before a swap the new ones do), and, given
        the held version's `visible` names, the watcher's own links (.current/<name>) to anything else: a
        journal version holds its base's safetensors, and a link left from a full-mode version would show
        that older step under the visible names."""
        for p in self.dest.iterdir():
            if not p.is_symlink() or p.name.startswith("."):
                continue
            if (dangling and not p.exists()) or (visible is not None and p.name not in visible
                                                 and os.readlink(p) == os.path.join(".current", p.name)):
                p.unlink()

    def _visible_names(self, version: Path, journal: bool) -> list[str]:
        """The names DEST shows for a version: its files (full mode), or the state file alone (journal)."""
        return [STATE_NAME] if journal else sorted(f.name for f in version.iterdir() if not f.is_dir())

    def _link_visible(self, version: Path, strict: bool = True, journal: bool = False, create: bool = True) -> None:
        """Make each visible name of `version` exactly the link the watcher creates: .current/<name>.

        Visible are the version's files (full mode) or relay-state.json alone (journal mode: the base's
        safetensors hold an older step, and a loader reading them through visible names would silently get
        it). A missing name is created; a symlink pointing anywhere else (a Hugging Face hub download links
        into its blob cache) is replaced atomically (temporary link + rename), its target never touched; a
        name that is not a symlink stops the update (SyncError) when `strict`, else it is only logged.
        Without `create`, only that check is made.
        """
        names = self._visible_names(version, journal)
        for name in names:
            link = self.dest / name
            if os.path.lexists(link) and not link.is_symlink():
                message = f"{link}: a regular file in the watcher's directory; the watcher owns {self.dest}"
                if strict:
                    raise SyncError(message)
                log.warning("%s; readers of this name do not see the held step", message)
        if not create:
            return
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

    def _persist(self, rec: Record, tensors: dict[str, torch.Tensor], trail: Trail, in_place: bool) -> None:
        """Make the reached step DEST's: in journal mode, on the held journal version, the step's payloads and a
        new state file (`_append_journal`); otherwise a new version directory and the .current swap."""
        bad = sorted({v for v in rec.weight_map.values() if not safe_shard_name(v)})
        covers = set(rec.weight_map) >= set(tensors) if self.reader.want else set(rec.weight_map) == set(tensors)
        if bad or not covers:  # Record.parse refuses these; never write outside DEST
            raise SyncError(f"step {rec.step}: refusing to write shard names {[b[:100] for b in bad[:3]]} "
                            f"in {self.dest}")
        with self._dest_lock:
            if (self.persist == "journal" and in_place and trail.parts and self._version is not None
                    and self._state is not None and self._state.persist == "journal"
                    and self._version.is_dir() and not any(p.rows for _, p, _ in trail.parts)
                    and self._version_damaged != self._version
                    and self._journal_takes_appends(self._version, self._state)):
                self._append_journal(rec, trail)
                return
            versions = self._versions_dir()
            name = f"{rec.step}-{uuid.uuid4().hex[:8]}"
            try:
                self._write_version(rec, tensors, versions, name, trail)
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

    def _hold_in_mode(self) -> None:
        """Make the held version this watcher's persist mode before anything is delivered from it. A full-mode
        watcher that starts on a journal version (DEST ran with persist="journal" before) rewrites the held step,
        from the verified tensors loaded at start, as a full version with the .current swap: the journal
        version's safetensors are its base, an older step, and an engine staging from that directory (or a
        reader of the visible names) would get that step under the held step's label. A journal-mode watcher
        keeps a held full version as it is: its files are the step, and its next step starts a journal."""
        state, version = self._state, self._version
        if (self.persist != "full" or state is None or state.persist == "full" or version is None
                or self.tensors is None or self.step != state.step):
            return
        rec = Record(state.run, state.step, state.tensors,
                     dest_mod.weight_map(version, set(state.base_tensors or state.tensors)))
        self._persist(rec, self.tensors, Trail(), in_place=True)
        log.info("%s: step %d rewritten from its verified tensors as a full version (it was held as a journal "
                 "version, base step %s)", self.dest, state.step, state.base)

    def _write_version(self, rec: Record, tensors: dict[str, torch.Tensor], versions: Path, name: str,
                       trail: Trail) -> None:
        """Write the step as .versions/<name>, then make it DEST's step with one atomic swap of .current.

        Full mode: the step's safetensors, written from memory, or the snapshot's files as downloaded when the
        step is a snapshot (verified: they are the step, in the record's layout). Journal mode: the snapshot's
        files as the base plus the chain's payloads as the journal; or, with no snapshot in the plan (a DEST
        switching modes), the held state written from memory as the base with an empty journal."""
        tmp = versions / f".{name}.tmp"
        tmp.mkdir()
        journal = self.persist == "journal"
        # a journal replays whole payloads (relay.dest): a chain with row-range parts is persisted as a new base
        rowless = not any(p.rows for _, p, _ in trail.parts)
        from_snapshot = (trail.snapshot is not None and trail.snapshot_record is not None and bool(trail.files)
                         and rowless)
        if from_snapshot and (journal or not trail.parts):
            for f in trail.files:  # verified in the spool (same filesystem): moved, not rewritten
                os.rename(f, tmp / f.name)
            (tmp / INDEX_NAME).write_bytes(trail.index or b"")
        else:
            checkpoint.write_dir(tensors, tmp, checkpoint.Layout(True, rec.weight_map, {"step": str(rec.step)}))
        partial = self.reader.want is not None  # then only the selected tensors, in their files of the layout
        infos = {k: rec.tensors[k] for k in tensors} if partial else rec.tensors
        if not journal:
            state = DestState(rec.run, rec.step, self.url, infos, partial=partial)
        elif from_snapshot and trail.snapshot_record is not None:
            (tmp / JOURNAL_DIR).mkdir()
            entries = [self._write_journal_file(tmp, s, p, data) for s, p, data in trail.parts]
            state = DestState(rec.run, rec.step, self.url, rec.tensors, "journal", trail.snapshot_record.step,
                              trail.snapshot_record.tensors, tuple(entries))
        else:
            (tmp / JOURNAL_DIR).mkdir()
            state = DestState(rec.run, rec.step, self.url, rec.tensors, "journal", rec.step, rec.tensors, ())
        (tmp / STATE_NAME).write_bytes(state.to_bytes())
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if journal:
            fsync_dir(tmp / JOURNAL_DIR)
        fsync_dir(tmp)
        final = versions / name
        os.rename(tmp, final)
        fsync_dir(versions)
        # Visible names are symlinks through .current, dangling until the swap. Except when the held version
        # is a journal one: .current then leads into its base, an older step's safetensors under the very
        # names a full version shows, so a full version's links would show that step at once (and keep
        # showing it if the swap failed). Those are made after the swap; before it, only checked.
        after = not journal and self._state is not None and self._state.persist == "journal"
        self._link_visible(final, journal=journal, create=not after)
        if journal:  # links to a full version's shards must be gone before .current can lead into a base
            self._drop_dangling([STATE_NAME], dangling=False)
        swap = self.dest / f".current.tmp-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join(".versions", name), swap)
        os.replace(swap, self.dest / ".current")  # the commit point
        self._state, self._version = state, final
        engine_version = None if self._engine_version is None else self._engine_version.name
        self._after_swap(final, journal, lambda: [v for v in versions.iterdir()
                                                  if v.name not in (name, self._compacting, engine_version)],
                         link=after)

    def _after_swap(self, version: Path, journal: bool, old: Callable[[], list[Path]], link: bool = False) -> None:
        """After a .current swap, the commit point: fsync DEST, make the visible names `version`'s (`link`: create
        them now), drop the others, remove the `old` versions. The step is DEST's already, so a failure here
        is logged, never raised: raising would make the caller undo a step DEST shows (or keep appending to
        a version .current no longer names). What it leaves, the next swap or a restart tidies."""
        try:
            fsync_dir(self.dest)
            if link:
                self._link_visible(version, strict=False, journal=journal)
            self._drop_dangling(self._visible_names(version, journal))
            for v in old():
                _remove_entry(v)
        except OSError as exc:
            log.warning("%s: step %s committed, but tidying after the swap failed (%s); the next swap or a restart "
                        "finishes it", self.dest, None if self._state is None else self._state.step, exc)

    def _write_journal_file(self, version: Path, s: Step, part: Part, data: bytes) -> JournalEntry:
        """Write one verified payload as version/journal/<step>-<part>.drd (temporary, fsync, rename)."""
        key_name = part.ref.key.rsplit("/", 1)[-1]  # deltas/<step>-<part>.drd: the manifest's own name
        file = f"{JOURNAL_DIR}/{key_name}"
        with atomic_path(version / file, durable=False) as tmp:  # the directory is fsynced with the state file
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return JournalEntry(s.step, file, len(data), xxhash.xxh3_128_hexdigest(data), part.tensors)

    def _journal_takes_appends(self, version: Path, state: DestState) -> bool:
        """Whether the held journal version's journal/ is the watcher's directory. An empty one that went
        missing is made again; a link, a non-directory, or a directory gone with the entries it held is not
        appended to: the step is persisted as a new version (a base written from memory) instead."""
        journal = version / JOURNAL_DIR
        if not os.path.lexists(journal) and not state.journal:
            journal.mkdir()
            fsync_dir(version)
        if journal.is_symlink() or not journal.is_dir():
            log.warning("%s: %s is not the watcher's journal directory; writing step as a new version", self.dest,
                        journal)
            return False
        return True

    def _append_journal(self, rec: Record, trail: Trail) -> None:
        """Journal mode, a chain applied to the held state: write the steps' payloads into the held version's
        journal, then a new state file naming them (temporary, fsync, rename: the commit point). Nothing else
        is written: disk writes are the delta and the state file. A failure before the rename removes the
        payloads written (the old state does not name them; a crash leaves them for start-up to remove)."""
        version, state = self._version, self._state
        if version is None or state is None or state.base is None:
            raise SyncError("internal: journal append without a held journal version")
        journal = version / JOURNAL_DIR
        if journal.is_symlink() or not journal.is_dir():
            raise SyncError(f"{journal}: not the watcher's journal directory")
        written: list[Path] = []
        try:
            entries = []
            for s, p, data in trail.parts:
                entries.append(self._write_journal_file(version, s, p, data))
                written.append(version / entries[-1].file)
            fsync_dir(journal)
            new = DestState(rec.run, rec.step, self.url, rec.tensors, "journal", state.base, state.base_tensors,
                            state.journal + tuple(entries))
            self._commit_state(version, new)
        except BaseException:
            if self._state is state:  # not committed: what it wrote is a torn tail, removed now
                for f in written:
                    f.unlink(missing_ok=True)
            raise

    def _commit_state(self, version: Path, state: DestState) -> None:
        """Replace the version's state file (temporary sibling, fsync, rename): a journal step's commit point."""
        with temporary_sibling(version / STATE_NAME, 0o644) as tmp:
            with open(tmp, "wb") as f:
                f.write(state.to_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, version / STATE_NAME)  # the commit point
            self._state = state
        try:
            fsync_dir(version)
        except OSError as exc:  # committed already: the rename is visible; the next commit fsyncs again
            log.warning("%s: fsync after committing step %d failed: %s", version, state.step, exc)

    # -- compaction (journal mode) ------------------------------------------------------------------
    def _journal_bytes(self) -> int:
        return sum(e.size for e in self._state.journal) if self._state is not None else 0

    def _model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensors or {}).values())

    def _maybe_compact(self) -> None:
        """Start a background compaction when the journal has grown past compact_fraction of the model or
        past compact_steps steps (and none is running)."""
        state = self._state
        if self.persist != "journal" or state is None or state.persist != "journal" or not state.journal:
            return
        if self._compactor is not None and self._compactor.is_alive():
            return
        steps = len({e.step for e in state.journal})
        if self._journal_bytes() <= self.compact_fraction * self._model_bytes() and steps <= self.compact_steps:
            return
        version = self._version
        if version is None:
            return
        self._compactor = threading.Thread(target=self._compact_logged, args=(version, state),
                                           name=f"deltarelay-compact-{self.dest.name}", daemon=True)
        self._compactor.start()

    def _compact_logged(self, version: Path, state: DestState) -> None:
        try:
            if self._compact(version, state):
                self.compactions += 1
        except BaseException as exc:  # noqa: BLE001 - a background thread: logged, counted, retried later
            self.last_compaction_error = exc
            log.error("%s: compaction of step %d failed (the journal version stays DEST's): %s", self.dest,
                      state.step, exc)

    def compact(self) -> bool:
        """Compact now, in the calling thread (tools, tests): True if a new base was swapped in."""
        if self._compactor is not None:
            self._compactor.join()
        if self._state is None or self._version is None or self._state.persist != "journal":
            return False
        return self._compact(self._version, self._state)

    def _compact(self, version: Path, state: DestState) -> bool:
        """Materialise the journal version's head as a new base (streamed from its files, verified against
        the state's digests: never from the live state, which syncs mutate in place), then, under the DEST
        lock, carry over the journal entries committed meanwhile and swap it in with the atomic .current
        swap. Returns False if DEST moved to another version meanwhile (nothing is swapped)."""
        versions = version.parent
        name = f"{state.step}-{uuid.uuid4().hex[:8]}"
        tmp = versions / f".{name}.tmp"
        with self._dest_lock:
            if self._version != version:
                return False
            self._compacting = tmp.name
            tmp.mkdir()
        try:
            def progress() -> None:
                if self._stop.is_set():
                    raise _Abandoned()

            try:
                dest_mod.materialize_into(version, state, tmp, progress=progress)
            except _Abandoned:
                return False
            except dest_mod.BadVersion as exc:
                # its files no longer hold what its state file says: appending to it again would only grow a
                # journal no compaction can fold (nor a restart load); the next step replaces it from memory
                self._version_damaged = version
                log.error("%s: the held version is damaged on disk (%s); the next step is written as a new "
                          "version from the verified state in memory", self.dest, exc)
                raise
            with self._dest_lock:
                current = self._state
                if self._version != version or current is None or current.journal[:len(state.journal)] != \
                        state.journal:
                    return False
                return self._swap_compacted(version, tmp, name, state, current)
        finally:
            with self._dest_lock:
                self._compacting = None
            shutil.rmtree(tmp, ignore_errors=True)

    def _swap_compacted(self, version: Path, tmp: Path, name: str, base: DestState, current: DestState) -> bool:
        """(Under the DEST lock) finish the compacted version: the entries journaled after `base` (linked, the
        files are immutable), the state file, fsync, rename, swap .current, remove the old version."""
        (tmp / JOURNAL_DIR).mkdir()
        extra = current.journal[len(base.journal):]
        for e in extra:
            try:
                os.link(version / e.file, tmp / e.file)
            except OSError:  # a filesystem without hard links: a copy
                shutil.copyfile(version / e.file, tmp / e.file)
        state = DestState(current.run, current.step, current.url, current.tensors, "journal", base.step,
                          base.tensors, extra)
        (tmp / STATE_NAME).write_bytes(state.to_bytes())
        for f in [*tmp.iterdir(), *(tmp / JOURNAL_DIR).iterdir()]:
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp / JOURNAL_DIR)
        fsync_dir(tmp)
        final = tmp.parent / name
        os.rename(tmp, final)
        fsync_dir(tmp.parent)
        self._link_visible(final, journal=True)
        swap = self.dest / f".current.tmp-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join(".versions", name), swap)
        os.replace(swap, self.dest / ".current")  # the commit point
        self._state, self._version = state, final
        self._after_swap(final, True, lambda: [version])
        log.info("%s: compacted: base is now step %d (%d journal entries carried over)", self.dest, base.step,
                 len(extra))
        return True

    # -- syncing ------------------------------------------------------------------------------
    def sync(self, timeout: float | None = None) -> int:
        """Bring `dest` to the head once and return the step held (_sync); a failure is counted by reason
        (failure_counts), and the fleet ledger and listeners hear of every attempt."""
        return self._attempt(lambda: self._sync(timeout))

    def redeliver(self) -> None:
        """Offer the held step again to the module, the engine and on_update, where one has not taken it. It
        reads DEST's held state only, never the store: an engine that restarts during a store outage still
        gets the step this host holds. Failures are counted and heard of as sync()'s are."""
        self._attempt(self._deliver)

    def _attempt(self, call: Callable[[], Any]) -> Any:
        """Run one sync or delivery: a failure is counted by reason and kept (last_error), and the fleet
        ledger and listeners hear of every attempt."""
        try:
            out = call()
        except Exception as exc:
            self.failures[_failure_reason(exc)] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._last_failure = exc
            self._notify()
            raise
        self.last_error = None
        self._notify()
        return out

    def _sync(self, timeout: float | None = None) -> int:
        """Bring `dest` to the head once and return the step held (raises SyncTimeout / SyncError).

        A chain is applied to the held tensors in place; if persisting the step fails, they are reverted
        exactly (from the sync's undo log), so `tensors` and DEST always hold the same step. DEST is persisted
        first; then the module and on_update get the held step unless they already have it, so one that
        failed (HotLoadError, or on_update's own exception, raised here) is retried by the next sync even
        when the manifest has not changed. In journal mode a compaction may start afterwards (background).
        """
        if self._lock is None:
            raise SyncError(f"{self.dest}: this watcher is closed (it no longer holds {self.dest / LOCK_NAME})")
        versions = self._versions_dir()
        spool = versions / f".spool-{uuid.uuid4().hex[:8]}.tmp"  # snapshot files land here, then in a version
        spool.mkdir()
        try:
            self._sync_once(timeout, spool)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        self._deliver()
        self._maybe_compact()
        if self.step is None:  # reach() returns nothing only when a step is held, and else the tensors we took
            raise SyncError("internal: no step held after a sync")
        return self.step

    def _sync_once(self, timeout: float | None, spool: Path) -> None:
        undo = codec.UndoLog()
        trail = Trail()
        repair = self.accept_older_head
        began, downloaded = time.monotonic(), self.reader.bytes_downloaded
        m, tensors, rec = self.reader.reach(self.step, self.tensors, run=self.run_id, timeout=timeout, undo=undo,
                                            spool=spool, trail=trail, accept_older_head=repair)
        if tensors is None:
            self.accept_older_head = None  # a sync that found nothing to repair spends it too
            return
        in_place = tensors is self.tensors
        # a repair is of the head found at start: once another head was read (a first sync that failed, a wait
        # inside it), a manifest replayed at step `repair` is no repair
        repair = repair if repair is not None and self.reader.heads_seen.keys() == {repair} else None
        back = repair is not None and rec is not None and self.step is not None and rec.step == repair < self.step
        try:
            if rec is None:  # reach() returns the tensors with their record, or neither
                raise SyncError("internal: tensors without a record")
            if self.step is not None and ((rec.step <= self.step and not back) or m.run != self.run_id):
                raise SyncError(f"{self.url}: refusing step {rec.step} of run {m.run}; {self.dest} holds step "
                                f"{self.step} of run {self.run_id} and never moves back or across runs")
            if self._floor is not None and self.step is None and (
                    (rec.step < self._floor[0] and rec.step != repair) or m.run != self._floor[1]):
                raise SyncError(f"{self.url}: refusing step {rec.step} of run {m.run}; {self.dest} held step "
                                f"{self._floor[0]} of run {self._floor[1]} (for another tensor selection, or in a "
                                f"version found damaged) and never moves back or across runs")
            self._persist(rec, tensors, trail, in_place)
        except BaseException:
            undo.revert()  # the held tensors are back at self.step, which DEST still shows
            raise
        if (self.module is not None and in_place and self._module_tensors is tensors and self.module_step != rec.step
                and self._module_logs is not None):
            self._module_logs.append(undo)  # the module's step is this dict before these logs: kept to restore it
            if sum(u.nbytes for u in self._module_logs) > self._model_bytes():
                # a module refusing step after step: restoring from the logs would cost more than a copy of the
                # model, and they would grow with every step; the next hot-load keeps a copy of what it replaces
                self._module_logs = None
        floor = self._floor
        if back or (floor is not None and rec.step == repair and rec.step < floor[0]):
            log.warning("%s: moved back from step %d to %d (accept_older_head=%d)", self.dest,
                        floor[0] if floor else self.step, rec.step, rec.step)
        self.accept_older_head = None  # spent by the first successful sync, whether it moved back or not
        self._floor = None
        self.step, self.run_id, self.tensors = rec.step, m.run, tensors
        self._held_partial = self.reader.want is not None
        STEP_LOG.info("%s: now at step %d (%s): %d bytes downloaded, %.2f s", self.dest, rec.step, self.url,
                      self.reader.bytes_downloaded - downloaded, time.monotonic() - began)

    def _deliver(self) -> None:
        """Hand the held step to the module and to on_update, each unless it already has it.

        on_update(step, tensors) gets the watcher's live held state: valid until the next sync, which updates
        those tensors in place (copy what must outlive it)."""
        failure: BaseException | None = None
        try:
            self._hold_in_mode()
        except Exception as exc:  # noqa: BLE001 - DEST still holds the step verified; only the engine must wait
            log.error("%s: step %s could not be rewritten as a full version (the engine does not get it): %s",
                      self.dest, self.step, exc)
            failure = exc
        if self.module is not None and self.step is not None and self.module_step != self.step:
            try:
                self._hot_load()
            except HotLoadError as exc:
                log.error("%s", exc)
                failure = exc
        if self.engine is not None and self.step is not None and (self._engine_lost() or self.engine_step != self.step):
            try:
                self._engine_load()
            except EngineError as exc:
                log.error("%s: %s", self.dest, exc)
                failure = failure or exc
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

    def _module_previous(self, name: str) -> torch.Tensor:
        """The module's step of tensor `name`: the dict it took it from, with the in-place syncs since undone
        in a copy (the dict itself is the live held state)."""
        if self._module_tensors is None or self._module_logs is None:
            raise SyncError("internal: no step the module took, or no logs to rebuild it from")
        previous = self._module_tensors[name]
        if not self._module_logs:
            return previous
        old = previous.detach().clone()
        for undo in reversed(self._module_logs):
            undo.revert_copy(name, old, source=previous)  # a sharded step's parts wrote through row views
        return old

    def _hot_load(self) -> None:
        """Copy the held step into the module, all or nothing.

        Every name, shape and dtype is checked first (exact: a broadcasting copy_ is refused), then the
        tensors are copied; if a copy fails anyway, those already copied are restored to the module's step
        (the tensors it took, with the in-place syncs since undone from their logs), so the module never
        mixes two steps.
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
        kept: dict[str, torch.Tensor] | None = {} if self._module_logs is None else None  # what each copy replaced
        try:
            with torch.no_grad():
                for k in live:
                    if kept is not None:
                        kept[k] = live[k].detach().clone()
                    live[k].copy_(new[k])
                    done.append(k)
        except Exception as exc:
            if self._module_tensors is None:
                raise HotLoadError(f"{self.dest}: module update to step {self.step} failed copying {k} ({exc}); "
                                   f"the module never took a step from this watcher, so the {len(done)} tensors "
                                   f"already copied cannot be restored") from exc
            with torch.no_grad():
                for d in done:
                    live[d].copy_(kept[d] if kept is not None else self._module_previous(d))
            raise HotLoadError(f"{where} (copying {k} failed: {exc}; {len(done)} copied tensors restored)") from exc
        self.module_step, self._module_tensors, self._module_logs = self.step, new, []

    def _engine_load(self) -> None:
        """Stage the held step in the engine (it keeps serving), then commit it (pause, apply, resume).
        Only the tensors whose record entries differ from the engine's step are named as changed; an
        engine that fails either phase stays on its step, and engine_step does not move."""
        if self.engine is None or self._state is None or self._version is None or self.step is None:
            raise SyncError("internal: engine load without an engine or a persisted step")
        if self._state.persist != "full" or self._state.step != self.step or self._state.partial:
            # its files would be another step's (a journal version's base) under this step's label
            raise EngineError(f"engine not given step {self.step}: {self._version} is not a full version of it "
                              f"(persist {self._state.persist}, step {self._state.step}); it stays on step "
                              f"{self.engine_step}")
        update = Update(self.step, self._state.run, self.tensors or {}, self._version,
                        changed_names(self._engine_tensors, self._state.tensors),
                        self._engine_version if self.engine_step is not None else None)
        try:
            self.engine.stage(update)
            pause = self.engine.commit(self.step)
        except EngineError:
            self.engine.abort()
            self._engine_lost()  # a commit whose outcome is unknown leaves the engine on no step it can name
            raise
        except Exception as exc:  # an adapter's own failure: a refused step
            self.engine.abort()
            self._engine_lost()
            raise EngineError(f"engine did not take step {self.step}: {exc}") from exc
        old, self._engine_version = self._engine_version, self._version
        self.engine_step, self._engine_tensors = self.step, self._state.tensors
        if old is not None and old != self._version:
            with self._dest_lock:  # the engine left it: nothing rolls back to it any more
                _remove_entry(old)
        changed = "all" if update.changed is None else len(update.changed)
        log.info("%s: engine now serves step %d (%s tensors changed, paused %.3f s)", self.dest, self.step,
                 changed, pause)

    def _engine_lost(self) -> bool:
        """Whether the engine no longer serves the step it took (state()'s step moved: it restarted, or a
        commit's outcome is unknown); then it is treated as a fresh one (its next update is whole)."""
        if self.engine is None or self.engine_step is None:
            return False
        try:
            now = self.engine.state().get("step")
        except Exception as exc:  # noqa: BLE001 - an adapter whose state() fails: nothing known to have changed
            log.warning("%s: engine state() failed: %s", self.dest, exc)
            return False
        if now == self.engine_step:
            self._engine_losses = 0
            return False
        self._engine_losses += 1  # in a row: each whole re-push it lost again counts one more
        self._engine_lost_next = time.monotonic() + self._offer_backoff().delay(self._engine_losses)
        log.warning("%s: the engine no longer serves step %d (it reports %s); it gets the held step %s whole%s",
                    self.dest, self.engine_step, now, self.step,
                    f" (lost {self._engine_losses} times in a row)" if self._engine_losses > 1 else "")
        self.engine_step = self._engine_tensors = None
        return True

    def _offer_backoff(self) -> Backoff:
        """The waits between offers of a held step the module, engine or on_update did not keep."""
        return Backoff(max(self.poll_interval, DELIVERY_RETRY[0]), max(self.poll_interval, DELIVERY_RETRY[1]))

    def _undelivered(self) -> bool:
        """Whether the held step has yet to reach the module, the engine or on_update (a delivery failed)."""
        return self.step is not None and (
            (self.module is not None and self.module_step != self.step)
            or (self.engine is not None and self.engine_step != self.step)
            or (self.on_update is not None and self.delivered_step != self.step))

    def run(self, sync_timeout: float | None = None) -> None:
        """Poll forever (until stop()): one conditional manifest read per interval, a sync when it changed.

        A failed sync is logged and retried at the next change or interval; with `sync_timeout`, a
        sync that cannot finish in time raises SyncTimeout instead. A held step that the module, the
        engine or on_update did not take is offered again without a new manifest (after DELIVERY_RETRY,
        doubling per failure): a trainer that stops publishing must not leave an engine on an old step.
        An engine found no longer serving the held step (it restarted) gets it back whole at once; one that
        loses it again after each re-push is looked at with the same doubling waits.
        """
        etag = None
        retry = self._offer_backoff()
        refused, refused_step, retry_at = 0, None, 0.0  # failed offers of the held step in a row; when to retry
        absent_since: float | None = None  # when the last "nothing at URL" warning was logged
        if self.fleet is not None:
            self.fleet.start()  # heartbeats, also while a sync hangs (a stuck host shows as behind, not dead)
        while not self._stop.is_set():
            offered = False  # whether this round's sync offered the held step
            try:
                got: ManifestRead | None | Unchanged
                try:
                    got = self.store.read_manifest(if_none_match=self.reader.refused_etag or etag)
                except Exception as exc:  # noqa: BLE001 - the store is down: the held step may still be delivered
                    self.failures["poll"] += 1
                    log.error("%s: reading the manifest failed, keeping step %s: %s", self.dest, self.step, exc)
                    got = NOT_MODIFIED
                if got is None and (absent_since is None or time.monotonic() - absent_since >= NO_RUN_WARNING):
                    absent_since = time.monotonic()
                    self._warn_absent()
                elif got is not None:
                    absent_since = None
                if got is not NOT_MODIFIED and got is not None:
                    reads = self.reader.manifest_reads
                    offered = True
                    try:
                        self.sync(timeout=sync_timeout)
                        etag = got.etag
                    finally:  # this manifest's head reached, only its delivery failed: offered again below
                        if (self.reader.manifest_reads != reads and self.step == self.reader.head_seen
                                and self._undelivered()):
                            etag = got.etag
                elif (self.engine is not None and self.step is not None
                      and time.monotonic() >= self._engine_lost_next and self._engine_lost()):
                    # an engine that restarted gets the held step back now, from DEST; one that loses it again
                    # after each re-push (flapping) is looked at, and re-pushed, less and less often
                    offered = True
                    self.redeliver()
                elif self._undelivered() and time.monotonic() >= retry_at:
                    offered = True
                    self.redeliver()  # no new manifest (or no store): the held step offered again, from DEST
            except SyncTimeout:
                if sync_timeout is not None:
                    raise
            except Exception as exc:  # noqa: BLE001 - a rollout host keeps serving its last good step
                if exc is not self._last_failure:  # sync() counted its own
                    self.failures["poll"] += 1
                log.error("%s: sync failed, keeping step %s: %s", self.dest, self.step, exc)
            if not self._undelivered():
                refused, refused_step, retry_at = 0, None, 0.0
            elif offered:  # refused again (a new step starts its own count)
                refused = refused + 1 if refused_step == self.step else 1
                refused_step, retry_at = self.step, time.monotonic() + retry.delay(refused)
            self._stop.wait(self.poll_interval)
        if self.fleet is not None:
            self.fleet.stop()

    def _warn_absent(self) -> None:
        """Tell the operator, by name, what is missing at the URL: the bucket (or directory) or the run in it."""
        try:
            what = "the run's manifest.json" if self.store.has_container() else "the bucket (or directory)"
        except Exception as exc:  # noqa: BLE001 - the store is down: say so, the poll keeps trying
            what = f"the run's manifest.json (checking for the bucket failed: {exc})"
        log.warning("%s: no run at %s: %s does not exist; waiting for one (this warning repeats every %.0f s)",
                    self.dest, self.url, what, NO_RUN_WARNING)

    def stop(self) -> None:
        self._stop.set()
