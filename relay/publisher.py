"""Trainer side: publish each step as a delta (or a full snapshot) and commit it in the manifest.

Order of writes for a step: the record and the delta object(s) first, then the manifest, with a
conditional write, so a reader never sees a manifest naming an object that was not written, and
two publishers never both extend a run (the loser gets ConflictError). Snapshots that are not
needed to reach the step (a delta exists) upload in a background thread and join the manifest
only once every file is in the store.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import torch
from safetensors.torch import save as st_save

import codec
from relay.checkpoint import shard_plan
from relay.manifest import (INDEX_NAME, Manifest, ObjRef, Part, Record, Snapshot, Step, delta_key, record_key,
                            snapshot_prefix, step_of_key, tensor_infos)
from relay.store import ConflictError, Store, open_store, unsure_write
from relay.signing import Signer, strengthen

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 20  # re-reads after losing an If-Match race to gc/rebase (never to another publisher)


def state_tensors(state: Any) -> dict[str, torch.Tensor]:
    """A private CPU copy of a state_dict or nn.Module's tensors (the trainer keeps mutating its own)."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"publish expects a state_dict or an nn.Module, got {type(state).__name__}")
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(t).__name__}, not a tensor")
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def snapshot_objects(step: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> dict[str, bytes]:
    """Key -> bytes of a full snapshot: safetensors shards plus a Hugging Face index, under snapshots/<step>/."""
    prefix = snapshot_prefix(step)
    objects = {}
    for shard in sorted(set(weight_map.values())):
        part = {k: tensors[k] for k, s in weight_map.items() if s == shard}
        objects[prefix + shard] = st_save(part, metadata={"step": str(step)})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, "step": step}, "weight_map": weight_map}
    objects[prefix + INDEX_NAME] = json.dumps(index, indent=1).encode()
    return objects


def upload_snapshot(store: Store, step: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str],
                    workers: int = 4, strong: bool = False) -> Snapshot:
    """Write every snapshot file (in parallel), then return its manifest entry (with SHA-256s when `strong`)."""
    objects = snapshot_objects(step, tensors, weight_map)
    with ThreadPoolExecutor(max(1, min(workers, len(objects)))) as pool:
        list(pool.map(lambda kv: store.put_immutable(*kv), objects.items()))
        refs = dict(zip(objects, pool.map(lambda kv: ObjRef.of(kv[0], kv[1], strong), objects.items())))
    index_key = snapshot_prefix(step) + INDEX_NAME
    return Snapshot(step, refs.pop(index_key), tuple(refs[k] for k in sorted(refs)))


class Publisher:
    """Publishes a trainer's steps into one run.

    snapshot_every: a full snapshot when the step number is this far past the last one.
    snapshot_fraction: also snapshot when the delta bytes since the last snapshot exceed this fraction of it.
    max_shard_bytes: size cap of one snapshot file. background: upload deferrable snapshots in a thread.
    resume: attach to an existing run at its head (its state is read back, waiting at most resume_timeout
    seconds for objects that are not there yet); without it the run must be empty.
    keep_snapshots: when set, each snapshot commit also drops older snapshots and steps from the
    manifest (as `gc` does), so the manifest stays small; `gc` or lifecycle rules delete the objects.
    signing_key: a PEM private key path (or several during a key rotation, or Ed25519PrivateKey
    objects): every manifest commit is signed and every object carries its SHA-256 (docs/SECURITY.md).
    A publisher without a key refuses to extend a signed run (it would strip the signatures).
    """

    def __init__(self, url: str, *, snapshot_every: int = 25, storage_options: dict | None = None,
                 resume: bool = False, snapshot_fraction: float = 0.5, max_shard_bytes: int = 2 << 30,
                 effort: str = "default", background: bool = True, upload_workers: int = 4,
                 resume_timeout: float | None = 600.0, keep_snapshots: int | None = None,
                 signing_key: Any = None) -> None:
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        if snapshot_fraction <= 0:
            raise ValueError("snapshot_fraction must be > 0")
        self.url = url
        self.store = open_store(url, storage_options)
        self.snapshot_every = snapshot_every
        self.snapshot_fraction = snapshot_fraction
        self.max_shard_bytes = max_shard_bytes
        self.effort = effort
        self.upload_workers = upload_workers
        self.resume_timeout = resume_timeout
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError("keep_snapshots must be >= 1")
        self.keep_snapshots = keep_snapshots
        self.signer = None if signing_key is None else Signer(signing_key)
        self._commit_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="relay-snapshot") if background else None
        self._pending: list[Future] = []
        self._closed = False
        self.prev: dict[str, torch.Tensor] | None = None
        self.step: int | None = None  # last step published (committed) by this publisher
        self._last_snapshot_step: int | None = None
        self._last_snapshot_bytes = 0
        self._chain_bytes = 0
        self.run = uuid.uuid4().hex
        existing = self.store.read_manifest()
        if existing is not None and not resume:
            m = Manifest.parse(existing.data, f"{url}/manifest.json")
            raise ValueError(f"{url}: the run already has steps (head {m.head}); pass resume=True to continue it")
        if existing is not None:
            self._attach(Manifest.parse(existing.data, f"{url}/manifest.json"))

    def _attach(self, m: Manifest) -> None:
        from relay.watcher import Reader  # reading back the head is the watcher's job

        # a signed run is read back as a watcher would: only the manifest our own keys signed
        trusted = self.signer.trusted() if self.signer is not None and m.signatures else None
        m, tensors, _ = Reader(self.store, trusted_keys=trusted).reach(None, None, timeout=self.resume_timeout)
        self.run = m.run
        self.prev, self.step = tensors, m.head
        snap = m.snapshots[-1]
        self._last_snapshot_step, self._last_snapshot_bytes = snap.step, snap.bytes
        self._chain_bytes = sum(s.delta_bytes for s in m.chain_since_base())
        leftovers = [k for k in self._list_all() if (step_of_key(k) or -1) > m.head]
        if leftovers:  # objects of a step whose manifest commit never happened (a crashed publisher)
            log.warning("%s: removing %d objects above head %d left by an interrupted publish", self.url,
                        len(leftovers), m.head)
            self.store.delete(leftovers)
        log.info("%s: resumed at step %d", self.url, m.head)

    def _list_all(self) -> dict[str, int]:
        out = {}
        for prefix in ("deltas/", "records/", "snapshots/"):
            out.update(self.store.list(prefix))
        return out

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, state: Any, step: int) -> None:
        """Publish `state` (state_dict or nn.Module) as `step`; returns once the step is in the manifest."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self.step is not None and step <= self.step:
            raise ValueError(f"step {step} does not increase (last published step is {self.step})")
        self._raise_background_errors()
        tensors = state_tensors(state)
        record = Record(self.run, step, tensor_infos(tensors), shard_plan(tensors, self.max_shard_bytes))
        payload = None
        if self.prev is not None:
            try:
                payload = codec.encode(self.prev, tensors, effort=self.effort)
            except codec.CheckpointMismatchError as exc:
                log.info("%s: step %d changes the tensor set (%s); publishing a full snapshot", self.url, step, exc)
        strong = self.signer is not None
        record_bytes = record.to_bytes()
        rec_ref = ObjRef.of(record_key(step), record_bytes, strong)
        self.store.put_immutable(rec_ref.key, record_bytes)
        if payload is not None:
            ref = ObjRef.of(delta_key(step, 0), payload, strong)
            self.store.put_immutable(ref.key, payload)
            entry = Step(step, rec_ref, self.step, (Part(ref),))
            self._chain_bytes += len(payload)
        else:
            entry = Step(step, rec_ref)
        due = (payload is None or step - self._last_snapshot_step >= self.snapshot_every
               or self._chain_bytes > self.snapshot_fraction * self._last_snapshot_bytes)
        if payload is None:  # only a snapshot reaches this step: upload it before the manifest names the step
            self.flush()
            snap = upload_snapshot(self.store, step, tensors, record.weight_map, self.upload_workers, strong)
            self._commit(entry, snap)
        else:
            self._commit(entry, None)
            if due:
                if self._pool is None:
                    self._commit(None, upload_snapshot(self.store, step, tensors, record.weight_map, self.upload_workers,
                                                       strong))
                else:
                    self._pending.append(self._pool.submit(self._background_snapshot, step, tensors, record.weight_map))
        if due:
            self._last_snapshot_step = step
            self._last_snapshot_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._chain_bytes = 0
        self.prev, self.step = tensors, step

    def _background_snapshot(self, step: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
        self._commit(None, upload_snapshot(self.store, step, tensors, weight_map, self.upload_workers,
                                           self.signer is not None))
        log.info("%s: snapshot %d committed", self.url, step)

    def _commit(self, entry: Step | None, snap: Snapshot | None) -> None:
        """Read-modify-write the manifest with a conditional put; retry only if the head is still ours."""
        with self._commit_lock:
            unsure = 0
            for _ in range(COMMIT_ATTEMPTS):
                current = self.store.read_manifest()
                if current is None:
                    if self.step is not None or entry is None or snap is None:
                        raise ConflictError(f"{self.url}/manifest.json: gone (the run was deleted)")
                    m, expected = Manifest(self.run, entry.step, [entry], [snap]), None
                else:
                    m, expected = Manifest.parse(current.data, f"{self.url}/manifest.json"), current.etag
                    if m.run != self.run:
                        raise ConflictError(f"{self.url}: another publisher started run {m.run} here")
                    if entry is not None and m.step(entry.step) == entry and (
                            snap is None or m.snapshot(snap.step) == snap):
                        # our earlier conditional write landed although the store (or the network) reported a
                        # failure: a 5xx after the write, a reset, a timeout. It is ours, not a lost race.
                        log.warning("%s: the manifest already holds our step %d (a commit reported as failed had "
                                    "landed); carrying on", self.url, entry.step)
                        return
                    if m.signatures and self.signer is None:
                        raise ValueError(f"{self.url}: the run is signed; publishing without signing_key would "
                                         f"leave every watcher that checks signatures behind")
                    if self.signer is not None:
                        m = strengthen(self.store, m)  # a run signed from now on: vouch for its older objects too
                    if entry is not None:
                        if m.head != self.step:
                            raise ConflictError(f"{self.url}: head is step {m.head}, this publisher last committed "
                                                f"{self.step}: another publisher extended the run")
                        m.steps.append(entry)
                        m.head = entry.step
                    if snap is not None and m.snapshot(snap.step) is None:
                        if m.step(snap.step) is None:
                            raise ConflictError(f"{self.url}: step {snap.step} left the manifest before its snapshot "
                                                f"was committed")
                        m.snapshots.append(snap)
                        m.snapshots.sort(key=lambda s: s.step)
                        if self.keep_snapshots is not None:
                            m = m.trimmed(self.keep_snapshots) or m
                try:
                    self.store.commit_manifest(m.to_bytes(signer=self.signer), expected)
                    return
                except ConflictError:
                    log.info("%s: manifest changed under us (gc/rebase?), re-reading", self.url)
                except Exception as exc:  # noqa: BLE001 - unsure_write re-raises all but transient errors
                    # a 5xx or reset leaves the write's fate unknown: the re-read at the top of the
                    # loop tells (our step is there: done; the head moved: a lost race)
                    unsure = unsure_write(self.url, exc, unsure)
            raise ConflictError(f"{self.url}/manifest.json: {COMMIT_ATTEMPTS} conditional writes lost in a row")

    # -- lifecycle ----------------------------------------------------------------------------
    def _raise_background_errors(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def flush(self) -> None:
        """Block until every background upload is committed; re-raise the first failure."""
        pending, self._pending = self._pending, []
        errors = []
        for f in pending:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PUBLISHERS: dict[str, Publisher] = {}
_PUBLISHERS_LOCK = threading.Lock()


def publish(state: Any, step: int, *, url: str, **options: Any) -> None:
    """One-call form: the first call for `url` opens a Publisher with `options`, later calls reuse it.

    Background uploads are flushed at interpreter exit; call `close_publishers()` to flush earlier.
    """
    with _PUBLISHERS_LOCK:
        pub = _PUBLISHERS.get(url)
        if pub is None:
            pub = _PUBLISHERS[url] = Publisher(url, **options)
    pub.publish(state, step)


@atexit.register
def close_publishers() -> None:
    """Flush and close every publisher opened by `publish`."""
    with _PUBLISHERS_LOCK:
        pubs = list(_PUBLISHERS.values())
        _PUBLISHERS.clear()
    for pub in pubs:
        pub.close()
