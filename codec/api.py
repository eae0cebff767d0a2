"""encode / decode / apply_: the codec's public entry points over mappings of tensors.

Methods are reached only through their interface (codec/methods/base.py, `Method`): which
analyse, batch, code and decode which tensors, and which shared blocks they write, is theirs to
say; here is what every payload does with them (threads, buffers, digests, racing, verification).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import container, hashing, interim, memory, methods, patching, tensors
from .container import Entry, Payload
from .errors import CheckpointMismatchError, DeltaError
from .hashing import Running, digest_elements, header_bytes, running
from .methods.base import Batch, Job, Method, Patch, changed_positions

EFFORTS = ("fast", "default", "max")
DENSE_FRACTION = 0.25  # above this changed fraction, every applicable method races (the dense XOR path can win)
# A dense tensor of at least SAMPLED_RACE elements races the later methods on a sample first (at
# effort "default"; "max" races everything in full): 1 in SAMPLE_EVERY of its elements, in windows
# of SAMPLE_WINDOW, and a method is run on the whole tensor only if its sample, scaled up, comes
# within RACE_MARGIN of the best record so far. On dense BF16 the conditional method wins every
# training-like change by 7-55% and loses noise-like ones (re-initialised or random bits) by at
# most ~7%, while each loser cost as much encode time as the winner (a 50%-changed MiniLM: 735 ms,
# 0.07x zstd-1). Encoder policy, not format.
SAMPLED_RACE = 1 << 17
SAMPLE_EVERY = 8
SAMPLE_WINDOW = 1 << 14
RACE_MARGIN = 1.03


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


def _check_limits(target: Mapping[str, torch.Tensor]) -> None:
    """ValueError for a tensor the payload format cannot hold (FORMAT.md's limits): a payload every decoder
    refuses must not be written (a publisher would commit a step no watcher can reach)."""
    for name, t in target.items():
        if len(name.encode("utf-8")) > container.MAX_NAME_BYTES:
            raise ValueError(f"tensor {name[:64]!r}...: name over {container.MAX_NAME_BYTES} bytes, the format's "
                             f"limit")
        tensors.check_shape_limits(name, tuple(t.shape), container.MAX_NDIM, container.MAX_NUMEL)


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
            found = self._coders[dt] = [m for m in self.methods if not m.identity and m.encodes(dt, self.version)]
        return found

    def analyser(self, dt: tensors.DType) -> Method | None:
        """The method that analyses tensors of this dtype before they are coded, if any."""
        if dt not in self._analysers:
            self._analysers[dt] = next((m for m in self.methods if m.analyses and m.encodes(dt, self.version)), None)
        return self._analysers[dt]

    def batcher(self, base: torch.Tensor, target: torch.Tensor) -> Method | None:
        """The analysing method that takes this pair into its batches, if any."""
        dt = tensors.BY_TORCH.get(target.dtype)
        for m in self.methods:
            if m.analyses and dt is not None and m.encodes(dt, self.version) and m.batch_encodable(base, target):
                return m
        return None

    def encode(self, job: Job) -> _Candidate:
        """Per tensor, the first method that codes it or, where its changes are dense or effort is
        "max", the smallest record of all that do: racing general-purpose compressors on ~100
        small tensors costs more encode time than the bytes it might save. A large dense tensor
        races the later methods on a sample first (SAMPLED_RACE)."""
        race = job.changes > DENSE_FRACTION * job.base.size or job.effort == "max"
        best = None
        sample = None
        for m in self.coders(job.dtype):
            if best is not None and job.effort != "max" and job.base.size >= SAMPLED_RACE and not m.analyses:
                if sample is None:
                    sample = _sample(job)
                guess = m.encode(sample, self.models.get(m.id))
                scaled = _Candidate(m.id, *guess).size * job.base.size / sample.base.size if guess is not None else 0
                if scaled > RACE_MARGIN * best.size:
                    continue  # clearly larger: not worth coding the whole tensor
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


def _sample(job: Job) -> Job:
    """1 in SAMPLE_EVERY of a job's elements, as evenly spaced windows of SAMPLE_WINDOW: a stand-in
    to size a method's record by (`_Plan.encode`)."""
    n = job.base.size
    windows = max(1, n // (SAMPLE_EVERY * SAMPLE_WINDOW))
    starts = (np.arange(windows, dtype=np.int64) * (n - SAMPLE_WINDOW)) // max(windows - 1, 1)
    flat_base, flat_target = job.base.reshape(-1), job.target.reshape(-1)
    base = np.concatenate([flat_base[s:s + SAMPLE_WINDOW] for s in starts.tolist()])
    target = np.concatenate([flat_target[s:s + SAMPLE_WINDOW] for s in starts.tolist()])
    return Job(job.name, job.dtype, base, target, int(np.count_nonzero(base != target)), job.effort)


class _Batched:
    """Tensors one method analyses together: a few compiled calls scan (and, where the kernels can,
    digest) them all, with no Python per tensor (`Method.analyse_batch`)."""

    def __init__(self, method: Method, names: list[str], base: Mapping[str, torch.Tensor],
                 target: Mapping[str, torch.Tensor], scratch: object, known: Mapping[str, bytes],
                 version: int) -> None:
        self.method = method
        self.names = names
        self.dtypes = [tensors.dtype_of(target[name], name) for name in names]
        self.shapes = [tuple(target[name].shape) for name in names]
        self.sizes = np.array([target[name].numel() for name in names], np.int64)
        hash_base = [name not in known for name in names]
        self.batch: Batch = method.analyse_batch([base[n] for n in names], [target[n] for n in names], scratch,
                                                 hash_base if not all(hash_base) else None, version)
        digests = self.batch.digest_pairs()
        if digests is None:  # kernels cannot hash here (hashing.KERNEL_DIGESTS): from Python, a second read
            digests = [(known.get(name) or digest_elements(dt.name, shape, tensors.element_view(base[name])),
                        digest_elements(dt.name, shape, tensors.element_view(target[name])))
                       for name, dt, shape in zip(names, self.dtypes, self.shapes)]
        else:
            digests = [(known.get(name, bd), td) for name, (bd, td) in zip(names, digests)]
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

    def __init__(self, name: str, base: torch.Tensor, target: torch.Tensor, plan: _Plan,
                 base_digest: bytes | None = None) -> None:
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
        self.base_digest = base_digest or digest_elements(self.dt.name, self.shape, self.host[0])

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
           format_version: int = container.CURRENT_VERSION, workers: int = 1, compiled: bool = True,
           base_digests: Mapping[str, str] | None = None) -> bytes:
    """Delta payload that turns `base` into `target`, bit for bit.

    Both map tensor names to tensors with the same names, dtypes and shapes (else
    CheckpointMismatchError). `effort` trades encode time for size: "fast", "default" or "max".
    `format_version=1` writes payloads that v1 decoders read. `workers` > 1 codes tensors on
    that many threads (the compiled kernels release the GIL). `compiled=False` runs no compiled
    kernel (codec/interim.py): a larger payload of the same format, for a host whose kernels are
    still compiling (`warm_up`).

    `base_digests`: the digests (hex, as `codec.digests` gives them) of base tensors the caller
    already knows, e.g. the target digests of the payload that made this base: the encoder then
    reads those bases to diff them but does not hash them, a third of a large step's scan. They
    are written as the records' base digests unchecked, so they must be right: a decoder verifies
    every target whatever they say, but a wrong one makes it blame the wrong base.
    """
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {EFFORTS}")
    if format_version not in container.SUPPORTED_VERSIONS:
        raise ValueError(f"format_version must be one of {container.SUPPORTED_VERSIONS}")
    _check_structure(base, target)
    _check_limits(target)
    known = _known_digests(base_digests, base)
    if not compiled:
        return interim.encode(base, target, format_version, effort, lambda fn, names: _map(workers, fn, names))
    plan = _Plan(format_version, effort)
    batched: dict[Method, list[str]] = {}
    for name, t in target.items():
        m = plan.batcher(base[name], t)
        if m is not None:
            batched.setdefault(m, []).append(name)
    jobs = [(m, group, _BUFFERS.take(m)) for m, names in batched.items() for group in _groups(names, target, workers)]
    try:
        return _encode(base, target, plan, workers, jobs, known)
    finally:
        for m, _, scratch in jobs:
            _BUFFERS.give(m, scratch)


def _known_digests(given: Mapping[str, str] | None, base: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """`encode`'s base_digests as bytes, for the tensors of `base` (ValueError if one is not a digest)."""
    known = {}
    for name, hexed in (given or {}).items():
        if name not in base:
            continue
        try:
            raw = bytes.fromhex(hexed)
        except (TypeError, ValueError):
            raw = b""
        if len(raw) != hashing.DIGEST_SIZE:
            raise ValueError(f"base_digests[{name!r}] is not a {hashing.DIGEST_SIZE}-byte hex digest: {hexed!r}")
        known[name] = raw
    return known


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
            jobs: list[tuple[Method, list[str], object]], known: Mapping[str, bytes]) -> bytes:
    """`encode` of the batches `jobs` (method, names, lent scratch) and of the tensors outside them;
    `known`: base digests given by the caller."""
    batches = _map(workers, lambda job: _Batched(job[0], job[1], base, target, job[2], known, plan.version), jobs)
    in_batches = {name for _, names, _ in jobs for name in names}
    rest = [name for name in target if name not in in_batches]
    pending = _map(workers, lambda name: _Pending(name, base[name], target[name], plan, known.get(name)), rest)
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


def _parse(base: Mapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, exact: bool = True) -> Payload:
    """The payload opened against `base`; `exact`: it must name every tensor of the base and no other (a
    partial replica's apply_(only=) may be given a part naming more). An index listing far more (twice the
    base and 64) is refused from its count, before its entries are parsed; a few too many are parsed, so
    that the refusal names a tensor the base lacks."""
    parsed = container.unpack(payload, max_entries=2 * len(base) + 64 if exact else None)
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


def _decodes_in_place(entry: Entry, version: int) -> bool:
    """Whether the record's method writes its target into the base as it decodes (`Method.decodes_in_place`)."""
    method = methods.REGISTRY.get(entry.method)
    return method is not None and method.exists_in(version) and method.decodes_in_place


def _decoded_in_place(entry: Entry, elems: np.ndarray, parsed: Payload, digest: Running | None) -> Patch:
    """The record written into `elems` as it is decoded (`Method.decode_in_place`): its positions and the
    elements they held. Every failure is a DeltaError naming the tensor, with `elems` back at the base."""
    method = methods.lookup(entry, parsed.version)
    try:
        return method.decode_in_place(entry, elems.reshape(-1), parsed.shared, digest)
    except DeltaError:
        raise
    except (ValueError, IndexError, OverflowError) as exc:  # defence in depth on forged input
        raise DeltaError(f"cannot decode ({type(exc).__name__}: {exc})", tensor=entry.name) from None


def _copy(elems: np.ndarray) -> np.ndarray:
    """A flat copy of a base's elements to build a target in, in `memory.new_elements`' memory."""
    new = memory.new_elements(elems.size, elems.dtype)
    np.copyto(new, elems.reshape(-1))
    return new


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
    new = _copy(elems)
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
        new = _copy(elems)
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
        outs.append(memory.new_tensor(entry.shape, entry.dtype.torch))  # huge pages: fewer first-touch faults
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


class _Target:
    """A live tensor apply_ writes in place: its elements (a numpy view of its own memory on the
    CPU, a same-size integer view on a device) and which memory it lives in, so that names sharing
    storage (tied weights) are written one after another, never concurrently."""

    _INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; apply_ updates contiguous tensors in place")
        if tensor.is_conj() or tensor.is_neg():  # its element view would be a copy: writes would be lost
            raise ValueError(f"tensor {name!r} is a lazy conjugate or negative view; apply_ updates plain tensors "
                             f"in place (resolve_conj() it first)")
        self.name = name
        self.tensor = tensor
        self.storage = _storage(tensor)
        self.alias = _alias(tensor)
        self.elems: np.ndarray | None = None
        self.flat: torch.Tensor | None = None
        if tensor.is_cpu:
            self.elems = tensors.element_view(tensor)  # no copy: contiguous CPU memory
        else:
            size = tensor.element_size()
            if size not in self._INT:
                raise ValueError(f"tensor {name!r}: apply_ does not support {tensor.dtype} in place on a device")
            self.flat = tensor.detach().view(-1).view(self._INT[size])

    def swap(self, index: np.ndarray, values: np.ndarray, digest: hashing.Running | None) -> int:
        """Write `values` at `index`, leaving the overwritten elements in `values` (see patching.swap_digest);
        feeds `digest` the whole tensor (CPU only). Returns the number of elements swapped."""
        if self.elems is not None:
            function, state = (digest.function, digest.state) if digest is not None else (0, 0)
            return int(patching.swap_digest(self.elems, index, values, np.uintp(function), np.uintp(state)))
        if self.flat is None:
            raise AssertionError("internal: a target with neither host elements nor a device view")
        check_index_of(self.name, index, self.flat.numel())
        idx = torch.from_numpy(np.ascontiguousarray(index, np.int64)).to(self.flat.device)
        new = torch.from_numpy(np.ascontiguousarray(values).view(_signed(values.dtype))).to(self.flat.device)
        old = self.flat[idx].cpu().numpy().view(values.dtype)
        with torch.no_grad():
            self.flat[idx] = new
        values[:] = old
        return int(index.size)

    def put(self, index: np.ndarray, values: np.ndarray, count: int) -> None:
        """elems[index[:count]] = values[:count] (an undo)."""
        if self.elems is not None:
            patching.put(self.elems, index, values, count)
            return
        if self.flat is None:
            raise AssertionError("internal: a target with neither host elements nor a device view")
        idx = torch.from_numpy(np.ascontiguousarray(index[:count], np.int64)).to(self.flat.device)
        vals = torch.from_numpy(np.ascontiguousarray(values[:count]).view(_signed(values.dtype))).to(self.flat.device)
        with torch.no_grad():
            self.flat[idx] = vals

    def digest(self, dtype: tensors.DType, shape: tuple[int, ...]) -> bytes:
        return digest_elements(dtype.name, shape, tensors.element_view(self.tensor))


def _signed(dtype: np.dtype) -> np.dtype:
    """The signed numpy twin of an unsigned element dtype (torch has no uint32/uint64 to move)."""
    return np.dtype(f"i{dtype.itemsize}") if dtype.itemsize > 1 else np.dtype(np.uint8)


def check_index_of(name: str, index: np.ndarray, numel: int) -> None:
    """Positions strictly increasing and inside the tensor, or DeltaError naming it (before a device write)."""
    if index.size and (index[0] < 0 or index[-1] >= numel or (index.size > 1 and np.any(np.diff(index) <= 0))):
        raise DeltaError("change positions are out of order or outside the tensor", tensor=name)


@dataclass
class _Write:
    """One patch written into a live tensor: its positions and the elements it overwrote."""

    target: _Target
    index: np.ndarray
    old: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.index.nbytes + self.old.nbytes)

    def undo(self) -> None:
        self.target.put(self.index, self.old, int(self.index.size))

    def compact(self) -> None:
        """Positions as int32 where the tensor allows (6 bytes per BF16 change logged instead of 10): positions
        count elements, two per item for C128."""
        elements = self.target.tensor.numel() * (2 if self.target.tensor.dtype == torch.complex128 else 1)
        if self.index.dtype != np.int32 and elements < (1 << 31):
            self.index = self.index.astype(np.int32)


class UndoLog:
    """What successive `apply_(..., undo=log)` calls overwrote, so a chain of payloads applied in place
    is all-or-nothing without a copy of the checkpoint: memory is the changed positions and their old
    elements (about 6 bytes per changed BF16 element), not the tensors.

    A call that fails restores its own writes and logs nothing; `revert()` then puts every tensor
    back to its bits before the first call that logged here. `clear()` accepts the steps (forgets).
    The log holds references to the tensors it wrote: revert writes into those same tensors.
    """

    def __init__(self) -> None:
        self._writes: list[_Write] = []
        self._aliases: dict[str, tuple] = {}  # every name a logged call covered -> its memory (tied names)
        self._views: dict[str, set[tuple]] = {}  # name -> every memory logged under it (row views of one tensor)
        self._verified: dict[str, tuple[tuple, bytes]] = {}  # name -> (memory, digest its last call verified)

    def __len__(self) -> int:
        return len(self._writes)

    @property
    def nbytes(self) -> int:
        """Bytes the log holds (positions and old elements)."""
        return sum(w.nbytes for w in self._writes)

    def _extend(self, writes: list[_Write], aliases: dict[str, tuple], digests: dict[str, bytes]) -> None:
        self._writes.extend(writes)
        self._aliases.update(aliases)
        for name, alias in aliases.items():
            self._views.setdefault(name, set()).add(alias)
        written = {w.target.storage for w in writes}
        for name in [n for n, (alias, _) in self._verified.items() if alias[0] in written and n not in digests]:
            del self._verified[name]  # its memory was written since it was verified (a tied name elsewhere)
        self._verified.update((name, (aliases[name], d)) for name, d in digests.items())

    def verified(self) -> dict[str, bytes]:
        """Each covered name's digest (codec.hashing.digest_elements) as the last logged call verified it
        against the payload's target digest, for names whose memory nothing logged has written since:
        a caller checking the result against the trainer's record need not hash those tensors again."""
        return {name: d for name, (_, d) in self._verified.items()}

    def revert(self) -> None:
        """Restore every logged tensor to its bits before the first logged call (newest writes first:
        names sharing memory come back exactly), then empty the log. Allocates nothing."""
        while self._writes:
            self._writes.pop().undo()
        self._aliases.clear()
        self._views.clear()
        self._verified.clear()

    def revert_copy(self, name: str, tensor: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Undo, in `tensor` (a CPU tensor holding the bits the logged tensor `name` holds now), what the
        logged calls wrote into `name`'s memory: `tensor` then holds `name`'s bits before the first call.
        For restoring another copy of the state (a module loaded from it) without touching the logged one.

        `source`, the live tensor `tensor` is a copy of: every logged write into its memory is undone at its
        place in it, whatever view it went through (the row ranges of a sharded step's parts). Without it,
        only writes through the one memory logged as `name` are undone, and a name logged through several
        views is a ValueError (their positions are relative to views whose place is not known here)."""
        elems = tensors.element_view(tensor)
        if not tensor.is_cpu or elems.size != tensor.numel() * tensors.elements_per_item(
                tensors.dtype_of(tensor, name)):
            raise ValueError(f"revert_copy of {name!r}: needs a contiguous CPU tensor")
        if source is not None:
            if tuple(source.shape) != tuple(tensor.shape) or source.dtype != tensor.dtype:
                raise ValueError(f"revert_copy of {name!r}: the copy is not shaped as its source")
            storage, start = _storage(source), source.data_ptr()
            end = start + source.numel() * source.element_size()
            for w in reversed(self._writes):
                t = w.target.tensor
                t_end = t.data_ptr() + t.numel() * t.element_size()
                if w.target.storage != storage or t_end <= start or t.data_ptr() >= end:
                    continue  # another memory, or none of `source`'s bytes
                # the view may start before `source` (a whole buffer over a row view) or run past it: its
                # positions are moved to `source`'s and only those inside it are undone
                offset = (t.data_ptr() - start) // elems.itemsize
                index = w.index.astype(np.int64) + offset
                inside = (index >= 0) & (index < elems.size)
                if not inside.all():
                    index, old = index[inside], w.old[:w.index.size][inside]
                else:
                    old = w.old
                patching.put(elems, index, old, int(index.size))
            return
        alias = self._aliases.get(name)
        if alias is None:
            return
        if len(self._views.get(name, ())) > 1:
            raise ValueError(f"revert_copy of {name!r}: logged through {len(self._views[name])} views of its "
                             f"memory (row ranges); pass source= (the live tensor) to place each")
        for w in reversed(self._writes):
            if w.target.alias == alias:
                patching.put(elems, w.index, w.old, int(w.index.size))

    def accept(self) -> None:
        """Forget the logged writes (they can no longer be reverted: memory back) but keep `verified()`: for a
        chain applied to tensors nobody needs back, checked at its end against a record."""
        self._writes.clear()
        self._aliases.clear()
        self._views.clear()

    def clear(self) -> None:
        """Forget every logged write (the steps are accepted)."""
        self._writes.clear()
        self._aliases.clear()
        self._views.clear()
        self._verified.clear()


def apply_(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, *,
           workers: int = 1, undo: UndoLog | None = None, only: Collection[str] | None = None) -> None:
    """Apply a payload in place (a live model's state_dict) and verify every tensor.

    On any failure every tensor is restored to its exact previous bits and DeltaError is raised.
    Extra memory is the changed elements' positions and old values, not a copy of the checkpoint.
    `workers` > 1 decodes, writes and verifies tensors on that many threads (the kernels release
    the GIL; names sharing memory stay on one thread). With `undo`, a successful call logs what it
    overwrote there, so `undo.revert()` can take a whole chain of calls back exactly. With `only`, just
    the records of those names are applied (and verified), each of which the payload must hold; the
    mapping may then hold only some of the payload's tensors (streaming a checkpoint tensor by tensor).
    """
    try:
        _apply(tensors_, payload, max(1, workers), undo, only)
    except MemoryError:  # apply_ has restored every tensor by the time the error leaves _apply
        raise DeltaError(_OUT_OF_MEMORY) from None


def _map_all(workers: int, fn, items: list) -> list[BaseException | None]:
    """fn over every item (on `workers` threads if more than one), each to completion; the exception of
    each item (None where it succeeded). Serially, it stops at the first failure. Never returns while
    an item still runs, so the caller may undo what the items did."""
    if workers <= 1 or len(items) <= 1:
        out: list[BaseException | None] = []
        for item in items:
            try:
                fn(item)
                out.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which undoes and re-raises
                out.append(exc)
                break
        return out
    futures = [_pool(workers).submit(fn, item) for item in items]
    try:
        wait(futures)
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)  # the running ones finish before the caller undoes their writes
        raise
    return [None if f.cancelled() else f.exception() for f in futures]


def _apply(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, workers: int,
           undo: UndoLog | None, only: Collection[str] | None) -> None:
    parsed = _parse(tensors_, payload, exact=only is None)
    if only is not None:
        wanted = set(only)
        missing = wanted - {e.name for e in parsed.entries}
        if missing:
            raise DeltaError(f"the delta does not name tensors {sorted(missing)[:5]}")
        parsed = Payload(parsed.version, [e for e in parsed.entries if e.name in wanted], parsed.shared)
    views = {entry.name: _base_view(entry, tensors_.get(entry.name)) for entry in parsed.entries}
    changed = [e for e in parsed.entries if not _unchanged(e)]
    targets = {e.name: _Target(e.name, tensors_[e.name]) for e in changed}  # refuses strided ones now
    groups: dict[tuple, list[Entry]] = {}
    for entry in changed:
        groups.setdefault(targets[entry.name].storage, []).append(entry)
    # A record whose method decodes in place, into a CPU tensor no other written name shares, is decoded
    # and written in one pass (step 2): one read of the tensor instead of two. Its failure restores it.
    fused = {e.name for e in changed if _decodes_in_place(e, parsed.version) and targets[e.name].elems is not None
             and len(groups[targets[e.name].storage]) == 1}
    # 1. Every other check that needs no write, and every other patch decoded, before the first write:
    # names that share storage (tied weights) must not see each other's writes, and a bad stream or a wrong
    # base is refused with nothing touched. Largest first, so one big tensor does not start last.
    patches: dict[str, Patch] = {}

    def prepare(entry: Entry) -> None:
        elems = views[entry.name]
        if entry.name in fused:
            return
        if _unchanged(entry):
            if not _base_matches(entry, elems):
                raise DeltaError(_WRONG_BASE, tensor=entry.name)
            _patch(entry, elems, parsed)  # validates the record (no data, equal digests)
            return
        try:
            patch = _patch(entry, elems, parsed)
        except DeltaError as exc:
            raise _explain(entry, elems, exc) from None
        # the swap leaves the old elements in `values`: it must be this tensor's element type, and writable
        patches[entry.name] = Patch(np.ascontiguousarray(patch.index, np.int64),
                                    np.require(patch.values, elems.dtype, ["C", "W"]))

    order = sorted(parsed.entries, key=lambda e: -e.numel) if workers > 1 else parsed.entries
    failure = next((exc for exc in _map_all(workers, prepare, order) if exc is not None), None)
    if failure is not None:
        raise failure
    # 2. Swap each patch in (or decode a fused record in place) and verify the tensor in the same pass; one
    # job per memory (storage).
    jobs = sorted(groups.values(), key=lambda g: -sum(e.numel for e in g))
    logs: list[list[_Write]] = [[] for _ in jobs]

    def write(i: int) -> None:
        for entry in jobs[i]:
            target = targets[entry.name]
            digest = running(entry.dtype.name, entry.shape) if target.elems is not None else None
            if entry.name in fused and target.elems is not None:
                patch = _decoded_in_place(entry, target.elems, parsed, digest)  # restores the tensor if it fails
                logs[i].append(_Write(target, patch.index, patch.values))  # the old elements
                if patch.count != entry.changes:
                    raise DeltaError(f"decoded {patch.count} changes, index says {entry.changes}", tensor=entry.name)
            else:
                patch = patches[entry.name]
                count = target.swap(patch.index, patch.values, digest)
                if count != patch.count:  # positions out of order or outside: undo this partial swap now
                    target.put(patch.index, patch.values, count)
                    raise DeltaError("change positions are out of order or outside the tensor", tensor=entry.name)
                logs[i].append(_Write(target, patch.index, patch.values))  # values now hold the old elements
            if undo is not None:  # kept beyond this call: the smaller form, made here on the workers
                try:
                    logs[i][-1].compact()
                except MemoryError:  # the log stays exact in int64
                    pass
            got = digest.digest() if digest is not None else target.digest(entry.dtype, entry.shape)
            if got != entry.target_digest:
                raise DeltaError("reconstruction does not match the target digest", tensor=entry.name)

    try:
        errors = _map_all(workers, write, list(range(len(jobs))))
        failure = next((exc for exc in errors if exc is not None), None)
        if failure is None:
            failure = _check_shared_memory(tensors_, parsed.entries, set(groups))
    except BaseException:
        _undo_all(logs)
        raise
    if failure is not None:
        _undo_all(logs)
        if isinstance(failure, DeltaError) and failure.tensor in views:  # restored: now say why it failed
            entry = next(e for e in parsed.entries if e.name == failure.tensor)
            raise _explain(entry, tensors.element_view(tensors_[entry.name]), failure) from None
        raise failure
    if undo is not None:
        writes = [w for log in logs for w in log]  # compacted by `write`, on the workers
        undo._extend(writes, {e.name: _alias(tensors_[e.name]) for e in parsed.entries},
                     {e.name: e.target_digest for e in parsed.entries})


def _undo_all(logs: list[list[_Write]]) -> None:
    """Every write undone, each memory's newest first (groups are disjoint memories)."""
    for log in logs:
        while log:
            log.pop().undo()


def _check_shared_memory(tensors_: Mapping[str, torch.Tensor], entries: list[Entry],
                         written: set[tuple]) -> DeltaError | None:
    """Names that share memory with a written tensor (tied weights) are verified again once every write
    is done: a payload whose records disagree about one memory must not leave an alias unverified."""
    shared: dict[tuple, list[Entry]] = {}
    for e in entries:
        key = _storage(tensors_[e.name])
        if key in written:
            shared.setdefault(key, []).append(e)
    for group in shared.values():
        if len(group) < 2:
            continue
        for e in group:
            if digest_elements(e.dtype.name, e.shape, tensors.element_view(tensors_[e.name])) != e.target_digest:
                return DeltaError("reconstruction does not match the target digest (a name sharing its memory "
                                  "with another was written differently)", tensor=e.name)
    return None


def _storage(t: torch.Tensor) -> tuple:
    """Which memory a tensor lives in: names with the same key must not be written concurrently."""
    return (str(t.device), t.untyped_storage().data_ptr())


def _alias(t: torch.Tensor) -> tuple:
    """Which tensor (memory, offset, dtype, shape) a name is: tied names have the same key."""
    return (_storage(t), t.data_ptr(), t.dtype, tuple(t.shape))
