"""Rollout side: follow a run's head into a local directory that always holds one verified step.

Reader plans the cheapest way from what is held to the head (apply the chain, or start from a
snapshot), downloads it in parallel, applies it and checks every step against the trainer's
record. Watcher persists the result: a new version directory under DIR/.versions, then one
atomic symlink swap of DIR/.current; the visible names in DIR are symlinks through .current, so a
reader (or a crash) sees the old step or the new one, never a mix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as st_load

import codec
from relay import checkpoint
from relay.manifest import (Manifest, ManifestError, ObjRef, Record, Snapshot, Step, TensorInfo, mismatches,
                            safe_shard_name)
from relay.signing import TrustedKeys
from relay.store import NOT_MODIFIED, ObjectMissing, Store, open_store

log = logging.getLogger(__name__)

STATE_NAME = "relay-state.json"


class SyncError(RuntimeError):
    """The watcher cannot reach the head (no verified path, another run, ...); DIR keeps its last good step."""


class SyncTimeout(SyncError, TimeoutError):
    """The head was not reached in the time allowed (objects still missing); DIR keeps its last good step."""


class _VerifyError(Exception):
    def __init__(self, keys: list[str], reason: str) -> None:
        super().__init__(reason)
        self.keys = keys


@dataclass
class Plan:
    """Start from `snapshot` (or from the held step when None), then apply `steps` in order."""

    snapshot: Snapshot | None
    steps: list[Step]
    cost: int  # bytes to download

    def keys(self, m: Manifest) -> list[ObjRef]:
        refs: list[ObjRef] = []
        if self.snapshot is not None:
            refs += [self.snapshot.index, *self.snapshot.files, m.step(self.snapshot.step).record]
        for s in self.steps:
            refs += [p.ref for p in s.parts]
        if self.steps:  # intermediate steps are checked by the payloads' own target digests
            refs.append(self.steps[-1].record)
        return refs


def plan_path(m: Manifest, held: int | None, excluded: set[str] = frozenset()) -> Plan | None:
    """Cheapest path to the head in bytes: the chain from `held`, or any snapshot plus its chain.

    Linear in the manifest's length (suffix sums over the steps), so a long or hostile manifest
    cannot stall the reader: trying m.chain() from every snapshot would be quadratic. Ties go to
    the held step, then to the oldest snapshot.
    """
    steps = m.steps
    n = len(steps)
    index = {s.step: i for i, s in enumerate(steps)}
    lowest = n - 1  # a chain from steps[i] reaches the head iff i >= lowest
    while lowest > 0 and steps[lowest].parts is not None and steps[lowest].parent == steps[lowest - 1].step:
        lowest -= 1
    tail = [0] * n  # bytes of the parts of every step after i
    for i in range(n - 1, 0, -1):
        parts = steps[i].parts or ()
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
        refs = [] if snap is None else [snap.index, *snap.files, steps[i].record]
        if i < n - 1:
            refs.append(head)
        if any(r.key in excluded for r in refs):
            return
        cost = tail[i] + sum(r.size for r in refs)
        if best is None or cost < best.cost:
            best, best_i = Plan(snap, [], cost), i

    if held is not None and held in index:
        consider(None, index[held])
    for snap in m.snapshots:
        consider(snap, index[snap.step])
    if best is not None:
        best.steps = steps[best_i + 1:]
    return best


class Reader:
    """Brings a state (or nothing) to a run's head, verified; waits out objects that are not there yet."""

    def __init__(self, store: Store, *, workers: int = 8, retry_initial: float = 0.2, retry_max: float = 5.0,
                 reroute_after: float | None = 300.0, trusted_keys: Any = None) -> None:
        self.store = store
        self.trusted = TrustedKeys.from_option(trusted_keys)
        self.reroute_after = reroute_after
        self.workers = workers
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.bytes_downloaded = 0
        self._count_lock = threading.Lock()
        self._cache: dict[str, bytes] = {}

    def read_manifest(self) -> Manifest | None:
        """The current manifest; with trusted keys, only one they signed (SignatureError otherwise)."""
        got = self.store.read_manifest()
        if got is None:
            return None
        where = f"{self.store.url}/manifest.json"
        m = Manifest.parse(got.data, where)
        if self.trusted is not None:
            self.trusted.verify(m, where)
        return m

    def _fetch_one(self, ref: ObjRef) -> bytes:
        if ref.key in self._cache:
            return self._cache[ref.key]
        data = self.store.get(ref.key)
        with self._count_lock:
            self.bytes_downloaded += len(data)
        problem = ref.matches(data)  # size, xxh3 and, in a signed manifest, SHA-256: before any byte is used
        if problem:
            raise _VerifyError([ref.key], f"{ref.key}: {problem}")
        self._cache[ref.key] = data
        return data

    def _fetch(self, refs: list[ObjRef]) -> dict[str, bytes]:
        with ThreadPoolExecutor(max(1, min(self.workers, len(refs)))) as pool:
            return dict(zip((r.key for r in refs), pool.map(self._fetch_one, refs)))

    def _record(self, data: bytes, key: str, run: str, step: int) -> Record:
        try:
            rec = Record.parse(data, key)
        except ManifestError as exc:
            raise _VerifyError([key], str(exc)) from None
        if rec.run != run or rec.step != step:
            raise _VerifyError([key], f"{key}: record of run {rec.run} step {rec.step}, expected {run} step {step}")
        return rec

    def _execute(self, m: Manifest, plan: Plan, held: dict[str, torch.Tensor] | None) -> tuple[dict, Record]:
        got = self._fetch(plan.keys(m))
        if plan.snapshot is not None:
            snap = plan.snapshot
            rec_ref = m.step(snap.step).record
            rec = self._record(got[rec_ref.key], rec_ref.key, m.run, snap.step)
            tensors: dict[str, torch.Tensor] = {}
            file_keys = [f.key for f in snap.files]
            for key in file_keys:
                try:
                    tensors.update(st_load(got[key]))
                except Exception as exc:  # safetensors raises its own types on bad bytes
                    raise _VerifyError([key], f"{key}: not a safetensors file ({exc})") from None
            bad = mismatches(tensors, rec.tensors)
            if bad:
                raise _VerifyError(file_keys + [rec_ref.key], f"snapshot {snap.step} does not match its record "
                                                             f"(tensors {bad[:5]})")
        else:
            if held is None:
                raise SyncError("internal: chain plan without a held state")
            tensors = {k: v.clone() for k, v in held.items()}
            rec = None
        for s in plan.steps:
            covered: set[str] = set()
            for part in s.parts:
                target = tensors if part.tensors is None else {k: tensors[k] for k in part.tensors if k in tensors}
                try:
                    codec.apply_(target, got[part.ref.key])  # verifies every tensor it covers, or changes nothing
                except codec.DeltaError as exc:
                    raise _VerifyError([part.ref.key], f"{part.ref.key}: {exc}") from None
                covered.update(target)
            if covered != set(tensors):
                raise _VerifyError([p.ref.key for p in s.parts],
                                   f"step {s.step}: parts leave tensors unverified {sorted(set(tensors) - covered)[:5]}")
        if plan.steps:
            last = plan.steps[-1]
            rec = self._record(got[last.record.key], last.record.key, m.run, last.step)
            bad = mismatches(tensors, rec.tensors)
            if bad:
                raise _VerifyError([p.ref.key for s in plan.steps for p in s.parts] + [last.record.key],
                                   f"step {last.step} does not match its record (tensors {bad[:5]})")
        return tensors, rec

    def reach(self, held_step: int | None, held: dict[str, torch.Tensor] | None, *, run: str | None = None,
              timeout: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor] | None, Record | None]:
        """(manifest, tensors, record) at the head; tensors None if already there (or the head is older)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.retry_initial
        refetched: set[str] = set()
        excluded: set[str] = set()  # failed verification twice
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
                    plan = plan_path(m, held_step, excluded | rerouted) or plan_path(m, held_step, excluded)
                    if plan is None:
                        raise SyncError(f"{self.store.url}: no verified path to head {m.head} "
                                        f"(objects that failed verification: {sorted(excluded)[:5]})")
                    try:
                        tensors, rec = self._execute(m, plan, held)
                        return m, tensors, rec
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
                        for key in exc.keys:
                            self._cache.pop(key, None)
                        if any(k not in refetched for k in exc.keys):
                            refetched.update(exc.keys)
                            log.warning("verification failed, discarding and refetching: %s", exc)
                        else:
                            excluded.update(exc.keys)
                            log.warning("verification failed again, planning around %s (snapshot fallback): %s",
                                        exc.keys, exc)
                        continue
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise SyncTimeout(f"gave up after {timeout:g}s waiting for {waiting_for}")
                log.info("waiting %.2fs for %s", delay, waiting_for)
                time.sleep(delay)
                delay = min(delay * 2, self.retry_max)
        finally:
            self._cache.clear()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Watcher:
    """Keeps `dest` on the head of the run at `url`.

    Contract for readers of `dest`: ignoring names that begin with '.', and following symlinks,
    it shows exactly one complete, verified step (safetensors in the published layout plus
    relay-state.json), or nothing before the first sync. It never moves to an older step.
    on_update(step, tensors) runs after each persisted step; `module` is updated in place too.
    With `trusted_keys` (PEM paths or Ed25519 public keys) only manifests signed by one of them are
    acted on, and every object is checked against the SHA-256 the signed manifest gives it.
    An object the manifest names but the store lacks is waited for (backoff from retry_initial to
    retry_max seconds); after reroute_after seconds the watcher also considers other complete paths
    (a newer snapshot) that avoid it. It never skips a step of a path or applies part of a chain.
    """

    def __init__(self, url: str, dest: str | os.PathLike, *, poll_interval: float = 1.0,
                 storage_options: dict | None = None, on_update: Callable[[int, dict], Any] | None = None,
                 module: torch.nn.Module | None = None, workers: int = 8, retry_initial: float = 0.2,
                 retry_max: float = 5.0, reroute_after: float | None = 300.0, trusted_keys: Any = None) -> None:
        self.url = url
        self.dest = Path(dest)
        self.poll_interval = poll_interval
        self.on_update = on_update
        self.module = module
        self.store = open_store(url, storage_options)
        self.reader = Reader(self.store, workers=workers, retry_initial=retry_initial, retry_max=retry_max,
                             reroute_after=reroute_after, trusted_keys=trusted_keys)
        self._stop = threading.Event()
        self.step: int | None = None
        self.run_id: str | None = None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.dest.mkdir(parents=True, exist_ok=True)
        self._recover()

    @property
    def bytes_downloaded(self) -> int:
        return self.reader.bytes_downloaded

    # -- local directory ----------------------------------------------------------------------
    def _recover(self) -> None:
        """Load the held step (verified against its state file) and tidy what a crash left behind."""
        current = self.dest / ".current"
        keep = None
        if current.is_symlink() and (current / STATE_NAME).is_file():
            try:
                state = json.loads((current / STATE_NAME).read_text())
                tensors, _ = checkpoint.load(current)
                expected = {k: TensorInfo(v["dtype"], tuple(v["shape"]), v["digest"]) for k, v in state["tensors"].items()}
                bad = mismatches(tensors, expected)
                if bad:
                    raise ValueError(f"tensors {bad[:5]} do not match the state file")
                self.step, self.run_id, self.tensors = int(state["step"]), state["run"], tensors
                keep = os.path.basename(os.readlink(current))
                log.info("%s: holding step %d", self.dest, self.step)
            except Exception as exc:  # noqa: BLE001 - a damaged local copy is refetched, not trusted
                log.warning("%s: held step unreadable (%s); starting fresh", self.dest, exc)
        versions = self.dest / ".versions"
        if versions.is_dir():
            for v in versions.iterdir():
                if v.name != keep:
                    shutil.rmtree(v, ignore_errors=True)
        for p in self.dest.glob(".current.tmp-*"):
            p.unlink(missing_ok=True)
        self._drop_dangling()

    def _drop_dangling(self) -> None:
        for p in self.dest.iterdir():
            if p.is_symlink() and not p.name.startswith(".") and not p.exists():
                p.unlink()

    def _persist(self, m: Manifest, rec: Record, tensors: dict[str, torch.Tensor]) -> None:
        bad = sorted({v for v in rec.weight_map.values() if not safe_shard_name(v)})
        if bad or set(rec.weight_map) != set(tensors):  # Record.parse refuses these; never write outside DEST
            raise SyncError(f"step {rec.step}: refusing to write shard names {[b[:100] for b in bad[:3]]} in {self.dest}")
        versions = self.dest / ".versions"
        versions.mkdir(exist_ok=True)
        name = f"{rec.step}-{uuid.uuid4().hex[:8]}"
        try:
            self._write_version(m, rec, tensors, versions, name)
        except BaseException:
            # A failed write (disk full, I/O error) must not leave a partial version behind: it would hold
            # the space the next attempt needs until a restart. Past the swap the new version is DEST's.
            if os.path.realpath(self.dest / ".current") != os.path.realpath(versions / name):
                shutil.rmtree(versions / f".{name}.tmp", ignore_errors=True)
                shutil.rmtree(versions / name, ignore_errors=True)
                for p in self.dest.glob(".current.tmp-*"):
                    p.unlink(missing_ok=True)
                self._drop_dangling()
            raise

    def _write_version(self, m: Manifest, rec: Record, tensors: dict[str, torch.Tensor], versions: Path,
                       name: str) -> None:
        """Write the step as .versions/<name>, then make it DEST's step with one atomic swap of .current."""
        tmp = versions / f".{name}.tmp"
        tmp.mkdir()
        checkpoint.write_dir(tensors, tmp, checkpoint.Layout(True, rec.weight_map, {"step": str(rec.step)}))
        state = {"run": m.run, "step": rec.step, "url": self.url,
                 "tensors": {k: {"dtype": v.dtype, "shape": list(v.shape), "digest": v.digest} for k, v in rec.tensors.items()}}
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        final = versions / name
        os.rename(tmp, final)
        _fsync_dir(versions)
        for f in final.iterdir():  # visible names: symlinks through .current (dangling until the swap)
            link = self.dest / f.name
            if os.path.lexists(link):
                if not link.is_symlink():
                    raise SyncError(f"{link}: a regular file in the watcher's directory; the watcher owns {self.dest}")
                continue
            os.symlink(os.path.join(".current", f.name), link)
        swap = self.dest / f".current.tmp-{uuid.uuid4().hex[:8]}"
        os.symlink(os.path.join(".versions", name), swap)
        os.replace(swap, self.dest / ".current")  # the commit point
        _fsync_dir(self.dest)
        self._drop_dangling()
        for v in versions.iterdir():
            if v.name != name:
                shutil.rmtree(v, ignore_errors=True)

    # -- syncing ------------------------------------------------------------------------------
    def sync(self, timeout: float | None = None) -> int:
        """Bring `dest` to the head once and return the step held (raises SyncTimeout / SyncError)."""
        m, tensors, rec = self.reader.reach(self.step, self.tensors, run=self.run_id, timeout=timeout)
        if tensors is None:
            return self.step
        if self.step is not None and (rec.step <= self.step or m.run != self.run_id):
            raise SyncError(f"{self.url}: refusing step {rec.step} of run {m.run}; {self.dest} holds step {self.step} "
                            f"of run {self.run_id} and never moves back or across runs")
        self._persist(m, rec, tensors)
        self.step, self.run_id, self.tensors = rec.step, m.run, tensors
        log.info("%s: now at step %d (%s)", self.dest, rec.step, self.url)
        if self.module is not None:
            live = self.module.state_dict()
            with torch.no_grad():
                for k, t in tensors.items():
                    live[k].copy_(t)
        if self.on_update is not None:
            self.on_update(rec.step, tensors)
        return rec.step

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
