"""A region's own snapshots and their announcement, `regional/snapshots.json` (docs/PROTOCOL.md §8.1).

Why: full snapshots are most of the bytes that cross a region boundary. A region's materialiser
(relay/regional.py) builds snapshots from the chain the region already holds and writes them under
`regional/snapshots/<step>/`; this module is the one object that tells the region's readers about
them. The announcement is mutable (compare-and-swap, Store.commit_object) and unsigned: it only
points at candidates. A reader accepts a regional snapshot only if its tensors match the trainer's
record of that step (per-tensor xxh3, and BLAKE3 in signed runs), so forging the announcement or
the files costs a refused download, never wrong weights.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

from relay.manifest import (INDEX_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError, ObjRef, Snapshot, _hex32,
                            load_json, _need, _only, _step_int, safe_file_name)
from relay.store import ConflictError, ObjectMissing, Store

log = logging.getLogger(__name__)

ANNOUNCE_KEY = "regional/snapshots.json"
REGIONAL_PREFIX = "regional/snapshots/"
ANNOUNCE_FORMAT = "deltarelay.regional-snapshots"
ANNOUNCE_VERSION = 1
MAX_REGIONAL_SNAPSHOTS = 1000
_COMMIT_TRIES = 20


def regional_prefix(step: int) -> str:
    """Where the region's snapshot of `step` lives: regional/snapshots/<step>/."""
    return f"{REGIONAL_PREFIX}{step}/"


def is_regional(snap: Snapshot) -> bool:
    """Whether a snapshot is a region's own (announced), not one the trainer's manifest names."""
    return snap.index.key.startswith(REGIONAL_PREFIX)


_REGIONAL_KEY = re.compile(r"regional/snapshots/(\d{1,20})/(.+)")


def _ref(obj: Any, where: str, step: int) -> ObjRef:
    """A REF (key, size, xxh3, optional sha256) whose key is regional/snapshots/<step>/<one safe name>."""
    def ok(key: str) -> bool:
        m = _REGIONAL_KEY.fullmatch(key)
        return m is not None and int(m.group(1)) == step and safe_file_name(m.group(2))

    return ObjRef.parse(obj, where, key_rule=(ok, f"regional/snapshots/{step}/<name>"))


def _snapshot(obj: Any, where: str) -> Snapshot:
    _only(obj, {"step", "index", "files"}, where)
    step = _step_int(_need(obj, "step", int, where), f"{where}.step")
    index = _ref(_need(obj, "index", dict, where), f"{where}.index", step)
    if index.key != regional_prefix(step) + INDEX_NAME:
        raise ManifestError(f"{where}.index.key: {index.key!r}, expected {regional_prefix(step) + INDEX_NAME!r}")
    raw = _need(obj, "files", list, where)
    if not raw:
        raise ManifestError(f"{where}.files: empty")
    files = tuple(_ref(f, f"{where}.files[{i}]", step) for i, f in enumerate(raw))
    keys = [f.key for f in files]
    if len(set(keys)) != len(keys) or index.key in keys or not all(k.endswith(".safetensors") for k in keys):
        raise ManifestError(f"{where}.files: distinct .safetensors files other than the index")
    return Snapshot(step, index, files)


@dataclass(frozen=True)
class Announcement:
    """What `regional/snapshots.json` says: the run its snapshots belong to and the regional snapshots,
    ascending by step. It adds candidates and never takes any away: readers plan from these and from every
    trainer's snapshot the region holds (PROTOCOL §8.1), whoever wrote either."""

    run: str
    snapshots: tuple[Snapshot, ...] = ()

    def snapshot(self, step: int) -> Snapshot | None:
        return next((s for s in self.snapshots if s.step == step), None)

    def to_bytes(self) -> bytes:
        # "origin_snapshots": always true, for earlier readers that require the field (false made them ignore
        # the trainer's snapshots a region holds); this reader ignores it
        doc = {"format": ANNOUNCE_FORMAT, "version": ANNOUNCE_VERSION, "run": self.run,
               "origin_snapshots": True, "snapshots": [s.to_json() for s in self.snapshots]}
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str = ANNOUNCE_KEY) -> "Announcement":
        doc = load_json(data, where, MAX_MANIFEST_BYTES)
        _only(doc, {"format", "version", "run", "origin_snapshots", "snapshots"}, where)
        if doc.get("format") != ANNOUNCE_FORMAT:
            raise ManifestError(f"{where}: format is {str(doc.get('format'))[:80]!r}, expected {ANNOUNCE_FORMAT!r}")
        version = _need(doc, "version", int, where)
        if version != ANNOUNCE_VERSION:
            raise ManifestError(f"{where}: version {version} is not supported by this reader "
                                f"(knows {ANNOUNCE_VERSION})")
        run = _hex32(_need(doc, "run", str, where), f"{where}.run", "a run id")
        if "origin_snapshots" in doc:  # legacy, ignored: no object decides which held snapshots readers use
            _need(doc, "origin_snapshots", bool, where)
        raw = _need(doc, "snapshots", list, where)
        if len(raw) > MAX_REGIONAL_SNAPSHOTS:
            raise ManifestError(f"{where}.snapshots: {len(raw)} entries, at most {MAX_REGIONAL_SNAPSHOTS}")
        snaps = tuple(_snapshot(s, f"{where}.snapshots[{i}]") for i, s in enumerate(raw))
        steps = [s.step for s in snaps]
        if steps != sorted(set(steps)):
            raise ManifestError(f"{where}.snapshots: steps must strictly increase, got {steps[:10]}")
        return cls(run, snaps)


def read_announcement(store: Store) -> tuple[Announcement | None, str | None]:
    """The region's announcement and its ETag; (None, etag) when it is absent (etag None) or unreadable
    (logged: readers then plan as if there were none, and the next materialiser commit replaces it)."""
    got = store.read_object(ANNOUNCE_KEY)
    if got is None:
        return None, None
    try:
        return Announcement.parse(got.data, f"{store.url}/{ANNOUNCE_KEY}"), got.etag
    except ManifestError as exc:
        log.error("%s/%s: unreadable, ignored (%s)", store.url, ANNOUNCE_KEY, exc)
        return None, got.etag


def update_announcement(store: Store, change: Callable[[Announcement | None], Announcement | None]
                        ) -> Announcement | None:
    """Compare-and-swap `change` onto the region's announcement (None: absent or unreadable), retried when
    another writer commits in between; `change` returning None writes nothing. Returns what is stored."""
    for _ in range(_COMMIT_TRIES):
        current, etag = read_announcement(store)
        new = change(current)
        if new is None:
            return current
        try:
            store.commit_object(ANNOUNCE_KEY, new.to_bytes(), etag)
        except ConflictError:
            continue
        return new
    raise ConflictError(f"{store.url}/{ANNOUNCE_KEY}: {_COMMIT_TRIES} conflicting commits in a row")


def collect(store: Store, keep: int, *, dry_run: bool = False) -> dict:
    """Regional gc: keep the newest `keep` announced snapshots (dropped from the announcement first, by
    compare-and-swap), then delete every regional/snapshots/ object that no announced snapshot names, except
    at steps above the newest announced one (a snapshot being written). Entries past the head of the region's
    manifest (or of another run) count for neither: they stay announced, take no place among the `keep`, and
    do not raise that line (a forged far-future entry would otherwise push out every real snapshot). Without
    a readable announcement nothing is deleted. Returns what was done (`dry_run`: would be done, changing
    nothing), with the keys deleted and their sizes under "regional_doomed"."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    head = region_head(store)

    def credible(cur: Announcement) -> list[Snapshot]:
        # an entry past the region's head is nobody's snapshot yet (in flight, or a bucket writer's): it
        # neither takes one of the `keep` places nor moves the line below which unnamed files are deleted
        return [s for s in cur.snapshots if head is None or (cur.run == head[1] and s.step <= head[0])]

    def trim(cur: Announcement | None) -> Announcement | None:
        if cur is None or len(credible(cur)) <= keep:
            return None
        kept = credible(cur)[-keep:]
        return Announcement(cur.run, tuple(s for s in cur.snapshots if s in kept or s not in credible(cur)))

    if dry_run:
        cur = read_announcement(store)[0]
        now = trim(cur) or cur
    else:
        now = update_announcement(store, trim)
    if now is None:
        return {"regional_snapshots": [], "regional_deleted": 0, "regional_freed_bytes": 0, "regional_doomed": {}}
    named = {r.key for s in now.snapshots for r in (s.index, *s.files)}
    newest = max((s.step for s in credible(now)), default=-1)
    listed = store.list(REGIONAL_PREFIX)
    doomed = sorted(k for k in listed if k not in named and (m := _REGIONAL_KEY.fullmatch(k)) is not None
                    and int(m.group(1)) <= newest)
    try:
        if not dry_run:
            store.delete(doomed)
    except ObjectMissing:  # another gc got there first
        pass
    return {"regional_snapshots": [s.step for s in now.snapshots], "regional_deleted": len(doomed),
            "regional_freed_bytes": sum(listed[k] for k in doomed), "regional_doomed": {k: listed[k] for k in doomed}}


def region_head(store: Store) -> tuple[int, str] | None:
    """(head, run) of the region's manifest now, None if it has none or it cannot be read: what bounds the
    steps an announcement may credibly name."""
    try:
        got = store.read_manifest()
        m = None if got is None else Manifest.parse(got.data, f"{store.url}/manifest.json")
    except Exception as exc:  # noqa: BLE001 - unknown: every announced entry counts, as before a manifest exists
        log.debug("%s: manifest unreadable (%s)", store.url, exc)
        return None
    return None if m is None else (m.head, m.run)


__all__ = ["ANNOUNCE_KEY", "REGIONAL_PREFIX", "Announcement", "regional_prefix", "is_regional", "read_announcement",
           "update_announcement", "collect", "region_head"]
