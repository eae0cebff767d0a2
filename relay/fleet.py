"""The fleet ledger (docs/PROTOCOL.md §9): which host holds which step, as the hosts themselves say.

Why: a trainer doing bounded-staleness RL must know how far its rollout fleet lags, and an operator
which hosts are stuck. Every watcher writes one small JSON object per host, `fleet/hosts/<host>.json`,
into the store it follows (its region's), by compare-and-swap, on every sync and as a heartbeat.
The regional relay gathers each region's entries into the origin store (`fleet/regions/<region>.json`),
so the trainer reads only its own store; stores without a relay (CRR) are read directly.

The ledger is advisory: nothing in it ever decides which weights anyone loads. Whoever can write a
bucket can lie about the fleet, no more: readers (status, wait_for_fleet) parse every entry strictly
and report a malformed, oversized or absurd one as bad instead of failing. A host that stops
reporting goes stale after a TTL and no longer counts toward a fraction, for or against.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable

import xxhash

from relay.manifest import ManifestError, load_json
from relay.store import NOT_MODIFIED, ConflictError, ManifestRead, Store

if TYPE_CHECKING:
    from relay.watcher import Watcher

log = logging.getLogger(__name__)

HOSTS_PREFIX = "fleet/hosts/"
REGIONS_PREFIX = "fleet/regions/"
HOST_FORMAT = "deltarelay-fleet-host"
REGION_FORMAT = "deltarelay-fleet-region"
VERSION = 1
DEFAULT_INTERVAL = 30.0  # seconds between a watcher's heartbeats
DEFAULT_AGGREGATE_INTERVAL = 15.0  # seconds between a relay's gatherings of a region's entries
MAX_INTERVAL = 3600.0  # a host claiming a longer heartbeat is reported bad: it could never go stale
MAX_SKEW = 300.0  # a report time further in the future than this is absurd (bad), not merely skewed
MAX_ENTRY_BYTES = 64 << 10
MAX_REGION_BYTES = 64 << 20
GATHER_HORIZON = 6 * 3600.0  # a relay's gathering leaves out entries older than this (3 x MAX_INTERVAL + margin)
MAX_HOSTS = 100_000  # entries read from one prefix; more are reported, not read
READ_THREADS = 16  # entries read at once (a GET costs a round trip: 1000 hosts one by one take ~30 s on S3)
HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REASON = re.compile(r"[a-z][a-z0-9_]{0,31}")
_ENGINE_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FleetError(ValueError):
    """A ledger entry that does not follow PROTOCOL §9 (reported as bad by readers, never fatal)."""


class FleetTimeout(TimeoutError):
    """wait_for_fleet gave up: `progress` says how many live hosts held the step and which lag."""

    def __init__(self, message: str, progress: "FleetProgress") -> None:
        super().__init__(message)
        self.progress = progress


def _text(obj: dict, key: str, where: str, limit: int, nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise FleetError(f"{where}.{key}: a printable string of 1 to {limit} characters"
                         f"{' or null' if nullable else ''}, got {str(value)[:80]!r}")
    return value


def _count(obj: dict, key: str, where: str, nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise FleetError(f"{where}.{key}: a non-negative integer{' or null' if nullable else ''}, got {value!r}")
    return value


def _time(obj: dict, key: str, where: str, nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FleetError(f"{where}.{key}: a positive number of seconds{' or null' if nullable else ''}, "
                         f"got {value!r}")
    return float(value)


def _flat(state: Any) -> Any:
    """An engine state() with its nested objects flattened to dotted fields (`last_stage.tensors`) and long
    strings cut at 256 characters: what the ledger's engine entry holds (PROTOCOL §9.1). A list is kept
    as its JSON text."""
    if not isinstance(state, dict):
        return state
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{key}.{k}", v)
        elif isinstance(value, list):
            out[key] = json.dumps(value)[:256]
        else:
            out[key] = value[:256] if isinstance(value, str) else value

    for k, v in state.items():
        put(str(k), v)
    return out


def _engine(value: Any, where: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 32:
        raise FleetError(f"{where}.engine: an object of at most 32 fields, or null")
    for k, v in value.items():
        if not _ENGINE_KEY.fullmatch(k):
            raise FleetError(f"{where}.engine: bad field name {k[:80]!r}")
        if isinstance(v, str):
            if len(v) > 256:
                raise FleetError(f"{where}.engine.{k}: longer than 256 characters")
        elif isinstance(v, float) and not math.isfinite(v):
            raise FleetError(f"{where}.engine.{k}: not a finite number")
        elif v is not None and not isinstance(v, (bool, int, float)):
            raise FleetError(f"{where}.engine.{k}: a string, number, boolean or null, got {type(v).__name__}")
    return dict(value)


@dataclass(frozen=True)
class HostReport:
    """One host's entry, `fleet/hosts/<host>.json` (PROTOCOL §9.1)."""

    host: str
    hostname: str
    url: str  # the store the host follows
    updated: float  # unix seconds of this report (the host's clock)
    started: float
    interval: float  # seconds until its next heartbeat, at most
    instance: str  # random per watcher object: two writers under one host id are told apart
    region: str | None = None
    dest: str | None = None
    run: str | None = None
    step: int | None = None
    step_since: float | None = None  # unix seconds when it reached `step`
    head: int | None = None  # the head it last saw in its store
    partial: bool = False
    bytes_downloaded: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    engine: dict | None = None

    def to_json(self) -> dict:
        return {"format": HOST_FORMAT, "version": VERSION, "host": self.host, "hostname": self.hostname,
                "region": self.region, "url": self.url, "dest": self.dest, "run": self.run, "step": self.step,
                "step_since": self.step_since, "head": self.head, "partial": self.partial,
                "updated": self.updated, "started": self.started, "interval": self.interval,
                "instance": self.instance, "bytes_downloaded": self.bytes_downloaded,
                "failures": dict(self.failures), "last_error": self.last_error, "engine": self.engine}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "HostReport":
        """Strict parse; FleetError names `where` and the field."""
        if not isinstance(obj, dict):
            raise FleetError(f"{where}: not a JSON object")
        known = {"format", "version", "host", "hostname", "region", "url", "dest", "run", "step", "step_since",
                 "head", "partial", "updated", "started", "interval", "instance", "bytes_downloaded", "failures",
                 "last_error", "engine"}
        extra = set(obj) - known
        if extra:
            raise FleetError(f"{where}: unknown field(s) {sorted(str(k)[:40] for k in extra)[:5]}")
        if obj.get("format") != HOST_FORMAT or obj.get("version") != VERSION:
            raise FleetError(f"{where}: not a {HOST_FORMAT} version {VERSION} entry")
        host = obj.get("host")
        if not isinstance(host, str) or not HOST_ID.fullmatch(host):
            raise FleetError(f"{where}.host: must match {HOST_ID.pattern}, got {str(host)[:80]!r}")
        interval = _time(obj, "interval", where)
        if interval > MAX_INTERVAL:
            raise FleetError(f"{where}.interval: {interval:g}s is over {MAX_INTERVAL:g}s")
        failures = obj.get("failures")
        if (not isinstance(failures, dict) or len(failures) > 32
                or not all(isinstance(k, str) and _REASON.fullmatch(k) for k in failures)):
            raise FleetError(f"{where}.failures: an object of at most 32 reasons matching {_REASON.pattern}")
        for k in failures:
            _count(failures, k, f"{where}.failures")
        partial = obj.get("partial")
        if not isinstance(partial, bool):
            raise FleetError(f"{where}.partial: a boolean")
        return cls(host=host, hostname=_text(obj, "hostname", where, 255), url=_text(obj, "url", where, 2048),
                   updated=_time(obj, "updated", where), started=_time(obj, "started", where), interval=interval,
                   instance=_text(obj, "instance", where, 64), region=_text(obj, "region", where, 128, True),
                   dest=_text(obj, "dest", where, 4096, True), run=_text(obj, "run", where, 128, True),
                   step=_count(obj, "step", where, True), step_since=_time(obj, "step_since", where, True),
                   head=_count(obj, "head", where, True), partial=partial,
                   bytes_downloaded=_count(obj, "bytes_downloaded", where), failures=dict(failures),
                   last_error=_text(obj, "last_error", where, 1024, True), engine=_engine(obj.get("engine"), where))

    @classmethod
    def parse(cls, data: bytes, where: str) -> "HostReport":
        if len(data) > MAX_ENTRY_BYTES:
            raise FleetError(f"{where}: {len(data)} bytes, over the {MAX_ENTRY_BYTES} an entry may have")
        try:
            obj = load_json(data, where, MAX_ENTRY_BYTES)
        except ManifestError as exc:
            raise FleetError(str(exc)) from None
        return cls.from_json(obj, where)


def host_key(host: str) -> str:
    if not HOST_ID.fullmatch(host):
        raise ValueError(f"host id {host!r}: must match {HOST_ID.pattern} (letters, digits, '.', '_', '-')")
    return f"{HOSTS_PREFIX}{host}.json"


def region_key(name: str) -> str:
    """The origin key of a region's gathered entries; a name that is not a safe key gets a hashed one."""
    if HOST_ID.fullmatch(name):
        return f"{REGIONS_PREFIX}{name}.json"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:100] or "region"
    return f"{REGIONS_PREFIX}{safe}-{xxhash.xxh3_64_hexdigest(name.encode())[:8]}.json"


def default_host_id(dest: str | os.PathLike) -> str:
    """<hostname>-<8 hex of DEST's real path>: stable across restarts, distinct for two DESTs on one host."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-_")[:100] or "host"
    digest = xxhash.xxh3_64_hexdigest(os.path.realpath(os.fspath(dest)).encode())[:8]
    return f"{name}-{digest}"


# -- the host's side ------------------------------------------------------------------------------
class FleetReporter:
    """Writes a watcher's entry: after every sync (`Watcher` calls it) and every `interval` seconds from a
    heartbeat thread while the watcher runs. Never raises into the watcher: a failed write is logged
    (once per distinct error) and counted in `failures`; the next report tries again. Holds the watcher
    weakly: a Watcher dropped without close() is still freed at once, and with it DEST's lock."""

    def __init__(self, watcher: "Watcher", *, host: str | None = None, region: str | None = None,
                 interval: float = DEFAULT_INTERVAL) -> None:
        if not 0 < interval <= MAX_INTERVAL:
            raise ValueError(f"report interval must be in (0, {MAX_INTERVAL:g}] seconds, got {interval!r}")
        self._watcher = weakref.ref(watcher)
        self.dest = watcher.dest
        self.store = watcher.store
        self.host = host or default_host_id(watcher.dest)
        self.key = host_key(self.host)
        self.region = region
        self.interval = interval
        self.instance = uuid.uuid4().hex
        self.started = time.time()
        self.writes = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_report: HostReport | None = None
        self._etag: str | None = None
        self._etag_known = False
        self._step: int | None = None
        self._since: float | None = None
        self._lock = threading.Lock()  # one write at a time (the sync thread and the heartbeat)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _step_since(self, step: int | None) -> float | None:
        if step is None:
            self._step = self._since = None
        elif step != self._step:
            first = self._step is None and self._since is None
            self._step, self._since = step, time.time()
            if first:  # held from disk at start-up: when DEST's current version was swapped in
                try:
                    self._since = os.lstat(self.dest / ".current").st_mtime
                except OSError:
                    pass
        return self._since

    def snapshot(self) -> HostReport:
        """The entry as of now (from the watcher's state)."""
        w = self._watcher()
        if w is None:
            raise RuntimeError(f"{self.dest}: the watcher is gone")
        failures = {k: v for k, v in w.failure_counts().items() if v}
        if self.failures:
            failures["ledger"] = self.failures
        engine = None
        try:
            engine = w._engine_state()
            engine = None if engine is None else _engine(_flat(json.loads(json.dumps(engine, default=str))), "engine")
        except Exception as exc:  # noqa: BLE001 - an engine's report must never stop the host's
            engine = {"error": f"{type(exc).__name__}: {exc}"[:256]}
        err = w.last_error
        return HostReport(host=self.host, hostname=socket.gethostname()[:255] or "?", url=w.url[:2048],
                          updated=time.time(), started=self.started, interval=self.interval,
                          instance=self.instance, region=self.region, dest=os.fspath(w.dest)[:4096], run=w.run_id,
                          step=w.step, step_since=self._step_since(w.step), head=w.reader.head_seen,
                          partial=w.reader.want is not None, bytes_downloaded=w.bytes_downloaded,
                          failures=failures, last_error=None if err is None else err[:1024], engine=engine)

    def report(self) -> bool:
        """Write the entry now; True if it landed."""
        with self._lock:
            try:
                report = self.snapshot()
                self._write(report.to_bytes())
            except Exception as exc:  # noqa: BLE001 - advisory: the watcher carries on whatever the ledger does
                self.failures += 1
                text = f"{type(exc).__name__}: {exc}"
                if text != self.last_error:
                    log.warning("%s/%s: cannot write the fleet ledger (%s); syncing is not affected",
                                self.store.url, self.key, text)
                self.last_error = text
                return False
            self.writes += 1
            self.last_error = None
            self.last_report = report
            return True

    def _write(self, data: bytes) -> None:
        store = self.store
        for _ in range(3):
            if not self._etag_known:
                got = store.read_object(self.key)
                self._etag = None if got is None else got.etag
                self._etag_known = True
                if got is not None:
                    self._warn_if_shared(got)
            try:
                self._etag = store.commit_object(self.key, data, self._etag)
                return
            except ConflictError:
                self._etag_known = False  # someone else wrote it: read it again
        raise ConflictError(f"{store.url}/{self.key}: replaced by another writer at every try")

    def _warn_if_shared(self, got: ManifestRead) -> None:
        try:
            other = HostReport.parse(got.data, f"{self.store.url}/{self.key}")
        except FleetError:
            return
        if other.instance == self.instance or time.time() - other.updated >= 2 * other.interval:
            return
        if (other.hostname == socket.gethostname()[:255]
                and other.dest is not None and os.path.realpath(other.dest) == os.path.realpath(self.dest)):
            return  # this DEST's previous watcher: gone, since this one holds DEST's lock (one watcher per DEST)
        log.warning("%s/%s: another live watcher (on %s, %s) reports under host id %s; give each its own "
                    "--host", self.store.url, self.key, other.hostname, other.dest, self.host)

    def poke(self) -> None:
        """Report soon: from the heartbeat thread if it runs, else now in the caller's thread, unless nothing
        but the time changed since the last report and its heartbeat is not due (a sync at the head)."""
        if self._thread is not None and self._thread.is_alive():
            self._wake.set()
            return
        last = self.last_report
        if last is not None and self.last_error is None and time.time() - last.updated < self.interval:
            try:
                if replace(self.snapshot(), updated=last.updated) == last:
                    return
            except Exception:  # noqa: BLE001 - report() says what is wrong
                pass
        self.report()

    def start(self) -> None:
        """Heartbeat thread: a report every `interval` seconds, or sooner when poked."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"deltarelay-ledger-{self.host}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.report()
            self._wake.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30)


# -- readers --------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One host as found: its report, or why it was reported bad. `region`: the one the host was given (watch
    --region), else where it was found; `gathered`: the relay's name of the region document it came in."""

    region: str
    where: str
    report: HostReport | None = None
    error: str | None = None
    via: float | None = None  # gathered by a relay: that gathering's interval (adds to the TTL)
    gathered: str | None = None


@dataclass
class Fleet:
    """Every entry found, and the problems met while looking (unreadable stores, bad aggregates)."""

    entries: list[Entry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    regions: dict[str, dict] = field(default_factory=dict)  # gathered regions: name -> {updated, url, ...}


@dataclass
class FleetCache:
    """What a repeated reader (wait_for_fleet) read before, by ETag: an unchanged host entry or region document
    is not downloaded or parsed again, nor is a refused one (a region document may have 64 MiB)."""

    hosts: dict[str, dict[str, tuple[str, bytes]]] = field(default_factory=dict)  # store URL -> _read_hosts' etags
    regions: dict[str, tuple[str, Fleet]] = field(default_factory=dict)  # document URL -> (ETag, what it gave)


def _read_hosts(store: Store, label: str | None, fleet: Fleet, etags: dict[str, tuple[str, bytes]] | None = None
                ) -> list[tuple[str, bytes]]:
    """(key, bytes) of every host entry under `store`'s HOSTS_PREFIX (bounded), appending bad ones to
    `fleet`; `etags` (key -> (etag, bytes)) lets a repeated reader skip unchanged entries (conditional GET),
    and an entry it read before that cannot be read now (a throttled GET) counts by its last bytes. A store
    that cannot be listed raises (ListingFailed): what it holds is unknown, not empty."""
    try:
        listed = store.list(HOSTS_PREFIX)
    except Exception as exc:  # noqa: BLE001 - the caller says what an unlisted store means to it
        raise ListingFailed(f"{store.url}/{HOSTS_PREFIX}: cannot list ({type(exc).__name__}: {exc})") from None
    keys = sorted(k for k in listed if k.endswith(".json") and not k.rsplit("/", 1)[-1].startswith("."))
    if len(keys) > MAX_HOSTS:
        fleet.problems.append(f"{store.url}/{HOSTS_PREFIX}: {len(keys)} entries, reading the first {MAX_HOSTS}")
        keys = keys[:MAX_HOSTS]
    def read(key: str) -> Any:
        old = None if etags is None else etags.get(key)
        try:
            return store.read_object(key, old[0] if old else None)
        except Exception as exc:  # noqa: BLE001 - reported with the entry
            return exc

    small = [k for k in keys if listed[k] <= MAX_ENTRY_BYTES]
    with ThreadPoolExecutor(max(1, min(READ_THREADS, len(small)))) as pool:
        answers = dict(zip(small, pool.map(read, small)))
    out = []
    for key in keys:
        where = f"{store.url}/{key}"
        if key not in answers:
            fleet.entries.append(Entry(label or store.url, where, error=f"{listed[key]} bytes, over the "
                                                                          f"{MAX_ENTRY_BYTES} an entry may have"))
            continue
        got = answers[key]
        old = None if etags is None else etags.get(key)
        if isinstance(got, Exception):
            if old is not None:  # read before: it still says what it said (it ages out by its own time)
                fleet.problems.append(f"{where}: unreadable now ({type(got).__name__}: {got}); its last "
                                      f"report counts")
                out.append((key, old[1]))
                continue
            fleet.entries.append(Entry(label or store.url, where, error=f"unreadable ({type(got).__name__}: {got})"))
            continue
        if got is None:
            continue  # removed since the listing
        if got is NOT_MODIFIED and old is not None:
            data = old[1]
        elif isinstance(got, ManifestRead) and len(got.data) > MAX_ENTRY_BYTES:  # replaced since it was listed
            if etags is not None:
                etags.pop(key, None)  # neither kept (up to 64 MiB an entry) nor counted by what it said before
            fleet.entries.append(Entry(label or store.url, where, error=f"{len(got.data)} bytes, over the "
                                                                          f"{MAX_ENTRY_BYTES} an entry may have"))
            continue
        elif isinstance(got, ManifestRead):
            data = got.data
            if etags is not None:
                etags[key] = (got.etag, data)
        else:
            continue
        out.append((key, data))
    if etags is not None:
        for key in set(etags) - set(keys):
            del etags[key]
    return out


def _host_entry(data: bytes | Any, key: str, where: str, label: str | None, fallback: str,
                via: float | None = None) -> Entry:
    """The entry of one host object; region: the host's own (its --region), else `label` (the relay's name for
    the region, a bucket when it was given only URLs), else `fallback` (the store's URL)."""
    try:
        report = HostReport.parse(bytes(data), where) if isinstance(data, (bytes, bytearray)) else \
            HostReport.from_json(data, where)
    except FleetError as exc:
        return Entry(label or fallback, where, error=str(exc), via=via)
    if key != host_key(report.host):
        return Entry(label or fallback, where, error=f"names host {report.host!r}, but is stored as {key}", via=via)
    return Entry(report.region or label or fallback, where, report=report, via=via,
                 gathered=label if via is not None else None)


def read_store(store: Store, fleet: Fleet | None = None, *, label: str | None = None,
               cache: FleetCache | None = None) -> Fleet:
    """Add to `fleet` the host entries `store` holds directly (labelled by `label`, else the host's region,
    else the store URL) and the regions a relay gathered there (labelled by region). Never raises for
    what the store holds: bad entries and unreadable objects are reported in the result. With `cache`,
    what is unchanged since the last call is taken from it (conditional reads)."""
    fleet = Fleet() if fleet is None else fleet
    etags = None if cache is None else cache.hosts.setdefault(store.url, {})
    try:
        for key, data in _read_hosts(store, label, fleet, etags):
            fleet.entries.append(_host_entry(data, key, f"{store.url}/{key}", label, store.url))
    except ListingFailed as exc:  # one unreadable store must not hide the others
        fleet.problems.append(str(exc))
    try:
        regions = store.list(REGIONS_PREFIX)
    except Exception as exc:  # noqa: BLE001 - reported
        fleet.problems.append(f"{store.url}/{REGIONS_PREFIX}: cannot list ({type(exc).__name__}: {exc})")
        return fleet
    keys = sorted(k for k in regions if k.endswith(".json") and not k.rsplit("/", 1)[-1].startswith("."))
    if cache is not None:
        for gone in [w for w in cache.regions if w.startswith(store.url + "/") and w[len(store.url) + 1:] not in keys]:
            del cache.regions[gone]
    for key in keys:
        where = f"{store.url}/{key}"
        old = None if cache is None else cache.regions.get(where)
        try:
            if regions[key] > MAX_REGION_BYTES:
                raise FleetError(f"{regions[key]} bytes, over the {MAX_REGION_BYTES} a region may have")
            got = store.read_object(key, None if old is None else old[0])
        except Exception as exc:  # noqa: BLE001 - a bad aggregate is reported, the rest is read
            fleet.problems.append(f"{where}: {exc}")
            continue
        if got is None:
            continue
        if got is NOT_MODIFIED and old is not None:
            part = old[1]
        elif isinstance(got, ManifestRead):
            part = Fleet()
            try:
                _read_region(got.data, key, where, part)
            except Exception as exc:  # noqa: BLE001 - reported, and remembered with its ETag like a good one
                part = Fleet(problems=[f"{where}: {exc}"])
            if cache is not None:
                cache.regions[where] = (got.etag, part)
        else:
            continue
        fleet.entries += part.entries
        fleet.regions.update(part.regions)
        fleet.problems += part.problems
    return fleet


def _read_region(data: bytes, key: str, where: str, fleet: Fleet) -> None:
    try:
        doc = load_json(data, key, MAX_REGION_BYTES)
    except ManifestError as exc:
        raise FleetError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != REGION_FORMAT or doc.get("version") != VERSION:
        raise FleetError(f"not a {REGION_FORMAT} version {VERSION} document")
    extra = set(doc) - {"format", "version", "region", "url", "updated", "interval", "hosts", "bad", "truncated"}
    if extra:
        raise FleetError(f"unknown field(s) {sorted(str(k)[:40] for k in extra)[:5]}")
    name = _text(doc, "region", where, 2048)
    if region_key(name) != key:
        raise FleetError(f"names region {name[:80]!r}, which is stored as {region_key(name)}")
    updated = _time(doc, "updated", where)
    interval = _time(doc, "interval", where)
    if interval > MAX_INTERVAL:
        raise FleetError(f"interval: {interval:g}s is over {MAX_INTERVAL:g}s")
    if not isinstance(doc.get("url"), str) or not isinstance(doc.get("truncated"), bool):
        raise FleetError("url (a string) and truncated (a boolean) are required")
    hosts, bad = doc.get("hosts"), doc.get("bad")
    if not isinstance(hosts, list) or not isinstance(bad, list) or len(hosts) + len(bad) > MAX_HOSTS:
        raise FleetError(f"hosts and bad: lists of at most {MAX_HOSTS} entries in all")
    fleet.regions[name] = {"url": doc["url"], "updated": updated, "interval": interval, "truncated": doc["truncated"]}
    for i, h in enumerate(hosts):
        host = h.get("host") if isinstance(h, dict) else None
        k = host_key(host) if isinstance(host, str) and HOST_ID.fullmatch(host) else f"{HOSTS_PREFIX}?"
        fleet.entries.append(_host_entry(h, k, f"{where}: hosts[{i}]", name, name, via=interval))
    for i, b in enumerate(bad):
        text = b.get("error") if isinstance(b, dict) else None
        at = b.get("where") if isinstance(b, dict) else None
        fleet.entries.append(Entry(name, f"{where}: bad[{i}] ({str(at)[:200]})",
                                   error=str(text)[:1024] if text else "reported bad by the relay", via=interval))


def read_fleet(stores: Iterable[Store], cache: FleetCache | None = None) -> Fleet:
    """Every entry the stores hold (directly, and gathered by relays); one host seen twice (in a regional
    store read directly and in the relay's gathering) counts once, by its newest report. `cache`: kept
    between calls by a repeated reader, so that only what changed is downloaded and parsed."""
    fleet = Fleet()
    for store in stores:
        read_store(store, fleet, cache=cache)
    newest: dict[str, Entry] = {}
    rest = []
    for e in fleet.entries:
        if e.report is None:
            rest.append(e)
            continue
        seen = newest.get(e.report.host)
        if seen is None or (seen.report is not None and e.report.updated > seen.report.updated):
            newest[e.report.host] = e
    fleet.entries = [*newest.values(), *rest]
    return fleet


# -- judging entries --------------------------------------------------------------------------------
def entry_ttl(e: Entry, ttl: float | None) -> float:
    """Seconds without a report after which a host is stale: `ttl`, or 3 heartbeats + the relay's gathering
    interval + 10 s of clock skew."""
    if ttl is not None:
        return ttl
    interval = e.report.interval if e.report is not None else DEFAULT_INTERVAL
    return 3 * interval + (e.via or 0.0) + 10.0


def judge(e: Entry, *, head: int | None, run: str | None, now: float, ttl: float | None) -> dict:
    """A row for status: host, region, step, lag, age of its report, and its state: "ok" (at the head),
    "behind", "other-run", "stale" (no report within the TTL) or "bad" (malformed or absurd)."""
    r = e.report
    if r is None:
        return {"host": None, "region": e.region, "state": "bad", "where": e.where, "error": e.error}
    age = now - r.updated
    row: dict[str, Any] = {"host": r.host, "region": e.region, "hostname": r.hostname, "run": r.run, "step": r.step,
                           "step_since": r.step_since, "head_seen": r.head, "age_s": round(max(age, 0.0), 3),
                           "lag_steps": None, "failures": r.failures, "last_error": r.last_error,
                           "engine": r.engine, "partial": r.partial, "where": e.where}
    if age < -MAX_SKEW or (r.step_since is not None and r.step_since > r.updated + MAX_SKEW):
        row.update(state="bad", error=f"reported {-age:.0f}s in the future (the host's clock, or a forgery)")
        return row
    if head is not None and r.step is not None and (run is None or r.run == run):
        row["lag_steps"] = max(head - r.step, 0)
    if age > entry_ttl(e, ttl):
        row["state"] = "stale"
    elif run is not None and r.run is not None and r.run != run:
        row["state"] = "other-run"
    elif head is not None and (r.step is None or r.step < head or r.run is None):
        row["state"] = "behind"
    else:
        row["state"] = "ok"
    return row


def summarize(fleet: Fleet, *, head: int | None, run: str | None, now: float | None = None,
              ttl: float | None = None) -> dict:
    """Per region: hosts by state, how many live hosts hold each step, the largest lag and the oldest live
    report; plus every host's row. What `deltarelay status --fleet --json` prints."""
    now = time.time() if now is None else now
    rows = [judge(e, head=head, run=run, now=now, ttl=ttl) for e in fleet.entries]
    regions: dict[str, dict] = {}
    for row in rows:
        reg = regions.setdefault(row["region"], {"hosts": 0, "ok": 0, "behind": 0, "other-run": 0, "stale": 0,
                                                 "bad": 0, "steps": {}, "max_lag_steps": None,
                                                 "oldest_report_s": None})
        reg["hosts"] += 1
        reg[row["state"]] += 1
        if row["state"] in ("ok", "behind", "other-run"):
            if row["step"] is not None and row["state"] != "other-run":
                key = str(row["step"])
                reg["steps"][key] = reg["steps"].get(key, 0) + 1
            if row["lag_steps"] is not None:
                reg["max_lag_steps"] = max(reg["max_lag_steps"] or 0, row["lag_steps"])
            reg["oldest_report_s"] = max(reg["oldest_report_s"] or 0.0, row["age_s"])
    for name, info in fleet.regions.items():  # on the regions its hosts named, else on the relay's name for it
        for target in {row["region"] for e, row in zip(fleet.entries, rows) if e.gathered == name} or {name}:
            reg = regions.setdefault(target, {"hosts": 0, "ok": 0, "behind": 0, "other-run": 0, "stale": 0, "bad": 0,
                                              "steps": {}, "max_lag_steps": None, "oldest_report_s": None})
            reg["gathered_age_s"] = round(max(now - info["updated"], 0.0), 3)
            reg["gathered_from"] = info["url"]
    for reg in regions.values():
        reg["steps"] = dict(sorted(reg["steps"].items(), key=lambda kv: -int(kv[0])))
    return {"head": head, "run": run, "time": now, "regions": dict(sorted(regions.items())), "hosts": rows,
            "problems": list(fleet.problems)}


@dataclass
class FleetProgress:
    """Where the fleet stands against a step: live hosts, those holding it, those lagging (rows), stale, bad."""

    step: int
    fraction: float
    live: int
    holding: int
    lagging: list[dict]
    stale: int
    bad: int

    @property
    def reached(self) -> float:
        return self.holding / self.live if self.live else 0.0


def fleet_progress(fleet: Fleet, step: int, fraction: float, *, run: str | None, now: float | None = None,
                   ttl: float | None = None) -> FleetProgress:
    """How many live hosts (reported within the TTL, of any run) hold `step` or later of `run`."""
    now = time.time() if now is None else now
    rows = [judge(e, head=step, run=run, now=now, ttl=ttl) for e in fleet.entries]
    live = [r for r in rows if r["state"] in ("ok", "behind", "other-run")]
    holding = [r for r in live if r["state"] == "ok"]
    lagging = sorted((r for r in live if r["state"] != "ok"), key=lambda r: (r["step"] is not None, r["step"] or 0))
    return FleetProgress(step, fraction, len(live), len(holding), lagging,
                         sum(r["state"] == "stale" for r in rows), sum(r["state"] == "bad" for r in rows))


def wait_for_fleet(stores: Iterable[Store], step: int, fraction: float = 1.0, timeout: float = 600.0, *,
                   run: str | None = None, ttl: float | None = None, poll_interval: float = 2.0,
                   min_hosts: int = 1) -> FleetProgress:
    """Block until at least `fraction` of the live hosts (and at least `min_hosts`) report holding `step`
    (or later) of `run`; returns the progress then. FleetTimeout after `timeout` seconds, naming the hosts
    that lag. Stale hosts (no report within the TTL: dead, or cut off) count neither way."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if min_hosts < 1:
        raise ValueError("min_hosts must be >= 1")
    stores = list(stores)
    deadline = time.monotonic() + timeout
    cache = FleetCache()  # every poll reads only what changed (a region document may have 64 MiB)
    while True:
        progress = fleet_progress(read_fleet(stores, cache), step, fraction, run=run, ttl=ttl)
        if progress.live >= min_hosts and progress.holding >= fraction * progress.live - 1e-9:
            return progress
        if time.monotonic() >= deadline:
            lag = ", ".join(f"{r['host']} ({r['region']}: {_held(r)}, reported {r['age_s']:.0f}s ago)"
                            for r in progress.lagging[:20])
            more = f" and {len(progress.lagging) - 20} more" if len(progress.lagging) > 20 else ""
            raise FleetTimeout(
                f"{', '.join(s.url for s in stores)}: after {timeout:g}s {progress.holding} of {progress.live} live "
                f"host(s) hold step {step} (need {fraction:.0%}{f', at least {min_hosts}' if min_hosts > 1 else ''})"
                f"; lagging: {lag or 'none'}{more}; {progress.stale} stale, {progress.bad} bad entr"
                f"{'y' if progress.bad == 1 else 'ies'}", progress)
        time.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))


def _held(row: dict) -> str:
    if row["state"] == "other-run":
        return f"step {row['step']} of another run {row['run']}"
    return "no step" if row["step"] is None else f"step {row['step']}"


# -- the relay's side -------------------------------------------------------------------------------
class ListingFailed(OSError):
    """A store's fleet/hosts/ could not be listed: what it holds is unknown (not: it holds nobody)."""


def _fit(hosts: list[dict], bad: list[dict], budget: int) -> tuple[list[dict], int]:
    """The newest hosts whose JSON, with `bad`'s, fits in `budget` bytes, and how many entries were cut (bad
    ones beyond a quarter of the budget, in place): a region's document over its readers' cap would be
    refused whole, live hosts included."""
    def size(obj: Any) -> int:
        return len(json.dumps(obj, sort_keys=True, allow_nan=False)) + 2

    left, cut = budget, 0
    for i, b in enumerate(bad):
        n = size(b)
        if n > left - 3 * budget // 4:
            cut = len(bad) - i
            del bad[i:]
            break
        left -= n
    kept = []
    for h in sorted(hosts, key=lambda h: -float(h.get("updated") or 0.0)):
        n = size(h)
        if n > left:
            break
        left -= n
        kept.append(h)
    return kept, cut + len(hosts) - len(kept)


class RegionGatherer:
    """Copies each region's host entries into the origin store as `fleet/regions/<region>.json`, every
    `interval` seconds, on its own thread (a slow region delays only the gathering, never the copies).
    Entries are re-validated and bad ones carried as such; unchanged entries cost a conditional GET."""

    def __init__(self, origin: Store, regions: dict[str, Store], interval: float = DEFAULT_AGGREGATE_INTERVAL
                 ) -> None:
        if not 0 < interval <= MAX_INTERVAL:
            raise ValueError(f"fleet interval must be in (0, {MAX_INTERVAL:g}] seconds")
        self.origin = origin
        self.regions = regions
        self.interval = interval
        self.state: dict[str, dict] = {name: {"hosts": 0, "bad": 0, "writes": 0, "errors": 0, "last_error": None,
                                               "updated": None} for name in regions}
        self._etags: dict[str, str | None] = {}
        self._cache: dict[str, dict[str, tuple[str, bytes]]] = {name: {} for name in regions}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def gather(self, name: str) -> None:
        """One region, now: read its entries, write its document to the origin (compare-and-swap). A region
        that cannot be listed keeps its previous document (its hosts age out by their own reports, never
        vanish at once); entries not updated for GATHER_HORIZON are left out, and the document is kept
        under MAX_REGION_BYTES (the oldest hosts go first), with `truncated` set when anything was left out."""
        store = self.regions[name]
        fleet = Fleet()
        hosts, bad = [], []
        now = time.time()
        old_entries = 0
        for key, data in _read_hosts(store, name, fleet, self._cache[name]):  # ListingFailed: nothing written
            e = _host_entry(data, key, f"{store.url}/{key}", name, name)
            if e.report is not None and now - e.report.updated > GATHER_HORIZON:
                old_entries += 1  # a host gone for hours (pods come and go; nothing removes their entries)
            elif e.report is not None:
                hosts.append(e.report.to_json())
            else:
                bad.append({"where": e.where, "error": e.error})
        bad += [{"where": e.where, "error": e.error} for e in fleet.entries]
        hosts, cut = _fit(hosts, bad, MAX_REGION_BYTES - (64 << 10))
        if old_entries or cut:
            log.info("%s: gathered %d host entries, left out %d not updated for %.0f h and %d over the %d-byte "
                     "document cap", name, len(hosts), old_entries, GATHER_HORIZON / 3600, cut, MAX_REGION_BYTES)
        doc = {"format": REGION_FORMAT, "version": VERSION, "region": name, "url": store.url, "updated": now,
               "interval": self.interval, "hosts": hosts, "bad": bad, "truncated": bool(fleet.problems or cut)}
        data = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
        key = region_key(name)
        for _ in range(3):
            if key not in self._etags:
                got = self.origin.read_object(key)
                self._etags[key] = None if got is None else got.etag
            try:
                self._etags[key] = self.origin.commit_object(key, data, self._etags[key])
                break
            except ConflictError:
                del self._etags[key]  # another relay gathers this region too: take its version as the base
        else:
            raise ConflictError(f"{self.origin.url}/{key}: replaced by another writer at every try")
        with self._lock:
            st = self.state[name]
            st.update(hosts=len(hosts), bad=len(bad), updated=doc["updated"], last_error=None)
            st["writes"] += 1
            if fleet.problems:
                st["last_error"] = "; ".join(fleet.problems)[:1024]
        if fleet.problems:
            raise OSError("; ".join(fleet.problems))

    def gather_all(self) -> None:
        for name in self.regions:
            if self._stop.is_set():
                return
            try:
                self.gather(name)
            except Exception as exc:  # noqa: BLE001 - advisory: the relay's copies go on
                text = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    st = self.state[name]
                    if text != st["last_error"]:
                        log.warning("%s: cannot gather the fleet ledger (%s); copies are not affected", name, text)
                    st["errors"] += 1
                    st["last_error"] = text

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="deltarelay-fleet-gather", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.gather_all()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop after the region being gathered (a pass in progress finishes that region)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=60)

    def status(self) -> dict:
        with self._lock:
            return {name: dict(st) for name, st in self.state.items()}


__all__ = ["HostReport", "FleetReporter", "FleetError", "FleetTimeout", "FleetProgress", "Fleet", "Entry",
           "RegionGatherer", "FleetCache", "read_store", "read_fleet", "summarize", "fleet_progress", "wait_for_fleet",
           "judge", "host_key", "region_key", "default_host_id", "HOSTS_PREFIX", "REGIONS_PREFIX"]
