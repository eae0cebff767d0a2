"""Regional relay: mirror a run from the origin store into one store per rollout region.

Why: cross-region bandwidth is the scarce resource. Each object should cross a region boundary
once; the region's watchers then read it locally. S3 Cross-Region Replication can do the copy,
but it gives no order between objects and works only S3 to S3. This relay works for any pair of
fsspec stores and keeps each regional manifest consistent: it copies every object a regional
manifest will name, verified against the hashes the origin manifest carries, and only then
commits that manifest with the store's conditional write (the writer rules of docs/PROTOCOL.md
sections 3 and 4.1, applied to the regional store). It writes nothing but deltas/, records/,
snapshots/ objects and manifest.json (infra/README.md grants the relay role exactly that), in
regional-snapshot mode no snapshots/ but regional/ (through its materialisers, PROTOCOL §8), and, in
the origin, each region's gathered fleet ledger (fleet/regions/, relay.fleet, PROTOCOL §9).

Regional-snapshot mode (`regional_snapshots=True`): full snapshots are most of what would cross, and
a region already holds every delta, so the origin's snapshots are never copied. A Materialiser per
region (relay/regional.py) bootstraps once from an origin snapshot and builds the region's own; a
regional manifest is committed only once the region announces a snapshot its chain starts from (until
then the relay stages it for the materialiser, `_Staged`), so a fresh watcher never waits on a
snapshot that will not come. Bytes moved are counted by kind (relay/traffic.py) on every link.

Each destination has its own worker thread, its own backoff and its own view of what it holds,
so a slow or unreachable region never holds up the others. A destination's manifest is the
origin's, trimmed to the oldest snapshot the region needs: a fresh (or emptied) region is seeded
from the origin's newest snapshot, not from its whole history. New snapshots are copied after the
deltas of the head, so a multi-megabyte snapshot never delays the next step. Everything is
idempotent: objects are create-only and compared on collision, the manifest is a compare-and-swap,
so a restart at any point (or two relays on one destination) is safe.

A regional object counts as present only once it is checked against the reference the manifest
being committed gives it: we wrote those bytes, or we read the regional object back (in region;
once per object and relay process) and it matched. Sizes prove nothing: a new run at the origin
prefix reuses every key, and its records and same-architecture shards keep their sizes. When the
origin's run changes, every object the new manifest names is verified or replaced, never mixed.

Signed runs (docs/SECURITY.md): a signature covers the whole origin manifest, so a region cannot
be given a trimmed copy. When the origin manifest is signed the relay copies every object it
names (each checked against its SHA-256) and then commits the origin's bytes unchanged,
signatures included. With `trusted_keys` the relay also refuses an origin manifest that is
unsigned or not signed by one of them, so a forged origin never reaches the regions; it verifies
the regional manifest as well and replaces one that does not verify (damage, or a bucket writer's
forgery that would otherwise freeze the region at a fake head); and it keeps a region on the
verified run it holds when the origin shows another run, unless told to accept run changes
(`replace_runs`): a replayed genuine manifest of an older run looks exactly like a new run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from relay import fleet
from relay.announce import Announcement, read_announcement
from relay.manifest import Manifest, ManifestError, ObjRef, Snapshot, step_of_key
from relay.progress import STEP_LOG
from relay.regional import Materialiser
from relay.retry import Backoff
from relay.signing import SignatureError, TrustedKeys
from relay.store import (MANIFEST_KEY, NOT_MODIFIED, ConflictError, ManifestRead, ObjectMissing, Store, Unchanged,
                         content_tag, open_store)
from relay.traffic import CountingStore, split

log = logging.getLogger(__name__)



class CopyError(RuntimeError):
    """An object could not be copied as the origin manifest describes it (size or hash mismatch at the origin)."""


def _covers(held: ObjRef | None, ref: ObjRef) -> bool:
    """Whether an object verified as `held` is also `ref`: same key, size and xxh3, and `ref`'s SHA-256
    was checked too when it has one (a run that became signed is read back once more)."""
    return held is not None and (held == ref or (ref.sha256 is None and (held.key, held.size, held.xxh3)
                                                 == (ref.key, ref.size, ref.xxh3)))


@dataclass
class Destination:
    """One region's store. `store` may be given ready-made (a wrapped store in benchmarks); else `url` is opened."""

    name: str
    url: str
    storage_options: dict | None = None
    store: Store | None = None


def trim(m: Manifest, floor: int) -> Manifest:
    """`m` without what precedes snapshot `floor` (Manifest.trimmed_to)."""
    return m.trimmed_to(floor)


def choose_floor(m: Manifest, current: Manifest | None) -> int:
    """The oldest snapshot a region keeps: what it already starts from, or the origin's newest for a fresh region."""
    steps = [s.step for s in m.snapshots]
    if current is None or current.run != m.run:
        return m.base
    held = current.snapshots[0].step
    older = [s for s in steps if s <= held]
    return older[-1] if older else steps[0]


def snapshot_refs(snap: Snapshot) -> list[ObjRef]:
    return [snap.index, *snap.files]


def _manifest_refs(m: Manifest, without: Set[int] = frozenset()) -> list[ObjRef]:
    refs: dict[str, ObjRef] = {}
    for s in m.steps:
        refs[s.record.key] = s.record
        for p in s.parts or ():
            refs[p.ref.key] = p.ref
    for snap in m.snapshots:
        if snap.step not in without:
            for r in snapshot_refs(snap):
                refs[r.key] = r
    return list(refs.values())


def _at_least(step: int | None, target: int) -> bool:
    return step is not None and step >= target


def servable_from(m: Manifest, ann: Announcement | None) -> list[int]:
    """Steps of the region's announced snapshots a reader of `m` can start from: of this run, listed in `m`
    at or after its oldest snapshot, and with a chain from there to the head (PROTOCOL §8.1)."""
    if ann is None or ann.run != m.run or not m.snapshots:
        return []
    return [s.step for s in ann.snapshots if s.step >= m.snapshots[0].step and m.step(s.step) is not None
            and (s.step == m.head or m.chain(s.step) is not None)]


def regional_floor(m: Manifest, ann: Announcement | None) -> int | None:
    """The snapshot a regional manifest of `m` starts at in regional-snapshot mode: the origin's newest at or
    before the oldest regional snapshot a reader can start from (so every one of them stays usable, and the
    manifest does not grow with the run); None when the region has none yet."""
    usable = servable_from(m, ann)
    if not usable:
        return None
    return max(s.step for s in m.snapshots if s.step <= min(usable))


class _Staged(CountingStore):
    """The region as its materialiser sees it: the region itself (what it writes is counted), except that
    while a manifest is staged, that is the region's manifest. The relay stages the manifest it wants to
    commit until the region can serve it: the materialiser bootstraps from it (deltas and records are in the
    region already, the snapshot comes from the origin), announces a snapshot, and only then is it committed."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._staged: bytes | None = None
        self._stage_lock = threading.Lock()

    def stage(self, data: bytes | None) -> None:
        with self._stage_lock:
            self._staged = data

    @overload
    def read_object(self, key: str, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_object(self, key: str, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_object(self, key: str, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        with self._stage_lock:
            staged = self._staged if key == MANIFEST_KEY else None
        if staged is None:
            return super().read_object(key, if_none_match)
        tag = content_tag(staged)
        return NOT_MODIFIED if tag == if_none_match else ManifestRead(staged, tag)


class _SourceCache:
    """Origin objects fetched once and shared by every region's worker (bounded LRU, one fetch per reference).

    Keyed by the whole ObjRef, not the key: a new run at the origin prefix reuses every key, and bytes
    verified against the old reference must never be handed out for the new one."""

    def __init__(self, store: Store, capacity: int) -> None:
        self.store = store
        self.capacity = capacity
        self.bytes_read = 0
        self._data: OrderedDict[ObjRef, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._key_locks: dict[ObjRef, threading.Lock] = {}

    def _verified(self, ref: ObjRef) -> bytes:
        data = b""
        for attempt in range(2):
            data = ref.read(self.store)
            with self._lock:
                self.bytes_read += len(data)
            problem = ref.matches(data)  # size, xxh3 and, in a signed manifest, SHA-256
            if problem is None:
                return data
            log.warning("%s/%s: %s (%s)", self.store.url, ref.key, problem,
                        "refetching" if attempt == 0 else "giving up")
        raise CopyError(f"{self.store.url}/{ref.key}: does not match the origin manifest ({ref.matches(data)})")

    def get(self, ref: ObjRef) -> bytes:
        with self._lock:
            if ref in self._data:
                self._data.move_to_end(ref)
                return self._data[ref]
            key_lock = self._key_locks.setdefault(ref, threading.Lock())
        with key_lock:  # regions asking for the same object wait for one fetch
            with self._lock:
                if ref in self._data:
                    return self._data[ref]
            data = self._verified(ref)
            with self._lock:
                self._key_locks.pop(ref, None)
                if len(data) <= self.capacity and ref not in self._data:
                    self._data[ref] = data
                    self._size += len(data)
                    while self._size > self.capacity:
                        _, old = self._data.popitem(last=False)
                        self._size -= len(old)
            return data


@dataclass
class _Region:
    dest: Destination
    store: Store
    # key -> the reference the regional object was verified against (we wrote those bytes, or read them
    # back and they matched); only these count as present. Survives a relist for keys still listed at that size.
    known: dict[str, ObjRef] = field(default_factory=dict)
    listed: dict[str, int] | None = None  # key -> size as last listed; None: list the store first
    refused_etag: str | None = None  # origin version this region refused to switch runs to
    head: int | None = None
    run: str | None = None
    synced_etag: str | None = None  # origin manifest version this region fully mirrors
    synced_head: int | None = None  # and that version's head
    bytes_copied: int = 0
    objects_copied: int = 0
    bytes_committed: int = 0  # bytes_copied at the last regional commit: what each commit's step line reports
    counted: CountingStore | None = None  # store as wrapped: what we wrote into the region, by kind
    # regional-snapshot mode: the region's materialiser, its view of the region, its origin reads (bootstrap)
    materialiser: Materialiser | None = None
    staged: _Staged | None = None
    boot: CountingStore | None = None
    mat_thread: threading.Thread | None = None
    waiting: bool = False  # the origin's head is held back until the region announces a snapshot to start from
    bytes_read_back: int = 0  # in-region reads checking listed objects against the manifest
    failures: int = 0
    errors: int = 0
    last_error: str | None = None
    next_try: float = 0.0
    last_check: float = 0.0  # monotonic time of the last sync attempt
    last_read: float = 0.0  # monotonic time the regional manifest was last read from the store
    manifest: ManifestRead | None = None  # the regional manifest as last read or committed by us
    last_commit: float | None = None  # wall clock
    delays: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds from seen at origin to here)
    # origin key -> monotonic time a copy first found it missing there (lost for good once reroute_after passes)
    lost: dict[str, float] = field(default_factory=dict)
    thread: threading.Thread | None = None


class Fanout:
    """Keeps every destination on the origin's head; `run()` forever, `sync_once()` to the current head.

    poll_interval: seconds between conditional reads of the origin manifest.
    workers: parallel object copies per destination. cache_bytes: origin objects kept for the other regions.
    retry_initial / retry_max: per-destination backoff after a failure.
    recheck_interval: a region in sync re-reads its own manifest this often, so an emptied or
    recreated bucket is re-seeded even while the origin is idle.
    regional_snapshots: never copy the origin's snapshots/ into a region; a Materialiser per region (relay/
    regional.py, its state under `workdir`/<region name>) builds the region's own snapshots from the chain,
    bootstrapping once from an origin snapshot, and a regional manifest is committed only when the region
    announces a snapshot its chain starts from (PROTOCOL §8). materialise_every / materialise_keep: the
    Materialiser's `every` and `keep`.
    trusted_keys: Ed25519 public keys (PEM paths): only origin manifests signed by one of them are mirrored,
    and a regional manifest that does not verify under them is treated as damage and replaced.
    replace_runs: whether a region holding another run than the origin's is switched to the origin's run.
    None means True without trusted_keys (the origin is all the relay can go by: a new run was started
    there) and False with them (a verified regional run is kept; a replayed genuine manifest of an older
    run at the origin must not switch it): the refusal is logged as an error and counted in the region's
    status, and sync_once reports that region as not synced.
    fleet_interval: seconds between gatherings of each region's fleet ledger into the origin
    (`fleet/regions/<name>.json`, relay.fleet; None: none). metrics_port / metrics_registry: Prometheus
    metrics (relay.metrics), served on metrics_addr until close().
    """

    def __init__(self, source: str | Store, destinations: list[Destination], *, source_options: dict | None = None,
                 poll_interval: float = 1.0, workers: int = 4, cache_bytes: int = 1 << 30,
                 retry_initial: float = 0.5, retry_max: float = 30.0, recheck_interval: float = 30.0,
                 trusted_keys: Any = None, replace_runs: bool | None = None, regional_snapshots: bool = False,
                 workdir: str | os.PathLike | None = None, materialise_every: int | None = None,
                 materialise_keep: int = 2, fleet_interval: float | None = fleet.DEFAULT_AGGREGATE_INTERVAL,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 metrics_registry: Any = None, reroute_after: float | None = 300.0) -> None:
        if not destinations:
            raise ValueError("the relay needs at least one destination")
        names = [d.name for d in destinations]
        if len(set(names)) != len(names):
            raise ValueError(f"destination names must be unique, got {names}")
        # Every byte read from the origin is counted by kind (the relay's side of the cross-region link).
        self.source = CountingStore(source if isinstance(source, Store) else open_store(source, source_options))
        if any(d.url.rstrip("/") == self.source.url for d in destinations):
            raise ValueError(f"{self.source.url}: a destination is the source itself")
        self.poll_interval = poll_interval
        self.workers = workers
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.backoff = Backoff(retry_initial, retry_max)  # per region, after each failure in a row
        self.recheck_interval = recheck_interval
        self.reroute_after = reroute_after
        self.trusted = TrustedKeys.from_option(trusted_keys)
        self.replace_runs = self.trusted is None if replace_runs is None else bool(replace_runs)
        self._cache = _SourceCache(self.source, cache_bytes)
        self.regional = regional_snapshots
        if regional_snapshots and workdir is None:
            raise ValueError("regional snapshots need a workdir (the materialisers' snapshot spool)")
        self.regions: dict[str, _Region] = {}
        for d in destinations:
            inner = d.store if d.store is not None else open_store(d.url, d.storage_options)
            counted = CountingStore(inner)
            region = self.regions[d.name] = _Region(d, counted, counted=counted)
            if regional_snapshots:
                region.staged = _Staged(inner)
                region.boot = CountingStore(self.source.inner)
                region.materialiser = Materialiser(
                    region.staged, Path(workdir or ".") / d.name, bootstrap_from=region.boot,
                    every=materialise_every, keep=materialise_keep, trusted_keys=trusted_keys,
                    retry_initial=min(retry_initial, poll_interval), retry_max=retry_max)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._origin: Manifest | None = None
        self._origin_etag: str | None = None
        self._origin_data: bytes | None = None  # the origin manifest's bytes: a signed one is mirrored as is
        self._seen: dict[int, tuple[float, float]] = {}  # origin head -> (monotonic, wall) when first seen
        self._source_error: str | None = None
        self._refused_origin: str | None = None  # ETag of the origin manifest last refused (not read again)
        self._last_sig: tuple | None = None
        self.fleet = None if fleet_interval is None else fleet.RegionGatherer(
            self.source, {name: r.store for name, r in self.regions.items()}, fleet_interval)
        self.metrics: Any = None
        self.metrics_port: int | None = None
        if metrics_port is not None or metrics_registry is not None:
            from relay import metrics  # prometheus_client only for a relay that exports metrics

            self.metrics = metrics.FanoutMetrics(self, registry=metrics_registry)
            if metrics_port is not None:
                self.metrics_port = self.metrics.serve(metrics_port, metrics_addr)

    # -- origin ---------------------------------------------------------------------------------
    def poll_source(self) -> bool:
        """One conditional read of the origin manifest; True when a new version was taken in."""
        try:
            # a version refused already is not downloaded again until it changes (its size is a writer's)
            got = self.source.read_manifest(if_none_match=self._refused_origin or self._origin_etag)
        except Exception as exc:  # noqa: BLE001 - the regions keep what they have; try again next poll
            text = f"{type(exc).__name__}: {exc}"
            if text != self._source_error:
                log.warning("%s: cannot read the origin manifest (%s); regions keep their step", self.source.url, text)
            self._source_error = text
            return False
        if got is NOT_MODIFIED:  # the version last accepted, or the one last refused (its error stays shown)
            if self._refused_origin is None:
                self._source_error = None
            return False
        self._source_error = None
        if got is None:
            self._refused_origin = None
            return False
        try:
            m = Manifest.parse(got.data, f"{self.source.url}/manifest.json")
            if self.trusted is not None:
                self.trusted.verify(m, f"{self.source.url}/manifest.json")
        except ManifestError as exc:  # SignatureError included: a forged origin goes no further
            log.error("%s: refusing the origin manifest: %s", self.source.url, exc)
            self._refused_origin, self._source_error = got.etag, f"refused the origin manifest: {exc}"
            return False
        self._refused_origin = None
        now = (time.monotonic(), time.time())
        with self._cond:
            if self._origin is not None and m.run == self._origin.run and m.head < self._origin.head:
                log.warning("%s: origin head went back from %d to %d; mirroring it anyway (regions never move back)",
                            self.source.url, self._origin.head, m.head)
            if self._origin is not None and m.run != self._origin.run:
                self._seen.clear()
            self._seen.setdefault(m.head, now)
            while len(self._seen) > 10000:
                del self._seen[min(self._seen)]
            self._origin, self._origin_etag, self._origin_data = m, got.etag, got.data
            self._cond.notify_all()
        return True

    # -- one destination --------------------------------------------------------------------------
    def _copy(self, region: _Region, ref: ObjRef) -> None:
        data = self._cache.get(ref)  # checked against `ref` (size, xxh3, SHA-256 when signed)
        try:
            region.store.put_immutable(ref.key, data)
        except ConflictError:
            # A different object under this key: another run's, a crashed writer's, or damage. Regional
            # manifests only name objects this relay verified, so replacing it is safe.
            log.warning("%s/%s: holds other bytes than the origin; replacing it", region.store.url, ref.key)
            region.store.delete([ref.key])
            region.store.put_immutable(ref.key, data)
        region.known[ref.key] = ref
        if region.listed is not None:
            region.listed[ref.key] = ref.size
        with self._cond:
            region.bytes_copied += len(data)
            region.objects_copied += 1

    def _held(self, region: _Region, ref: ObjRef) -> bool:
        """Verified present, or listed at the right size and not known to differ (to be read back in region,
        not copied across)."""
        held = region.known.get(ref.key)
        if held is not None and (held.size, held.xxh3) != (ref.size, ref.xxh3):
            return False
        return _covers(held, ref) or (region.listed or {}).get(ref.key) == ref.size

    def _make_present(self, region: _Region, ref: ObjRef) -> None:
        """Make the regional object under ref.key exactly `ref`: a listed one of the right size is read back
        (an in-region read) and kept if it matches; anything else is copied from the origin (replacing it)."""
        held = region.known.get(ref.key)
        if _covers(held, ref):
            return
        # read back unless we know it holds other bytes (a known ref with another tag: copy over it)
        same_tag = held is None or (held.size, held.xxh3) == (ref.size, ref.xxh3)
        if same_tag and (region.listed or {}).get(ref.key) == ref.size:
            try:
                data = ref.read(region.store)
            except ObjectMissing:
                data = None
            if data is not None:
                with self._cond:
                    region.bytes_read_back += len(data)
                problem = ref.matches(data)
                if problem is None:
                    region.known[ref.key] = ref
                    return
                # Records and same-architecture shards have the same size in every run: a new run at the
                # origin prefix, or damage, leaves objects that only a content check tells apart.
                log.warning("%s/%s: %s; replacing it from the origin", region.store.url, ref.key, problem)
        self._copy(region, ref)

    def _past_lost(self, region: _Region, m: Manifest) -> int:
        """The lowest floor that leaves out every origin object missing for `reroute_after` (a PUT that never
        landed, a replication that failed for good, when the origin is itself a region): the newest snapshot
        past the highest such object's step, if there is one. Watchers route around such an object through a
        snapshot; a region kept at a floor below it could never be committed again."""
        if self.reroute_after is None:
            return -1
        now = time.monotonic()
        steps = [step_of_key(k) for k, t in region.lost.items() if now - t >= self.reroute_after]
        worst = max((st for st in steps if st is not None), default=None)
        if worst is None:
            return -1
        past = [s.step for s in m.snapshots if s.step >= worst]
        if not past:
            return -1
        log.warning("%s: origin objects %s have been missing for over %.0fs; the region starts at snapshot %d "
                    "instead", region.dest.name, sorted(region.lost)[:3], self.reroute_after, past[0])
        return past[0]

    def _ensure(self, region: _Region, refs: list[ObjRef]) -> None:
        """Make every ref verified present in the region (in parallel); returns once all are."""
        missing = [r for r in refs if not _covers(region.known.get(r.key), r)]
        if not missing:
            return
        if len(missing) == 1 or self.workers <= 1:
            for r in missing:
                self._make_present(region, r)
            return
        with ThreadPoolExecutor(min(self.workers, len(missing)),
                                thread_name_prefix=f"fanout-{region.dest.name}") as pool:
            for f in [pool.submit(self._make_present, region, r) for r in missing]:
                f.result()

    def _commit(self, region: _Region, new: Manifest, current_data: bytes | None, etag: str | None,
                raw: bytes | None = None) -> str | None:
        data = new.to_bytes() if raw is None else raw
        if data == current_data:
            return etag
        try:
            tag = region.store.commit_manifest(data, etag)
        except ConflictError:
            # Another relay (or a regional gc) committed in between, or the bucket was emptied:
            # re-read and redo next round.
            region.listed, region.manifest = None, None
            raise
        region.manifest = ManifestRead(data, tag)
        now_mono, now_wall = time.monotonic(), time.time()
        with self._cond:
            before = region.head if region.run == new.run else None
            for step, (seen_mono, _) in sorted(self._seen.items()):
                if (before is None or step > before) and step <= new.head:
                    region.delays.append((step, now_mono - seen_mono))
            del region.delays[:-1000]
            region.head, region.run, region.last_commit = new.head, new.run, now_wall
            seen = self._seen.get(new.head)
            copied, region.bytes_committed = region.bytes_copied - region.bytes_committed, region.bytes_copied
        took = "" if seen is None else f", {now_mono - seen[0]:.2f} s after the origin's"
        STEP_LOG.info("%s: now at step %d (origin %d): %d bytes copied%s; snapshots %s, %d objects / %d bytes "
                      "copied so far", region.dest.name, new.head, self._origin.head if self._origin else new.head,
                      copied, took, [s.step for s in new.snapshots], region.objects_copied, region.bytes_copied)
        return tag

    def _regional(self, region: _Region, got: ManifestRead | None) -> Manifest | None:
        """The regional manifest if it can stand: parsed and, with trusted keys, verified. Anything else is
        damage (a bucket writer's forgery, a torn write) that the origin's verified manifest replaces."""
        if got is None:
            return None
        where = f"{region.store.url}/manifest.json"
        try:
            current = Manifest.parse(got.data, where)
            if self.trusted is not None:
                self.trusted.verify(current, where)
        except SignatureError as exc:
            log.warning("%s: regional manifest does not verify (%s); treating it as damage and replacing it with "
                        "the origin's", region.dest.name, exc)
            return None
        except ManifestError as exc:
            log.warning("%s: regional manifest unreadable (%s); replacing it", region.dest.name, exc)
            return None
        return current

    def _refuse_run_change(self, region: _Region, current: Manifest, m: Manifest, origin_etag: str | None) -> bool:
        msg = (f"holds run {current.run} (verified), the origin now shows another run {m.run}; not switching: a "
               f"replayed genuine manifest of an older run looks the same (pass replace_runs=True, relay "
               f"--replace-run, to accept a new run)")
        log.error("%s: %s", region.dest.name, msg)
        with self._cond:
            region.errors += 1
            region.last_error = msg
            region.refused_etag = origin_etag
        return False

    def sync_region(self, region: _Region) -> bool:
        """Bring one destination to the origin manifest as last polled; True when it mirrors that version.

        First the head: every record and delta and the snapshots the region needs to stand alone,
        then the manifest naming them; then the origin's other snapshots, then the full manifest.
        Returns False early when the origin moves on during a snapshot copy (the head comes first),
        and False when the region holds another (verified) run that this relay may not replace.
        """
        with self._cond:
            m, origin_etag, origin_data = self._origin, self._origin_etag, self._origin_data
        if m is None:
            return False
        # Our own last commit stands for the regional manifest (saving a cross-region round trip per
        # step); a conditional commit on a stale one fails and forces a read, and so does recheck_interval.
        if region.manifest is None or time.monotonic() - region.last_read >= self.recheck_interval:
            got = region.store.read_manifest()
            region.manifest, region.last_read = got, time.monotonic()
        got = region.manifest
        current = self._regional(region, got)
        if got is None and region.head is not None:
            log.warning("%s: regional manifest is gone (bucket emptied or recreated?); re-seeding from step %d's "
                        "snapshot", region.dest.name, m.base)
            region.listed = None
            with self._cond:  # it mirrors nothing now: behind until a re-seed lands (and retried as such)
                region.synced_etag = region.synced_head = None
        with self._cond:
            region.head, region.run = (None, None) if current is None else (current.head, current.run)
        if current is not None and current.run != m.run:
            if not self.replace_runs:
                return self._refuse_run_change(region, current, m, origin_etag)
            log.warning("%s: holds run %s, the origin now has run %s; replacing it (every object verified or "
                        "replaced)", region.dest.name, current.run, m.run)
        if current is not None and current.run == m.run and current.head > m.head:
            log.warning("%s: regional head %d is ahead of the origin's %d; leaving it", region.dest.name,
                        current.head, m.head)
            with self._cond:
                region.synced_etag, region.synced_head, region.refused_etag = origin_etag, m.head, None
            return True
        if region.listed is None:
            listed = region.store.list_run()
            region.listed = listed
            # what we verified stays verified while the store still lists it at that size
            region.known = {k: r for k, r in region.known.items() if listed.get(k) == r.size}
        data = None if got is None else got.data
        etag = None if got is None else got.etag
        if self.regional:
            return self._sync_regional(region, m, current, data, etag, origin_etag, origin_data)
        if m.signatures:  # a signature covers the whole manifest: mirror it as is, after every object it names
            self._ensure(region, _manifest_refs(m))
            self._commit(region, m, data, etag, raw=origin_data)
            with self._cond:
                region.synced_etag, region.synced_head, region.refused_etag = origin_etag, m.head, None
            return True
        target = trim(m, max(choose_floor(m, current), self._past_lost(region, m)))
        floor = target.snapshots[0].step
        extra = {s.step for s in target.snapshots
                 if s.step != floor and not all(self._held(region, r) for r in snapshot_refs(s))}
        first = dataclasses.replace(target, snapshots=[s for s in target.snapshots if s.step not in extra])
        try:
            self._ensure(region, _manifest_refs(first))
        except ObjectMissing as exc:
            if exc.key is not None:
                region.lost.setdefault(exc.key, time.monotonic())
            raise
        region.lost.clear()
        etag = self._commit(region, first, data, etag)
        data = first.to_bytes()
        for snap in target.snapshots:
            if snap.step not in extra:
                continue
            for ref in snapshot_refs(snap):
                if self._origin_etag != origin_etag or self._stop.is_set():
                    return False
                self._ensure(region, [ref])
        if extra:
            self._commit(region, target, data, etag)
        with self._cond:
            region.synced_etag, region.synced_head, region.refused_etag = origin_etag, m.head, None
        return True

    def _sync_regional(self, region: _Region, m: Manifest, current: Manifest | None, data: bytes | None,
                       etag: str | None, origin_etag: str | None, origin_data: bytes | None) -> bool:
        """Regional-snapshot mode: copy the records and deltas of the regional manifest (never a snapshot), and
        commit it once the region announces a snapshot its chain starts from. Until then the manifest is staged
        for the region's materialiser, which bootstraps from it (one origin snapshot) and announces."""
        if region.staged is None:
            raise AssertionError("unreachable: regional mode without a materialiser")
        ann, _ = read_announcement(region.store)
        floor = regional_floor(m, ann)
        if m.signatures:  # a signature covers the whole manifest: the origin's bytes, untrimmed
            target, raw, servable = m, origin_data, bool(servable_from(m, ann))
        else:
            servable = floor is not None
            target = trim(m, floor if floor is not None else choose_floor(m, current))
            raw = None
        self._ensure(region, _manifest_refs(target, without={s.step for s in target.snapshots}))
        if not servable:
            region.staged.stage(raw if raw is not None else target.to_bytes())
            if not region.waiting:
                log.info("%s: records and deltas to step %d are in; waiting for the region's materialiser to "
                         "announce a snapshot to start from before committing the manifest", region.dest.name,
                         m.head)
            with self._cond:
                region.waiting = True
                region.next_try = time.monotonic() + self.poll_interval
            return False
        self._commit(region, target, data, etag, raw=raw)
        region.staged.stage(None)
        with self._cond:
            region.waiting = False
            region.synced_etag, region.synced_head, region.refused_etag = origin_etag, m.head, None
        return True

    def _worker(self, region: _Region) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set():
                    wait = region.next_try - time.monotonic()
                    behind = (region.synced_etag != self._origin_etag      # a version to mirror,
                              and region.refused_etag != self._origin_etag)  # unless it was refused
                    due = behind or time.monotonic() - region.last_check >= self.recheck_interval
                    if self._origin_etag is not None and due and wait <= 0:
                        break
                    self._cond.wait(timeout=max(0.01, min(wait, 1.0)) if wait > 0 else 1.0)
            if self._stop.is_set():
                return
            region.last_check = time.monotonic()
            try:
                self.sync_region(region)
                if region.failures:
                    log.warning("%s: reachable again after %d failed attempts", region.dest.name, region.failures)
                region.failures = 0
            except Exception as exc:  # noqa: BLE001 - this region backs off; the others carry on
                region.failures += 1
                region.errors += 1
                # Its contents may have changed (a restarted server, an emptied bucket): look again.
                region.listed = region.manifest = None
                delay = self.backoff.delay(region.failures)
                region.next_try = time.monotonic() + delay
                region.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("%s: sync failed (attempt %d): %s; retrying in %.1fs, other regions continue",
                            region.dest.name, region.failures, region.last_error, delay)

    # -- lifecycle ------------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop.clear()
        if self.fleet is not None:
            self.fleet.start()
        for region in self.regions.values():
            mat = region.materialiser
            if mat is not None and (region.mat_thread is None or not region.mat_thread.is_alive()):
                region.mat_thread = threading.Thread(target=mat.run, args=(self.poll_interval,), daemon=True,
                                                     name=f"materialise-{region.dest.name}")
                region.mat_thread.start()
            if region.thread is None or not region.thread.is_alive():
                region.thread = threading.Thread(target=self._worker, args=(region,), daemon=True,
                                                 name=f"fanout-{region.dest.name}")
                region.thread.start()

    def _join(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for region in self.regions.values():
            if region.thread is not None:
                region.thread.join(timeout=30)
                region.thread = None
        if self.fleet is not None:
            self.fleet.stop()
        for region in self.regions.values():
            thread, mat = region.mat_thread, region.materialiser
            deadline = time.monotonic() + 30
            while thread is not None and mat is not None and thread.is_alive() and time.monotonic() < deadline:
                mat.stop()  # again each time: run() clears the flag when it starts
                thread.join(0.2)
            region.mat_thread = None

    def run(self, status_every: float = 30.0, on_status: Any = None) -> None:
        """Poll the origin and mirror it into every destination until stop().

        Every `status_every` seconds the per-region lag goes to the log; `on_status(status)` is
        called whenever a head, a copy count or an error count changed.
        """
        self._start()
        last_report = time.monotonic()
        try:
            while not self._stop.is_set():
                self.poll_source()
                self._report(on_status)
                if time.monotonic() - last_report >= status_every:
                    self.log_status()
                    last_report = time.monotonic()
                self._stop.wait(self.poll_interval)
        finally:
            self._join()
            self._report(on_status, force=True)

    def sync_once(self, timeout: float | None = None, on_status: Any = None) -> bool:
        """Mirror the origin, as seen at the start or later, into every destination; True if all got there in time.

        "Got there" means the head and the snapshots of that origin version, so new watchers find
        them too. Destinations that fail keep retrying with their backoff until the deadline; one that
        refused the origin's run (see replace_runs) makes the answer False as soon as the others are done.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll_source() and self._origin is None:
            if deadline is not None and time.monotonic() >= deadline:
                log.error("%s: no manifest at the origin", self.source.url)
                return False
            time.sleep(self.poll_interval)
        origin = self._origin
        if origin is None:  # the loop ends when poll_source() took a manifest in
            raise AssertionError("unreachable: no origin manifest after poll_source()")
        target, run = origin.head, origin.run
        self._start()
        try:
            while True:
                with self._cond:
                    refused = [r.refused_etag is not None and r.refused_etag == self._origin_etag
                               for r in self.regions.values()]
                    done = [r.run == run and r.synced_head is not None and r.synced_head >= target
                            and (r.materialiser is None or _at_least(r.materialiser.step, target))
                            for r in self.regions.values()]
                if all(x or y for x, y in zip(refused, done)):
                    return not any(refused)
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._stop.wait(min(self.poll_interval, 0.05))
                self.poll_source()
                self._report(on_status)
        finally:
            self._join()
            self._report(on_status, force=True)
            self.log_status()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """stop(), and stop serving metrics."""
        self.stop()
        if self.metrics is not None:
            self.metrics.close()

    # -- reporting ------------------------------------------------------------------------------
    def _report(self, on_status: Any, force: bool = False) -> None:
        """Hand the status to `on_status` when something a reader cares about changed."""
        if on_status is None:
            return
        with self._cond:
            sig = (self._origin_etag, tuple((r.head, r.synced_etag, r.objects_copied, r.errors, r.failures)
                                            for r in self.regions.values()))
        if force or sig != self._last_sig:
            self._last_sig = sig
            on_status(self.status())

    def status(self) -> dict:
        """Origin head and, per region: head, lag in steps and seconds, bytes copied, errors, delays seen."""
        now = time.monotonic()
        with self._cond:
            origin = self._origin
            out: dict[str, Any] = {
                "source": self.source.url,
                "origin": None if origin is None else {"run": origin.run, "head": origin.head, "base": origin.base},
                "source_bytes_read": self._cache.bytes_read,
                "source_bytes_by_kind": split(self.source.read.bytes()),
                "source_error": self._source_error,
                "regions": {},
                "fleet": None if self.fleet is None else self.fleet.status(),
            }
            for name, r in self.regions.items():
                lag_steps = lag_seconds = None
                if origin is not None:
                    held = r.head if r.run == origin.run else None
                    behind = [s for s in self._seen if held is None or s > held]
                    lag_steps = (origin.head - held) if held is not None else None
                    if held is not None and held >= origin.head:
                        lag_steps, lag_seconds = 0, 0.0
                    elif behind:
                        lag_seconds = now - self._seen[min(behind)][0]
                delays = [d for _, d in r.delays]
                out["regions"][name] = {
                    "url": r.store.url, "head": r.head, "lag_steps": lag_steps, "lag_seconds": lag_seconds,
                    "synced": origin is not None and r.synced_etag == self._origin_etag and r.head is not None,
                    "bytes_copied": r.bytes_copied, "objects_copied": r.objects_copied,
                    "bytes_read_back": r.bytes_read_back,
                    # written into the region, by kind (deltas, records, snapshots, manifests, ...)
                    "bytes_by_kind": split(r.counted.written.bytes() if r.counted is not None else {}),
                    # regional-snapshot mode: the materialiser's reads from the origin (its bootstrap snapshot
                    # crossing) and its writes into the region (in region when it runs there)
                    "bootstrap_bytes_by_kind": split(r.boot.read.bytes()) if r.boot is not None else None,
                    "materialised_bytes_by_kind": split(r.staged.written.bytes()) if r.staged is not None else None,
                    "materialiser": r.materialiser.status() if r.materialiser is not None else None,
                    "waiting_for_snapshot": r.waiting,
                    "run_refused": r.refused_etag is not None and r.refused_etag == self._origin_etag,
                    "failures": r.failures, "errors": r.errors, "last_error": r.last_error,
                    "last_commit": r.last_commit,
                    "delay_median_s": statistics.median(delays) if delays else None,
                    "delay_max_s": max(delays) if delays else None,
                    "delays": list(r.delays),
                }
        return out

    def log_status(self) -> None:
        st = self.status()
        head = st["origin"]["head"] if st["origin"] else None
        for name, r in st["regions"].items():
            lag_s = "?" if r["lag_seconds"] is None else f"{r['lag_seconds']:.1f}s"
            line = (f"{name}: head {r['head']} / origin {head}, lag {r['lag_steps']} steps {lag_s}, "
                    f"{r['bytes_copied']} bytes copied")
            if r["failures"]:
                log.warning("%s, failing (%d in a row): %s", line, r["failures"], r["last_error"])
            else:
                log.info("%s", line)


__all__ = ["Fanout", "Destination", "CopyError", "trim", "choose_floor"]
