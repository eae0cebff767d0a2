"""`deltarelay verify`: the store's fsck (as restic's `check`).

A watcher only finds a damaged object when it needs it, typically when a host restarts or falls
behind, which is the worst moment. `verify` reads everything the manifest reaches and says what is
wrong before a reader does: every named object exists and matches its size, xxh3 and (signed runs)
SHA-256; records, snapshot indexes and delta headers parse and agree with the manifest; every step
can be reached; with trusted keys, the signature holds. `deep` also rebuilds every reachable step,
from its snapshot and through each delta, and checks it against the trainer's record.

It never writes to the store. Problems are collected, never raised, so one run lists all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

import codec
from relay import announce, checkpoint, shards
from relay.checkpoint import index_bytes_of
from relay.manifest import (INDEX_NAME, MAX_RECORD_BYTES, Manifest, ManifestError, ObjRef, Record, load_json,
                            mismatches, step_of_key)
from relay.signing import SignatureError, TrustedKeys
from relay.store import MANIFEST_KEY, ObjectMissing, Store, open_store

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What `verify` found. `problems` empty means the run is sound (as far as the checks asked go)."""

    url: str
    run: str | None = None
    head: int | None = None
    base: int | None = None
    steps: int = 0
    snapshots: int = 0
    objects_checked: int = 0
    bytes_checked: int = 0
    signed_by: list[str] = field(default_factory=list)
    signature: str = "not checked"
    deep: bool = False
    steps_rebuilt: int = 0
    unreferenced: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"ok": self.ok}

    def text(self) -> str:
        lines = [f"{self.url}: run {self.run}, head {self.head}, base {self.base}, {self.steps} steps, "
                 f"{self.snapshots} snapshots",
                 f"  objects: {self.objects_checked} checked ({self.bytes_checked} bytes)",
                 f"  signature: {self.signature}" + (f" (keys {', '.join(self.signed_by)})" if self.signed_by else "")]
        if self.deep:
            lines.append(f"  deep: {self.steps_rebuilt} of {self.steps} steps rebuilt and matched their records")
        if self.unreferenced:
            lines.append(f"  {self.unreferenced} objects the manifest does not name (gc removes those at or below "
                         f"the head; above it they may be an upload in progress)")
        lines += [f"  note: {n}" for n in self.notes]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("no problems found")
        return "\n".join(lines)


class _Checker:
    def __init__(self, store: Store, m: Manifest, report: Report, workers: int, trusting: bool = False) -> None:
        self.store, self.m, self.report, self.workers = store, m, report, workers
        self.trusting = trusting  # checked as a reader with trusted keys reads (regional snapshots need BLAKE3)
        self.bad: set[str] = set()  # keys missing or not matching their reference
        self.records: dict[int, Record] = {}
        self.regional_indexes: dict[int, bytes] = {}  # a region's own snapshots' indexes, checked against records
        self.indexes: dict[str, bytes] = {}  # every snapshot index the shallow check read, by key (deep maps files)
        self._lock = threading.Lock()

    def problem(self, text: str) -> None:
        with self._lock:
            self.report.problems.append(text)

    def fetch(self, ref: ObjRef) -> bytes | None:
        """The object if it exists and matches its reference; else None (and the problem is noted once)."""
        try:
            data = ref.read(self.store)
        except ObjectMissing:
            self._bad(ref.key, f"{ref.key}: missing")
            return None
        except Exception as exc:  # noqa: BLE001 - an unreadable object is a finding, not a crash
            self._bad(ref.key, f"{ref.key}: unreadable ({type(exc).__name__}: {exc})")
            return None
        with self._lock:
            self.report.objects_checked += 1
            self.report.bytes_checked += len(data)
        problem = ref.matches(data)
        if problem:
            self._bad(ref.key, f"{ref.key}: corrupt ({problem})")
            return None
        return data

    def check_streamed(self, ref: ObjRef) -> None:
        """`fetch` for an object nothing here parses (a snapshot file, up to gigabytes): hashed as it streams,
        never held whole, so a shallow check's memory is a chunk per worker whatever the shard size."""
        seen = [0]

        def counted() -> Any:
            for chunk in self.store.iter_chunks(ref.key):
                seen[0] += memoryview(chunk).nbytes
                yield chunk

        try:
            problem = ref.matches_chunks(counted())
        except ObjectMissing:
            self._bad(ref.key, f"{ref.key}: missing")
            return
        except Exception as exc:  # noqa: BLE001 - an unreadable object is a finding, not a crash
            self._bad(ref.key, f"{ref.key}: unreadable ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            self.report.objects_checked += 1
            self.report.bytes_checked += seen[0]
        if problem:
            self._bad(ref.key, f"{ref.key}: corrupt ({problem})")

    def _bad(self, key: str, text: str) -> None:
        with self._lock:
            if key not in self.bad:
                self.bad.add(key)
                self.report.problems.append(text)

    # -- shallow: every object, and what each says about the others ---------------------------------
    def check_object(self, ref: ObjRef) -> None:
        kind = ref.key.split("/")[0]
        if kind == "snapshots" and not ref.key.endswith("/" + INDEX_NAME):
            self.check_streamed(ref)  # a deep check parses it later, one file at a time
            return
        data = self.fetch(ref)
        if data is None:
            return
        if kind == "records":
            step = step_of_key(ref.key)
            try:
                rec = Record.parse(data, ref.key)
            except ManifestError as exc:
                self._bad(ref.key, f"{ref.key}: {exc}")
                return
            if rec.run != self.m.run or rec.step != step:
                self._bad(ref.key, f"{ref.key}: record of run {rec.run} step {rec.step}, the manifest lists it "
                                   f"for run {self.m.run} step {step}")
                return
            with self._lock:
                self.records[step] = rec
        elif kind == "deltas":
            try:
                codec.describe(data)
            except codec.DeltaError as exc:
                self._bad(ref.key, f"{ref.key}: not a valid delta payload ({exc})")
        elif ref.key.endswith("/" + INDEX_NAME):
            self._check_index(ref, data)

    def _check_index(self, ref: ObjRef, data: bytes) -> None:
        snap = next((s for s in self.m.snapshots if s.index == ref), None)
        if snap is None:  # an index in m.refs() is its snapshot's
            raise AssertionError(f"unreachable: {ref.key} is no snapshot's index")
        try:
            index = load_json(data, ref.key, MAX_RECORD_BYTES)
            weight_map = index["weight_map"]
            files = set(weight_map.values())
            sliced = (index.get("metadata") or {}).get(shards.SLICES_KEY, {})  # a sharded trainer's row slices
            files |= {item[2] for slices in sliced.values() for item in slices}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # ManifestError included
            self._bad(ref.key, f"{ref.key}: not a safetensors index ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            self.indexes[ref.key] = data
            if announce.is_regional(snap):
                self.regional_indexes[snap.step] = data
        listed = {f.key.rsplit("/", 1)[1] for f in snap.files}
        if files != listed:
            self.problem(f"{ref.key}: names shard files {sorted(files)[:5]}, the manifest lists {sorted(listed)[:5]}")

    def _oversized(self) -> set[str]:
        """Files of snapshots declaring more bytes than their record's tensors and a header each, reported and
        never downloaded: a reader refuses them so, before a byte (a region's announcement is unsigned, so a
        bucket writer may name a file of any size there)."""
        skip: set[str] = set()
        for snap in self.m.snapshots:
            rec = self.records.get(snap.step)
            if rec is None:
                continue
            budget = checkpoint.tensor_bytes(rec.tensors)
            declared = sum(f.size for f in snap.files)
            if declared > budget + len(snap.files) * checkpoint.MAX_HEADER_BYTES:
                what = "regional snapshot" if announce.is_regional(snap) else "snapshot"
                for f in snap.files:
                    self._bad(f.key, f"{what} {snap.step}: its files declare {declared} bytes, for {budget} bytes of "
                                     f"tensors in its record; not downloaded")
                    skip.add(f.key)
        return skip

    def _untrusted_regional(self) -> None:
        """With trusted keys: a region's own snapshot whose record lacks a BLAKE3 digest is refused by every reader
        that trusts keys (nobody vouches for its bytes but those digests), so it is no start for them."""
        for snap in self.m.snapshots:
            rec = self.records.get(snap.step)
            if rec is None or not announce.is_regional(snap):
                continue
            lacking = sorted(k for k, t in rec.tensors.items() if t.blake3 is None)
            if lacking:
                self.problem(f"regional snapshot {snap.step}: the record of step {snap.step} carries no BLAKE3 for "
                             f"tensors {lacking[:5]}, so readers with trusted keys refuse it")

    def shallow(self) -> None:
        refs = list({r.key: r for r in self.m.refs()}.values())
        records = [r for r in refs if r.key.startswith("records/")]
        with ThreadPoolExecutor(max(1, min(self.workers, len(refs)))) as pool:
            list(pool.map(self.check_object, records))  # first: they bound what the snapshots may be
            skip = self._oversized()
            skip.update(r.key for r in records)
            list(pool.map(self.check_object, [r for r in refs if r.key not in skip]))
        if self.trusting:
            self._untrusted_regional()
        for step, data in sorted(self.regional_indexes.items()):
            rec = self.records.get(step)
            if rec is not None and data != index_bytes_of(rec.tensors, rec.weight_map, step=step):
                self.problem(f"regional snapshot {step}: its index is not the one the record of step {step} implies")
        snaps = {s.step for s in self.m.snapshots}
        if not snaps:
            self.problem("no snapshot a reader of this store can start from (a region that keeps only its own "
                         "snapshots announces none that the manifest lists, with a chain to the head)")
        prev = None
        for s in self._steps():
            if s.parts is None and s.step not in snaps:
                self.problem(f"step {s.step}: unreachable (no delta from a parent and no snapshot)")
            elif s.parts is not None and prev is not None and s.parent != prev:
                # readers apply each listed step's delta to the step listed before it (PROTOCOL §6)
                self.problem(f"step {s.step}: its delta's parent is step {s.parent}, but the step listed before it "
                             f"is {prev}: no reader holding {prev} can apply it")
            prev = s.step
            for p in s.parts or ():
                if p.tensors is not None and s.step in self.records:
                    unknown = set(p.tensors) - set(self.records[s.step].tensors)
                    if unknown:
                        self.problem(f"{p.ref.key}: covers tensors the record does not have {sorted(unknown)[:5]}")

    def _steps(self) -> list:
        """The steps a reader of this store can reach: from the oldest snapshot on (a region that keeps only
        its own snapshots, §8.1, cannot reach the steps before its oldest one; a manifest never lists any)."""
        oldest = min((s.step for s in self.m.snapshots), default=None)
        return [s for s in self.m.steps if oldest is not None and s.step >= oldest]

    # -- deep: rebuild every step -------------------------------------------------------------------
    def _snapshot_state(self, snap: Any) -> dict[str, torch.Tensor] | None:
        """The snapshot's tensors, read one file at a time: each file's bytes go once its tensors are read."""
        step = snap.step
        if any(r.key in self.bad for r in (snap.index, *snap.files)):
            return None
        rec = self.records.get(step)
        infos = rec.tensors if rec is not None else {}
        mapped = self._index_map(snap)
        budget = shards.Budget.of(infos) if rec is not None else shards.Budget(0)
        read = []
        for ref in snap.files:
            data = self.fetch(ref)
            if data is None:
                return None
            if mapped is not None:
                self._check_file_map(snap, mapped, ref, data, budget.header)
            try:
                read.append(shards.read_bytes(ref, data, budget))
            except shards.ShardError as exc:
                for bad in exc.refs:
                    self._bad(bad.key, str(exc))
                return None
            del data
        try:  # row slices of a sharded trainer put together (their rows fit the record's shapes)
            return shards.assemble_read(read, infos)
        except shards.ShardError as exc:
            for ref in exc.refs:
                self._bad(ref.key, str(exc))
            return None

    def _index_map(self, snap: Any) -> dict[str, set[str]] | None:
        """The tensors the snapshot's index maps to each of its files; None if there is no readable index
        (missing or corrupt: the shallow check reported it)."""
        data = self.indexes.get(snap.index.key)
        if data is None:
            return None
        try:
            return shards.index_files(data, snap)
        except ManifestError as exc:
            self._bad(snap.index.key, str(exc))
            return None

    def _check_file_map(self, snap: Any, mapped: dict[str, set[str]], ref: ObjRef, blob: bytes,
                        bound: checkpoint.HeaderBound | None) -> None:
        """The file holds exactly the tensors the snapshot's index maps to it: a partial replica fetches only
        the files its tensors map to, so a wrong map starves it though every file is sound."""
        try:
            held = shards.file_names(blob, ref, bound)
        except shards.ShardError:
            return  # unreadable: read_bytes reports it
        want = mapped.get(ref.key, set())
        said = ([f"maps {sorted(want - held)[:5]} to {ref.key}, which lacks them"] if want - held else []) + \
            ([f"does not map {sorted(held - want)[:5]} to {ref.key}, which holds them"] if held - want else [])
        if said:
            self.problem(f"{snap.index.key}: " + "; ".join(said))

    def _matches_record(self, step: int, tensors: dict[str, torch.Tensor], what: str) -> bool:
        rec = self.records.get(step)
        if rec is None:
            return False  # record missing or bad: already a problem
        bad = mismatches(tensors, rec.tensors)
        if bad:
            self.problem(f"step {step}: {what} does not match the trainer's record (tensors {bad[:5]})")
            return False
        return True

    def deep(self) -> None:
        state: dict[str, torch.Tensor] | None = None
        prev: int | None = None
        unbuilt: list[int] = []
        for s in self._steps():
            carried = None
            if state is not None and s.parts is not None and s.parent == prev:
                if any(p.ref.key in self.bad for p in s.parts):
                    state = None
                else:
                    carried = self._apply(s, state)
            if carried is not None and not self._matches_record(s.step, carried, "the state rebuilt through its delta"):
                carried = None
            from_snapshot = None
            # every snapshot of the step: a region may hold the trainer's and its own, and a reader takes either
            for snap in (x for x in self.m.snapshots if x.step == s.step):
                what = f"the {'regional ' if announce.is_regional(snap) else ''}snapshot"
                got = self._snapshot_state(snap)
                if got is not None and self._matches_record(s.step, got, what) and from_snapshot is None:
                    from_snapshot = got
            state = carried if carried is not None else from_snapshot
            prev = s.step
            if state is None:
                unbuilt.append(s.step)
            else:
                self.report.steps_rebuilt += 1
        if unbuilt and not self.report.problems:  # nothing above explains it: a problem of its own
            self.problem(f"{len(unbuilt)} step(s) could not be rebuilt from any snapshot and chain: {_ranges(unbuilt)}")
        elif unbuilt:
            self.report.notes.append(f"{len(unbuilt)} step(s) could not be rebuilt because of the problems above: "
                                     f"{_ranges(unbuilt)}")

    def _apply(self, s: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The state of step s: `state` (its parent's, which deep() never reads again) moved in place, no copy
        of the model; None if a part is missing or does not apply (`state` is then partly moved: dropped)."""
        tensors = state
        covered: set[str] = set()
        try:
            shards.check_tiling(s.step, s.parts, tensors)
        except shards.ShardError as exc:
            self.problem(str(exc))
            return None
        for part in s.parts:
            data = self.fetch(part.ref)
            if data is None:
                return None
            target = shards.part_targets(part, tensors)
            try:
                codec.apply_(target, data)
            except codec.DeltaError as exc:
                self._bad(part.ref.key, f"{part.ref.key}: does not apply to step {s.parent} ({exc})")
                return None
            covered.update(target)
        if covered != set(tensors):
            self.problem(f"step {s.step}: its parts leave tensors unverified {sorted(set(tensors) - covered)[:5]}")
            return None
        return tensors


def _ranges(steps: list[int]) -> str:
    out, start, prev = [], steps[0], steps[0]
    for n in steps[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


def _regional_view(store: Store, m: Manifest, report: Report) -> Manifest:
    """The snapshots to check in a region that announces its own (PROTOCOL §8.1): those, plus the trainer's
    that the region holds (any of their objects listed); one wholly absent there is no problem, a reader
    plans around it."""
    ann, etag = announce.read_announcement(store)
    if ann is None:
        if etag is not None:
            report.problems.append(f"{store.url}/{announce.ANNOUNCE_KEY}: unreadable (see the log)")
        return m
    if ann.run != m.run:
        report.problems.append(f"{store.url}/{announce.ANNOUNCE_KEY}: announces snapshots of run {ann.run}, the "
                               f"manifest's run is {m.run}")
        return m
    listed = {s.step for s in m.steps}
    regional = [s for s in ann.snapshots if s.step in listed]
    unusable = [s.step for s in ann.snapshots if s.step not in listed]
    if unusable:
        report.notes.append(f"regional snapshots of steps the manifest no longer lists (gc drops them): {unusable}")
    try:
        held: dict[str, int] | None = store.list("snapshots/")
    except Exception as exc:  # noqa: BLE001 - unknown: every trainer's snapshot is checked
        report.notes.append(f"could not list snapshots/ ({type(exc).__name__}: {exc})")
        held = None
    trainers = [s for s in m.snapshots if held is None or any(r.key in held for r in (s.index, *s.files))]
    absent = [s.step for s in m.snapshots if s not in trainers]
    report.notes.append(f"regional snapshots {[s.step for s in regional]} checked like the trainer's"
                        + (f"; the region holds none of the trainer's snapshots {absent}, so a start from them "
                           f"is not checked here" if absent else ""))
    snaps = regional + trainers
    snaps.sort(key=lambda s: (s.step, not announce.is_regional(s)))
    report.snapshots = len(snaps)
    return dataclasses.replace(m, snapshots=snaps)


def verify(url: str, storage_options: dict | None = None, *, deep: bool = False, trusted_keys: Any = None,
           workers: int = 4) -> Report:
    """Check a run (see the module docstring); returns a Report whose `problems` list every finding."""
    report = Report(url.rstrip("/"), deep=deep)
    trusted = TrustedKeys.from_option(trusted_keys)
    store = open_store(url, storage_options)
    where = f"{store.url}/{MANIFEST_KEY}"
    got = store.read_manifest()
    if got is None:
        report.problems.append(f"{where}: missing (no run here)")
        return report
    try:
        m = Manifest.parse(got.data, where)
    except ManifestError as exc:
        report.problems.append(str(exc))
        return report
    report.run, report.head, report.base = m.run, m.head, m.base
    report.steps, report.snapshots = len(m.steps), len(m.snapshots)
    report.signed_by = [s.key_id for s in m.signatures]
    if trusted is not None:
        try:
            report.signature = f"valid, by trusted key {trusted.verify(m, where).key_id}"
        except SignatureError as exc:
            report.signature = "INVALID"
            report.problems.append(str(exc))
    elif m.signatures:
        report.signature = "present, not checked (give --trusted-key)"
    else:
        report.signature = "unsigned"
    checker = _Checker(store, _regional_view(store, m, report), report, workers, trusting=trusted is not None)
    checker.shallow()
    if deep:
        checker.deep()
    try:
        listed = store.list_run()
        report.unreferenced = len(set(listed) - m.referenced())
    except Exception as exc:  # noqa: BLE001 - listing is informational
        report.notes.append(f"could not list the store ({type(exc).__name__}: {exc})")
    return report


__all__ = ["verify", "Report"]
