"""Trainer side: publish each step as a delta (or a full snapshot) and commit it in the manifest.

Order of writes for a step: the record and the delta object(s) first, then the manifest, with a
conditional write, so a reader never sees a manifest naming an object that was not written, and
two publishers never both extend a run (the loser gets ConflictError). Snapshots that are not
needed to reach the step (a delta exists) upload in a background thread and join the manifest
only once every file is in the store.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import save as st_save

import codec
from relay.checkpoint import DEFAULT_SHARD_BYTES, index_bytes, shard_plan
from relay.commit import check_writable, extend_run, update_manifest, writer_keys
from relay.manifest import (INDEX_NAME, MAX_INT, Manifest, ObjRef, Part, Record, Snapshot, Step, delta_key, record_key,
                            snapshot_prefix, step_of_key, tensor_infos)
from relay.retry import Backoff
from relay.signing import Signer, TrustedKeys
from relay.store import ConflictError, Store, open_store

log = logging.getLogger(__name__)

SNAPSHOT_BACKOFF = Backoff(0.5, 10.0)  # between tries of a background snapshot


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
    objects[prefix + INDEX_NAME] = index_bytes(tensors, weight_map, step=step)
    return objects


def upload_snapshot(store: Store, step: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str],
                    workers: int = 4, strong: bool = False,
                    put: Callable[[str, bytes], None] | None = None) -> Snapshot:
    """Write every snapshot file (in parallel, with `put`, default store.put_immutable), then return its
    manifest entry (with SHA-256s when `strong`)."""
    objects = snapshot_objects(step, tensors, weight_map)
    put = put or store.put_immutable
    with ThreadPoolExecutor(max(1, min(workers, len(objects)))) as pool:
        list(pool.map(lambda kv: put(*kv), objects.items()))
        refs = dict(zip(objects, pool.map(lambda kv: ObjRef.of(kv[0], kv[1], strong), objects.items())))
    index_key = snapshot_prefix(step) + INDEX_NAME
    return Snapshot(step, refs.pop(index_key), tuple(refs[k] for k in sorted(refs)))


class Publisher:
    """Publishes a trainer's steps into one run.

    snapshot_every: a full snapshot when the step number is this far past the last one.
    snapshot_fraction: also snapshot when the delta bytes since the last snapshot exceed this fraction of it.
    max_shard_bytes: size cap of one snapshot file. background: upload deferrable snapshots in a thread.
    resume: attach to an existing run at its head (its state is read back, waiting at most resume_timeout
    seconds for objects that are not there yet) and take it over: the manifest then names this
    publisher as the run's writer, and any earlier publisher of the run (a trainer thought dead, a
    split brain) is fenced: its next commit fails with ConflictError (PROTOCOL §4.3). Without
    resume the run must be empty.
    keep_snapshots: when set, each snapshot commit also drops older snapshots and steps from the
    manifest (as `gc` does), so the manifest stays small; `gc` or lifecycle rules delete the objects.
    signing_key: a PEM private key path (or several during a key rotation, or Ed25519PrivateKey
    objects): every manifest commit is signed and every object carries its SHA-256 (docs/SECURITY.md).
    Before each commit the manifest read back must verify with the publisher's own keys or
    `trusted_keys` (public keys of a rotation); an unsigned one is refused unless
    `adopt_unsigned` (the operator signs an unsigned run from now on; only until the first signed
    commit). A publisher without a key refuses to extend a signed run (it would strip the signatures).
    snapshot_attempts: tries of a background snapshot before it is reported failed (and retried at
    the next step).
    """

    def __init__(self, url: str, *, snapshot_every: int = 25, storage_options: dict | None = None,
                 resume: bool = False, snapshot_fraction: float = 0.5, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 effort: str = "default", background: bool = True, upload_workers: int = 4,
                 resume_timeout: float | None = 600.0, keep_snapshots: int | None = None,
                 signing_key: Any = None, trusted_keys: Any = None, adopt_unsigned: bool = False,
                 snapshot_attempts: int = 3) -> None:
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        if snapshot_fraction <= 0:
            raise ValueError("snapshot_fraction must be > 0")
        if snapshot_attempts < 1:
            raise ValueError("snapshot_attempts must be >= 1")
        self.url = url
        self.store = open_store(url, storage_options)
        self.snapshot_every = snapshot_every
        self.snapshot_fraction = snapshot_fraction
        self.max_shard_bytes = max_shard_bytes
        self.effort = effort
        self.upload_workers = upload_workers
        self.resume_timeout = resume_timeout
        self.snapshot_attempts = snapshot_attempts
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError("keep_snapshots must be >= 1")
        self.keep_snapshots = keep_snapshots
        self.signer = None if signing_key is None else Signer(signing_key)
        self.trusted = TrustedKeys.from_option(trusted_keys)
        self._adopt_unsigned = adopt_unsigned  # until our first signed commit: then the run is ours to sign
        self._commit_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="relay-snapshot") if background else None
        self._pending: list[Future] = []
        self._errors: list[BaseException] = []  # background snapshot failures not yet handed to flush()
        self._snapshot_retry = False  # a background snapshot failed: take the next step's instead
        self.snapshot_failures = 0
        self.last_snapshot_error: str | None = None
        self._closed = False
        self.prev: dict[str, torch.Tensor] | None = None
        self.step: int | None = None  # last step published (committed) by this publisher
        self._head: int | None = None  # the head of our last commit (what every later commit builds on)
        self._last_snapshot_step = 0  # meaningful once self.prev is set: both are set together
        self._last_snapshot_bytes = 0
        self._chain_bytes = 0
        self.run = uuid.uuid4().hex
        self.writer = uuid.uuid4().hex  # this publisher's id in the manifest's `writer` field
        existing = self.store.read_manifest()
        if existing is not None and not resume:
            m = Manifest.parse(existing.data, f"{url}/manifest.json")
            raise ValueError(f"{url}: the run already has steps (head {m.head}); pass resume=True to continue it")
        if existing is not None:
            self._attach(Manifest.parse(existing.data, f"{url}/manifest.json"))

    def _attach(self, m: Manifest) -> None:
        """Read the head back (as a watcher would), then take the run over with one commit."""
        from relay.watcher import Reader  # reading back the head is the watcher's job

        where = f"{self.url}/manifest.json"
        check_writable(m, where, self.signer, self.trusted, self._adopt_unsigned)
        # a signed run is read back as a watcher would: only manifests our trusted keys signed
        trusted = writer_keys(self.signer, self.trusted) if m.signatures else None
        m, tensors, _ = Reader(self.store, trusted_keys=trusted).reach(None, None, timeout=self.resume_timeout)
        self.run = m.run
        self.prev, self.step, self._head = tensors, m.head, m.head
        snap = m.snapshots[-1]
        self._last_snapshot_step, self._last_snapshot_bytes = snap.step, snap.bytes
        self._chain_bytes = sum(s.delta_bytes for s in m.chain_since_base())
        previous = m.writer

        def take_over(cur: Manifest | None, unsure: bool) -> Manifest | None:
            if cur is None or cur.run != self.run:
                raise ConflictError(f"{where}: the run changed while this publisher resumed it")
            if cur.writer == self.writer:
                return None  # our take-over landed although the store reported a failure
            if cur.head != m.head:
                raise ConflictError(f"{where}: another publisher committed step {cur.head} while this one resumed "
                                    f"at {m.head}: it is live; stop it before resuming")
            return dataclasses.replace(cur, writer=self.writer, signatures=())

        self._update(take_over)
        log.info("%s: resumed at step %d as writer %s (fencing writer %s)", self.url, m.head, self.writer, previous)

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, state: Any, step: int) -> None:
        """Publish `state` (state_dict or nn.Module) as `step`; returns once the step is in the manifest."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
            raise ValueError(f"step must be an integer from 0 to 2**63-1, got {step!r}")
        if self.step is not None and step <= self.step:
            raise ValueError(f"step {step} does not increase (last published step is {self.step})")
        self._collect_background()
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
        self._put(rec_ref.key, record_bytes)
        if payload is not None:
            ref = ObjRef.of(delta_key(step, 0), payload, strong)
            self._put(ref.key, payload)
            entry = Step(step, rec_ref, self.step, (Part(ref),))
            self._chain_bytes += len(payload)
        else:
            entry = Step(step, rec_ref)
        due = (payload is None or self._snapshot_retry or step - self._last_snapshot_step >= self.snapshot_every
               or self._chain_bytes > self.snapshot_fraction * self._last_snapshot_bytes)
        if payload is None:  # only a snapshot reaches this step: upload it before the manifest names the step
            self._wait_background()
            snap = upload_snapshot(self.store, step, tensors, record.weight_map, self.upload_workers, strong,
                                   put=self._put)
            self._commit(entry, snap)
        else:
            self._commit(entry, None)
            if due:
                if self._pool is None:
                    self._commit(None, upload_snapshot(self.store, step, tensors, record.weight_map,
                                                       self.upload_workers, strong, put=self._put))
                else:
                    self._pending.append(self._pool.submit(self._background_snapshot, step, tensors, record.weight_map))
        if due:
            self._snapshot_retry = False
            self._last_snapshot_step = step
            self._last_snapshot_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._chain_bytes = 0
        self.prev, self.step = tensors, step

    def _put(self, key: str, data: bytes) -> None:
        """Create an immutable object. An object of another content under the key of a step we have not
        committed is a leftover of a crashed or fenced publisher: replaced once the manifest shows this
        publisher still owns the run (only the owner commits, so no manifest names such an object)."""
        try:
            self.store.put_immutable(key, data)
            return
        except ConflictError:
            step = step_of_key(key)
            if step is None or (self._head is not None and step <= self._head):
                raise
        got = self.store.read_manifest()
        m = None if got is None else Manifest.parse(got.data, f"{self.url}/manifest.json")
        owner = m is not None and m.run == self.run and m.writer == self.writer and m.head == self._head
        if not owner:
            raise ConflictError(f"{self.url}/{key}: already exists with other content, and another publisher "
                                f"owns the run (writer {m.writer if m else None}, head {m.head if m else None})")
        log.warning("%s/%s: replacing a leftover of an uncommitted step (a crashed or fenced publisher wrote it)",
                    self.url, key)
        self.store.delete([key])
        self.store.put_immutable(key, data)

    def _background_snapshot(self, step: int, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
        """Upload and commit a snapshot, retrying; a final failure is reported, and the next step snapshots."""
        for attempt in range(1, self.snapshot_attempts + 1):
            try:
                self._commit(None, upload_snapshot(self.store, step, tensors, weight_map, self.upload_workers,
                                                   self.signer is not None, put=self._put))
                log.info("%s: snapshot %d committed", self.url, step)
                return
            except ConflictError as exc:  # fenced, or the step was collected: retrying cannot help
                self._snapshot_failed(step, exc)
                return
            except Exception as exc:  # noqa: BLE001 - reported below, never lost
                if attempt == self.snapshot_attempts:
                    self._snapshot_failed(step, exc)
                    return
                delay = SNAPSHOT_BACKOFF.delay(attempt)
                log.warning("%s: snapshot %d failed (attempt %d of %d: %s); retrying in %.1fs", self.url, step, attempt,
                            self.snapshot_attempts, exc, delay)
                time.sleep(delay)

    def _snapshot_failed(self, step: int, exc: BaseException) -> None:
        self.snapshot_failures += 1
        self.last_snapshot_error = f"snapshot {step}: {type(exc).__name__}: {exc}"
        self._snapshot_retry = True  # the next publish snapshots its own step instead
        self._errors.append(exc)
        log.error("%s: background snapshot of step %d failed: %s; the next step will be snapshotted instead "
                  "(watchers keep using the previous snapshot and the chain)", self.url, step, exc)

    def _update(self, change: Any) -> Manifest | None:
        """update_manifest with this publisher's keys; the first signed commit ends an adoption."""
        out = update_manifest(self.store, change, signer=self.signer, trusted=self.trusted,
                              adopt_unsigned=self._adopt_unsigned)
        if self.signer is not None:
            self._adopt_unsigned = False  # the run is signed by us now: an unsigned manifest means tampering
        return out

    def _commit(self, entry: Step | None, snap: Snapshot | None) -> None:
        """Add a step and/or a snapshot to the manifest, only while this publisher owns the run (§4.3) and
        the head is the one it last committed. A manifest that already holds our entry and names us as
        its writer is our own earlier write that landed unreported."""
        def add(cur: Manifest | None, unsure: bool) -> Manifest | None:
            return extend_run(cur, unsure, url=self.url, run=self.run, writer=self.writer, head=self._head,
                              entry=entry, snap=snap, keep_snapshots=self.keep_snapshots)

        with self._commit_lock:
            self._update(add)
            if entry is not None:
                self._head = entry.step

    # -- lifecycle ----------------------------------------------------------------------------
    def _collect_background(self) -> None:
        """Drop finished background uploads (their failures were reported and are kept for flush())."""
        self._pending = [f for f in self._pending if not f.done()]

    def _wait_background(self) -> None:
        for f in self._pending:
            f.result()  # _background_snapshot reports its own failures; nothing is raised here
        self._pending = []

    def flush(self) -> None:
        """Block until every background upload is done; re-raise the first failure since the last flush."""
        self._wait_background()
        errors, self._errors = self._errors, []
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
