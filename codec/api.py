"""encode / decode / apply_: the codec's public entry points over mappings of tensors.

Methods are reached only through their interface (codec/methods/base.py, `Method`): which
analyse, batch, code and decode which tensors, and which shared blocks they write, is theirs to
say; here is what every payload does with them (threads, buffers, digests, racing, verification).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import container, hashing, methods, tensors
from .container import Entry, Payload
from .errors import CheckpointMismatchError, DeltaError
from .hashing import Running, digest_elements, header_bytes, running
from .methods.base import Batch, Job, Method, Patch, changed_positions

EFFORTS = ("fast", "default", "max")
DENSE_FRACTION = 0.25  # above this changed fraction, every applicable method races (the dense XOR path can win)


def _check_structure(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    missing = [k for k in target if k not in base]
    extra = [k for k in base if k not in target]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"added in target: {', '.join(sorted(missing)[:5])}")
        if extra:
            parts.append(f"removed from target: {', '.join(sorted(extra)[:5])}")
        raise CheckpointMismatchError("base and target hold different tensors (" + "; ".join(parts) + ")")
    for name, t in target.items():
        b = base[name]
        if b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
            raise CheckpointMismatchError(
                f"tensor {name!r}: base is {b.dtype} {tuple(b.shape)}, target is {t.dtype} {tuple(t.shape)}")


@dataclass
class _Candidate:
    method: int
    params: bytes
    streams: list

    @property
    def size(self) -> int:
        return len(self.params) + sum(len(s.stored) for s in self.streams)


class _Plan:
    """What one encode call knows about the methods: the format version's methods in the order
    they are tried, each dtype's analysing method, the effort, and (once fitted) each analysing
    method's payload-wide model."""

    def __init__(self, format_version: int, effort: str) -> None:
        self.version = format_version
        self.effort = effort
        self.methods = methods.in_version(format_version)
        self.unchanged = next(m for m in self.methods if m.identity)
        self.models: dict[int, object] = {}
        self._coders: dict[tensors.DType, list[Method]] = {}
        self._analysers: dict[tensors.DType, Method | None] = {}

    def coders(self, dt: tensors.DType) -> list[Method]:
        """The methods that may code a changed tensor of this dtype, in the order tried."""
        found = self._coders.get(dt)
        if found is None:
            found = self._coders[dt] = [m for m in self.methods if not m.identity and m.applicable(dt)]
        return found

    def analyser(self, dt: tensors.DType) -> Method | None:
        """The method that analyses tensors of this dtype before they are coded, if any."""
        if dt not in self._analysers:
            self._analysers[dt] = next((m for m in self.methods if m.analyses and m.applicable(dt)), None)
        return self._analysers[dt]

    def batcher(self, base: torch.Tensor, target: torch.Tensor) -> Method | None:
        """The analysing method that takes this pair into its batches, if any."""
        for m in self.methods:
            if m.analyses and m.batch_encodable(base, target):
                return m
        return None

    def encode(self, job: Job) -> _Candidate:
        """Per tensor, the first method that codes it or, where its changes are dense or effort is
        "max", the smallest record of all that do: racing general-purpose compressors on ~100
        small tensors costs more encode time than the bytes it might save."""
        race = job.changes > DENSE_FRACTION * job.base.size or job.effort == "max"
        best = None
        for m in self.coders(job.dtype):
            coded = m.encode(job, self.models.get(m.id))
            if coded is None:
                continue
            c = _Candidate(m.id, *coded)
            if best is None or c.size < best.size:
                best = c
            if not race:
                break
        if best is None:
            raise AssertionError(f"no method codes tensor {job.name!r} ({job.dtype.name})")
        return best


class _Batched:
    """Tensors one method analyses together: a few compiled calls scan (and, where the kernels can,
    digest) them all, with no Python per tensor (`Method.analyse_batch`)."""

    def __init__(self, method: Method, names: list[str], base: Mapping[str, torch.Tensor],
                 target: Mapping[str, torch.Tensor], scratch: object) -> None:
        self.method = method
        self.names = names
        self.dtypes = [tensors.dtype_of(target[name], name) for name in names]
        self.shapes = [tuple(target[name].shape) for name in names]
        self.sizes = np.array([target[name].numel() for name in names], np.int64)
        self.batch: Batch = method.analyse_batch([base[n] for n in names], [target[n] for n in names], scratch)
        digests = self.batch.digest_pairs()
        if digests is None:  # kernels cannot hash here (hashing.KERNEL_DIGESTS): from Python, a second read
            digests = [(digest_elements(dt.name, shape, tensors.element_view(base[name])),
                        digest_elements(dt.name, shape, tensors.element_view(target[name])))
                       for name, dt, shape in zip(names, self.dtypes, self.shapes)]
        self.digests = digests

    def entries(self, base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], plan: _Plan) -> list[Entry]:
        """The batch's records: those its method alone would code (sparse changes, effort not
        "max") coded together (`Method.encode_batch`); the others race methods one by one."""
        changes = self.batch.changes()
        sparse_ = (changes > 0) & (changes <= DENSE_FRACTION * self.sizes)
        together = np.flatnonzero(sparse_) if plan.effort != "max" else np.zeros(0, np.int64)
        coded = {}
        if together.size:
            coded = dict(zip(together.tolist(),
                             self.method.encode_batch(self.batch, together, plan.models.get(self.method.id))))
        out = []
        for i, (name, dt, shape, (bd, td)) in enumerate(zip(self.names, self.dtypes, self.shapes, self.digests)):
            k = int(changes[i])
            if not k:
                out.append(Entry(name, dt, shape, plan.unchanged.id, 0, bd, bd))
                continue
            record = coded.get(i)
            if record is not None:
                c = _Candidate(self.method.id, *record)
            else:
                b, t = tensors.element_view(base[name]), tensors.element_view(target[name])
                c = plan.encode(Job(name, dt, b, t, k, plan.effort, None, self.batch.analysis(i)))
            out.append(Entry(name, dt, shape, c.method, k, bd, td, c.params, c.streams))
        return out


class _BufferPool:
    """Scratch memory (`Method.scratch`) lent to the batches of encode calls and taken back when
    the payload is packed (a batch's analysis may live in it until then; reused memory takes no
    page faults). Holds a few sets per method, of at most KEEP bytes each; larger ones go back
    to the allocator."""

    KEEP = 256 << 20
    SETS = 4

    def __init__(self) -> None:
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()

    def take(self, method: Method) -> object:
        with self._lock:
            free = self._free.get(method.id)
            if free:
                return free.pop()
        return method.scratch()

    def give(self, method: Method, scratch: Any) -> None:
        if scratch is not None and scratch.nbytes <= self.KEEP:
            with self._lock:
                free = self._free.setdefault(method.id, [])
                if len(free) < self.SETS:
                    free.append(scratch)


_BUFFERS = _BufferPool()


def _groups(names: list[str], items: Mapping, workers: int, size=lambda t: t.numel()) -> list[list[str]]:
    """Names split into up to `workers` batches of about equal element counts (`size` of each
    name's item), one per thread."""
    if workers <= 1 or len(names) <= 1:
        return [names] if names else []
    groups: list[list[str]] = [[] for _ in range(min(workers, len(names)))]
    load = [0] * len(groups)
    for name in sorted(names, key=lambda n: -size(items[n])):
        g = load.index(min(load))
        groups[g].append(name)
        load[g] += size(items[name])
    return groups


class _Pending:
    """A tensor outside the batches (another dtype, a device tensor, a v1 payload) on its way
    into the payload; host copies of device tensors are made on demand."""

    def __init__(self, name: str, base: torch.Tensor, target: torch.Tensor, plan: _Plan) -> None:
        self.name = name
        self.dt = tensors.dtype_of(target, name)
        self.shape = tuple(target.shape)
        self._tensors = (base, target)
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self.analyser = plan.analyser(self.dt)
        self.analysis = None
        self.index: np.ndarray | None = None
        if self.analyser is not None:
            self.analysis = self.analyser.analyse(base, target, lambda: self.host)
            self.index = self.analysis.index
        else:
            self.index = changed_positions(*self.host)
        if self.index is None:  # an analyser that keeps no index still counts the changes
            if self.analysis is None:
                raise AssertionError("internal: neither an index nor an analysis of the changes")
            self.changes = self.analysis.changes
        else:
            self.changes = int(self.index.size)
        self.base_digest = digest_elements(self.dt.name, self.shape, self.host[0])

    @property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host is None:
            self._host = (tensors.element_view(self._tensors[0]), tensors.element_view(self._tensors[1]))
        return self._host

    def entry(self, plan: _Plan) -> Entry:
        if not self.changes:
            return Entry(self.name, self.dt, self.shape, plan.unchanged.id, 0, self.base_digest, self.base_digest)
        b, t = self.host
        c = plan.encode(Job(self.name, self.dt, b, t, self.changes, plan.effort, self.index, self.analysis))
        td = digest_elements(self.dt.name, self.shape, t)
        return Entry(self.name, self.dt, self.shape, c.method, self.changes, self.base_digest, td, c.params, c.streams)


def encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], *, effort: str = "default",
           format_version: int = container.CURRENT_VERSION, workers: int = 1) -> bytes:
    """Delta payload that turns `base` into `target`, bit for bit.

    Both map tensor names to tensors with the same names, dtypes and shapes (else
    CheckpointMismatchError). `effort` trades encode time for size: "fast", "default" or "max".
    `format_version=1` writes payloads that v1 decoders read. `workers` > 1 codes tensors on
    that many threads (the compiled kernels release the GIL).
    """
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {EFFORTS}")
    if format_version not in container.SUPPORTED_VERSIONS:
        raise ValueError(f"format_version must be one of {container.SUPPORTED_VERSIONS}")
    _check_structure(base, target)
    plan = _Plan(format_version, effort)
    batched: dict[Method, list[str]] = {}
    for name, t in target.items():
        m = plan.batcher(base[name], t)
        if m is not None:
            batched.setdefault(m, []).append(name)
    jobs = [(m, group, _BUFFERS.take(m)) for m, names in batched.items() for group in _groups(names, target, workers)]
    try:
        return _encode(base, target, plan, workers, jobs)
    finally:
        for m, _, scratch in jobs:
            _BUFFERS.give(m, scratch)


_POOLS: dict[int, tuple[int, ThreadPoolExecutor]] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """This process's pool of `workers` threads, made once: an encode or decode maps over it
    several times, and starting threads each time cost ~10% of a 2-worker decode. A forked
    child gets a new pool (the parent's threads do not exist there)."""
    pid = os.getpid()
    with _POOLS_LOCK:
        if workers not in _POOLS or _POOLS[workers][0] != pid:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"deltarelay-codec-{workers}")
            _POOLS[workers] = (pid, pool)
        return _POOLS[workers][1]


def _map(workers: int, fn, items: list) -> list:
    """fn over items, on `workers` threads if more than one (one core: no pool overhead either)."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    return list(_pool(workers).map(fn, items))


def _encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], plan: _Plan, workers: int,
            jobs: list[tuple[Method, list[str], object]]) -> bytes:
    """`encode` of the batches `jobs` (method, names, lent scratch) and of the tensors outside them."""
    batches = _map(workers, lambda job: _Batched(job[0], job[1], base, target, job[2]), jobs)
    in_batches = {name for _, names, _ in jobs for name in names}
    rest = [name for name in target if name not in in_batches]
    pending = _map(workers, lambda name: _Pending(name, base[name], target[name], plan), rest)
    for m in plan.methods:  # each analysing method's payload-wide model, from all its analyses
        if m.analyses:
            plan.models[m.id] = m.fit(plan.version, [b.batch for b in batches if b.method is m],
                                      [p.analysis for p in pending if p.analyser is m and p.changes])
    coded = {e.name: e for group in _map(workers, lambda b: b.entries(base, target, plan), batches) for e in group}
    coded.update((e.name, e) for e in _map(workers, lambda p: p.entry(plan), pending))
    entries = [coded[name] for name in target]
    used = {e.method for e in entries}
    shared = {}
    for m in plan.methods:
        if m.id in used:
            shared.update(m.shared_blocks(plan.models.get(m.id)))
    return container.pack(Payload(plan.version, entries, shared))


def _base_view(entry: Entry, tensor: torch.Tensor | None) -> np.ndarray:
    """The base tensor's elements after checking name, dtype and shape (its digest is checked lazily)."""
    if tensor is None:
        raise DeltaError("the base has no such tensor (delta made for another checkpoint)", tensor=entry.name)
    if tensor.dtype != entry.dtype.torch or tuple(tensor.shape) != entry.shape:
        raise DeltaError(f"base is {tensor.dtype} {tuple(tensor.shape)}, "
                         f"delta expects {entry.dtype.torch} {entry.shape}",
                         tensor=entry.name)
    return tensors.element_view(tensor)


def _base_matches(entry: Entry, elems: np.ndarray) -> bool:
    return digest_elements(entry.dtype.name, entry.shape, elems) == entry.base_digest


_WRONG_BASE = "base digest mismatch: this delta was made for a different base"


def _explain(entry: Entry, elems: np.ndarray, exc: DeltaError) -> DeltaError:
    """A failure against a base that is not the one the delta names is reported as a wrong base.

    The base digest is only computed here, on failure: the target digest already proves every
    success, so the common path hashes each tensor once.
    """
    if not _base_matches(entry, elems):
        return DeltaError(_WRONG_BASE, tensor=entry.name)
    return exc


def _parse(base: Mapping[str, torch.Tensor], payload: bytes | bytearray | memoryview) -> Payload:
    parsed = container.unpack(payload)
    for method in methods.REGISTRY.values():  # each method checks the shared blocks it owns
        method.check_shared(parsed.shared, parsed.version)
    names = {e.name for e in parsed.entries}
    extra = [k for k in base if k not in names]
    if extra:
        raise DeltaError(f"base holds tensors the delta does not name ({', '.join(sorted(extra)[:5])}): wrong base")
    return parsed


def _decoded(entry: Entry, elems: np.ndarray, parsed: Payload, with_target: bool,
             digest: Running | None = None) -> tuple[int, Patch | None, np.ndarray | None]:
    """(changes, patch, target) of one entry, every failure a DeltaError naming the tensor. With
    with_target, methods that build the target while decoding (`Method.builds_target`) do so (no
    copy of the base beforehand, no scatter, no patch; they feed `digest` the target as they
    finish it), the others' patch is applied to a copy."""
    method = methods.lookup(entry, parsed.version)
    patch = new = None
    try:
        if with_target and method.builds_target:
            count, new = method.decode_target(entry, elems, parsed.shared, digest)
        else:
            patch = method.decode(entry, elems, parsed.shared)
            count = patch.count
    except DeltaError:
        raise
    except (ValueError, IndexError, OverflowError, MemoryError) as exc:  # defence in depth on forged input
        raise DeltaError(f"cannot decode ({type(exc).__name__}: {exc})", tensor=entry.name) from None
    if count != entry.changes:
        raise DeltaError(f"decoded {count} changes, index says {entry.changes}", tensor=entry.name)
    return count, patch, new


def _patch(entry: Entry, elems: np.ndarray, parsed: Payload) -> Patch:
    """The entry's patch (its changed positions and new values)."""
    patch = _decoded(entry, elems, parsed, False)[1]
    if patch is None:
        raise AssertionError(f"internal: {entry.name!r} decoded without a patch")
    return patch


def _target_digest(entry: Entry, elems: np.ndarray, parsed: Payload) -> tuple[np.ndarray, bytes]:
    """The entry's whole reconstructed tensor, flat, and its digest: fed part by part while the
    decoder builds it, where the method and the kernels can (`hashing.running`), else computed
    afterwards."""
    digest = running(entry.dtype.name, entry.shape)
    _, patch, new = _decoded(entry, elems, parsed, True, digest)
    if new is not None:
        return new, digest.digest() if digest is not None else digest_elements(entry.dtype.name, entry.shape, new)
    if patch is None:
        raise AssertionError(f"internal: {entry.name!r} decoded without a patch or a target")
    new = elems.reshape(-1).copy()
    new[patch.index] = patch.values
    return new, digest_elements(entry.dtype.name, entry.shape, new)


def _unchanged(entry: Entry) -> bool:
    """Whether the record is of a method whose records change nothing (`Method.identity`)."""
    method = methods.REGISTRY.get(entry.method)
    return method is not None and method.identity


def _decode_entry(base: Mapping[str, torch.Tensor], entry: Entry, parsed: Payload) -> torch.Tensor:
    elems = _base_view(entry, base.get(entry.name))
    if _unchanged(entry):
        if not _base_matches(entry, elems):
            raise DeltaError(_WRONG_BASE, tensor=entry.name)
        _patch(entry, elems, parsed)  # validates the record
        new = elems.copy()
    else:
        try:
            new, digest = _target_digest(entry, elems, parsed)
        except DeltaError as exc:
            raise _explain(entry, elems, exc) from None
        if digest != entry.target_digest:
            mismatch = DeltaError("reconstruction does not match the target digest", tensor=entry.name)
            raise _explain(entry, elems, mismatch)
    return tensors.tensor_from_elements(new, entry.dtype, entry.shape, copy=False)


def _decode_batched(method: Method, base: Mapping[str, torch.Tensor], parsed: Payload,
                    entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The verified targets of `method`'s records over CPU bases, decoded together straight into
    new tensors (`Method.decode_batch`). One that fails is left out: `_decode_entry` then
    decodes it alone and says why."""
    chosen, bases, outs = [], [], []
    for entry in entries:
        tensor = base.get(entry.name)
        if (tensor is None or not tensor.is_cpu or tensor.dtype != entry.dtype.torch
                or tuple(tensor.shape) != entry.shape):
            continue
        chosen.append(entry)
        bases.append(tensor)
        outs.append(torch.empty(entry.shape, dtype=entry.dtype.torch))
    if not chosen:
        return {}
    headers = [header_bytes(e.dtype.name, e.shape) for e in chosen] if hashing.KERNEL_DIGESTS else None
    result = method.decode_batch(chosen, bases, outs, parsed.shared, headers)
    if result is None:
        return {}
    decoded, status, digests = result
    done = {}
    for i, (entry, out) in enumerate(zip(chosen, outs)):
        if status[i] or decoded[i] != entry.changes:
            continue
        if digests is not None:
            digest = digests[i]
        else:  # kernels cannot hash here (hashing.KERNEL_DIGESTS): from Python
            digest = digest_elements(entry.dtype.name, entry.shape, tensors.element_view(out))
        if digest == entry.target_digest:
            done[entry.name] = out
    return done


_OUT_OF_MEMORY = "the payload needs more memory than is available to decode"


def decode(base: Mapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, *,
           workers: int = 1) -> dict[str, torch.Tensor]:
    """The target checkpoint, every tensor verified against the trainer's digest.

    Raises DeltaError, producing nothing, if the payload is corrupt or made for another base.
    `workers` > 1 decodes tensors on that many threads (the compiled kernels release the GIL).
    """
    try:
        return _decode(base, payload, workers)
    except MemoryError:  # running out of memory on a payload is a refusal like any other
        raise DeltaError(_OUT_OF_MEMORY) from None


def _decode(base: Mapping[str, torch.Tensor], payload: bytes | bytearray | memoryview,
            workers: int) -> dict[str, torch.Tensor]:
    parsed = _parse(base, payload)
    batched: dict[Method, dict[str, Entry]] = {}  # per method, the records it decodes together
    for e in parsed.entries:
        method = methods.REGISTRY.get(e.method)  # (one outside its versions is refused alone)
        if method is not None and method.exists_in(parsed.version) and method.batch_decodable(e):
            batched.setdefault(method, {})[e.name] = e
    jobs = [(method, names) for method, by_name in batched.items()
            for names in _groups(list(by_name), by_name, workers, lambda e: e.numel)]
    done: dict[str, torch.Tensor] = {}
    for part in _map(workers, lambda job: _decode_batched(job[0], base, parsed, [batched[job[0]][n] for n in job[1]]),
                     jobs):
        done.update(part)
    rest = [entry for entry in parsed.entries if entry.name not in done]
    # largest first, so one big tensor does not start last
    order = sorted(rest, key=lambda e: -e.numel) if workers > 1 else rest
    done.update(zip((e.name for e in order), _map(workers, lambda e: _decode_entry(base, e, parsed), order)))
    return {entry.name: done[entry.name] for entry in parsed.entries}


class _InPlace:
    """Writes a patch into a live tensor and remembers what it overwrote."""

    _INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; apply_ updates contiguous tensors in place")
        self.name = name
        self.tensor = tensor
        size = tensor.element_size()
        if size not in self._INT:
            raise ValueError(f"tensor {name!r}: apply_ does not support {tensor.dtype} in place")
        self.flat = tensor.detach().view(-1).view(self._INT[size])
        self.np_dtype = np.dtype(f"i{size}") if size > 1 else np.dtype(np.uint8)
        # on the CPU, numpy indexing over the tensor's own memory: ~4x faster than torch's
        # index ops for the few scattered elements a patch touches
        self.elems = tensors.element_view(tensor) if tensor.is_cpu else None

    def _put(self, index: np.ndarray, values: np.ndarray) -> None:
        if self.elems is not None:
            self.elems[index] = values
            return
        idx = torch.from_numpy(index).to(self.flat.device)
        vals = torch.from_numpy(np.ascontiguousarray(values).view(self.np_dtype)).to(self.flat.device)
        with torch.no_grad():
            self.flat[idx] = vals

    def write(self, patch: Patch) -> np.ndarray:
        if self.elems is not None:
            old = self.elems[patch.index]
        else:
            idx = torch.from_numpy(patch.index).to(self.flat.device)
            old = self.flat[idx].cpu().numpy().view(patch.values.dtype).copy()
        self._put(patch.index, patch.values)
        return old

    def undo(self, index: np.ndarray, old: np.ndarray) -> None:
        self._put(index, old)


def apply_(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, *,
           subset: bool = False) -> None:
    """Apply a payload in place (a live model's state_dict) and verify every tensor.

    On any failure every tensor is restored to its exact previous bits and DeltaError is raised.
    Extra memory is an undo log of the changed elements, not a copy of the checkpoint.
    `subset=True` applies only the payload's tensors that `tensors_` holds (a host that serves part
    of a model); the others are skipped, neither decoded nor verified. Tensors the payload does not
    name are an error either way.
    """
    try:
        _apply(tensors_, payload, subset)
    except MemoryError:  # apply_ has restored every tensor by the time the error leaves _apply
        raise DeltaError(_OUT_OF_MEMORY) from None


def _apply(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview,
           subset: bool = False) -> None:
    parsed = _parse(tensors_, payload)
    entries = [e for e in parsed.entries if e.name in tensors_] if subset else parsed.entries
    views = {entry.name: _base_view(entry, tensors_.get(entry.name)) for entry in entries}
    for entry in entries:  # unchanged tensors are verified up front; changed ones after writing
        if _unchanged(entry):
            if not _base_matches(entry, views[entry.name]):
                raise DeltaError(_WRONG_BASE, tensor=entry.name)
            _patch(entry, views[entry.name], parsed)  # validates the record (no data, equal digests)
    # Decode every patch before the first write: names that share storage (tied weights) must
    # not see each other's writes, and a bad stream is refused with nothing touched.
    patches = []
    for entry in entries:
        if _unchanged(entry):
            continue
        try:
            patches.append((entry, _patch(entry, views[entry.name], parsed)))
        except DeltaError as exc:
            raise _explain(entry, views[entry.name], exc) from None
    undo: list[tuple[_InPlace, np.ndarray, np.ndarray]] = []
    try:
        for entry, patch in patches:
            live = tensors_[entry.name]
            writer = _InPlace(entry.name, live)
            undo.append((writer, patch.index, writer.write(patch)))
            if digest_elements(entry.dtype.name, entry.shape, tensors.element_view(live)) != entry.target_digest:
                raise DeltaError("reconstruction does not match the target digest", tensor=entry.name)
    except BaseException as exc:
        for writer, index, old in reversed(undo):
            writer.undo(index, old)
        if isinstance(exc, DeltaError) and exc.tensor in views:  # restored: now say why it failed
            entry = next(e for e in entries if e.name == exc.tensor)
            raise _explain(entry, tensors.element_view(tensors_[entry.name]), exc) from None
        raise
