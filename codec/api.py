"""encode / decode / apply_: the codec's public entry points over mappings of tensors."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import container, device, hashing, methods, tensors
from .container import Entry, Payload
from .errors import CheckpointMismatchError, DeltaError
from .hashing import Running, digest_bytes, digest_elements, header_bytes, running
from .methods import conditional, exponent_classes, same, sparse, xor_planes
from .methods.base import Patch

EFFORTS = ("fast", "default", "max")
DENSE_FRACTION = 0.25  # above this changed fraction, also try the dense XOR path


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


def _encode_tensor(b: np.ndarray, t: np.ndarray, dt: tensors.DType, changes: int, index: np.ndarray | None,
                   effort: str, analysis: conditional.Analysis | None,
                   model: conditional.ValueModel | None, four_from: int = conditional.NEVER) -> _Candidate:
    """Per tensor, the smallest of the methods worth trying at this effort.

    BF16 tensors try the conditional method alone unless their changes are dense (where the XOR
    planes can win) or effort is "max": racing general-purpose compressors on ~100 small tensors
    costs more encode time than the bytes it might save. `index` (the changed positions) may be
    None: the sparse method then finds them itself.
    """
    cands: list[_Candidate] = []
    dense = changes > DENSE_FRACTION * b.size
    if analysis is not None and model is not None:
        cands.append(_Candidate(conditional.ID, *conditional.encode(analysis, model, four_from)))
    if dt is tensors.BF16 and (analysis is None or dense or effort == "max"):
        cands.append(_Candidate(sparse.ID, *sparse.encode(b, t, effort, index)))
    if dt is not tensors.BF16 or dense or effort == "max":
        cands.append(_Candidate(xor_planes.ID, *xor_planes.encode(b, t, effort)))
    return min(cands, key=lambda c: c.size)


def _batchable(base: torch.Tensor, target: torch.Tensor) -> bool:
    return target.dtype == torch.bfloat16 and target.is_cpu and base.is_cpu


def _elements_at(t: torch.Tensor, keep: list) -> int:
    """Address of a CPU tensor's elements, readable in whole blocks of 64 elements: its own
    memory where it is contiguous and whole blocks, else a padded copy, which `keep` holds."""
    if t.is_contiguous() and t.numel() % exponent_classes.BLOCK == 0:
        keep.append(t)
        return t.data_ptr()
    copy = exponent_classes.blocks(np.ascontiguousarray(tensors.element_view(t)))
    keep.append(copy)
    return copy.ctypes.data


class _Batched:
    """BF16 CPU tensors analysed together: one compiled call scans (and, where the kernels can,
    digests) them all, with no Python per tensor (`conditional.analyze_at`)."""

    def __init__(self, names: list[str], base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor],
                 buffers: exponent_classes.ScanBuffers) -> None:
        self.names = names
        self.shapes = [tuple(target[name].shape) for name in names]
        self.sizes = np.array([target[name].numel() for name in names], np.int64)
        keep: list = []
        where = np.array([(_elements_at(base[name], keep), _elements_at(target[name], keep)) for name in names],
                         np.uintp).reshape(-1, 2)
        headers = [header_bytes(tensors.BF16.name, shape) for shape in self.shapes] if hashing.KERNEL_DIGESTS else None
        self.batch = conditional.analyze_at(where, self.sizes, headers, buffers)
        del keep  # the scan is done with the tensors' memory
        if self.batch.digests is not None:
            blob = digest_bytes(self.batch.digests)
            self.digests = [(blob[32 * i: 32 * i + 16], blob[32 * i + 16: 32 * i + 32]) for i in range(len(names))]
        else:  # kernels cannot hash here (hashing.KERNEL_DIGESTS): from Python, a second read
            self.digests = [tuple(digest_elements(tensors.BF16.name, shape, tensors.element_view(m[name]))
                                  for m in (base, target)) for name, shape in zip(names, self.shapes)]

    def entries(self, base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], effort: str,
                model: conditional.ValueModel | None, four_from: int) -> list[Entry]:
        """The batch's records: sparse tensors coded together where the batch holds their changes
        (one compiled call); dense ones, and every one at "max" effort, race methods one by one."""
        changes = self.batch.changes()
        sparse_ = (changes > 0) & (changes <= DENSE_FRACTION * self.sizes)
        together = np.flatnonzero(sparse_) if effort != "max" else np.zeros(0, np.int64)
        coded = {}
        if together.size and model is not None:
            coded = dict(zip(together.tolist(), conditional.encode_batch(self.batch, together, model, four_from)))
        out = []
        for i, (name, shape, (bd, td)) in enumerate(zip(self.names, self.shapes, self.digests)):
            k = int(changes[i])
            if not k:
                out.append(Entry(name, tensors.BF16, shape, same.ID, 0, bd, bd))
                continue
            if i in coded:
                c = _Candidate(conditional.ID, *coded[i])
            else:
                b, t = tensors.element_view(base[name]), tensors.element_view(target[name])
                c = _encode_tensor(b, t, tensors.BF16, k, None, effort, self.batch.analysis(i), model, four_from)
            out.append(Entry(name, tensors.BF16, shape, c.method, k, bd, td, c.params, c.streams))
        return out

    def value_symbols(self) -> np.ndarray:
        return self.batch.value_symbols


class _BufferPool:
    """Scan buffers lent to the batches of encode calls and taken back when the payload is packed
    (`exponent_classes.ScanBuffers`: reused memory takes no page faults). Holds a few sets, of
    at most KEEP bytes each; larger ones go back to the allocator."""

    KEEP = 256 << 20
    SETS = 4

    def __init__(self) -> None:
        self._free: list[exponent_classes.ScanBuffers] = []
        self._lock = threading.Lock()

    def take(self) -> exponent_classes.ScanBuffers:
        with self._lock:
            return self._free.pop() if self._free else exponent_classes.ScanBuffers()

    def give(self, buffers: exponent_classes.ScanBuffers) -> None:
        if buffers.nbytes <= self.KEEP:
            with self._lock:
                if len(self._free) < self.SETS:
                    self._free.append(buffers)


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

    def __init__(self, name: str, base: torch.Tensor, target: torch.Tensor, use_conditional: bool) -> None:
        self.name = name
        self.dt = tensors.dtype_of(target, name)
        self.shape = tuple(target.shape)
        self._tensors = (base, target)
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self.analysis: conditional.Analysis | None = None
        on_device = target.device.type != "cpu" and base.device == target.device
        self.index: np.ndarray | None = None
        if use_conditional and self.dt is tensors.BF16 and on_device:
            self.analysis = device.analyze_on_device(base, target)
            self.index = self.analysis.index
        elif use_conditional and self.dt is tensors.BF16:  # on two devices: analysed from host copies
            self.analysis = conditional.analyze(*self.host)
        else:
            b, t = self.host
            self.index = exponent_classes.differences(b, t) if b.dtype == np.uint16 else np.flatnonzero(b != t)
        self.changes = self.analysis.changes if self.index is None else int(self.index.size)
        self.base_digest = digest_elements(self.dt.name, self.shape, self.host[0])

    @property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host is None:
            self._host = (tensors.element_view(self._tensors[0]), tensors.element_view(self._tensors[1]))
        return self._host

    def entry(self, effort: str, model: conditional.ValueModel | None, four_from: int) -> Entry:
        if not self.changes:
            return Entry(self.name, self.dt, self.shape, same.ID, 0, self.base_digest, self.base_digest)
        b, t = self.host
        c = _encode_tensor(b, t, self.dt, self.changes, self.index, effort, self.analysis, model, four_from)
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
    use_conditional = format_version >= conditional.MIN_VERSION
    batched = [name for name, t in target.items() if use_conditional and _batchable(base[name], t)]
    groups = _groups(batched, target, workers)
    lent = [_BUFFERS.take() for _ in groups]
    try:
        return _encode(base, target, effort, format_version, workers, list(zip(groups, lent)))
    finally:
        for buffers in lent:
            _BUFFERS.give(buffers)


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


def _encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], effort: str, format_version: int,
            workers: int, jobs: list[tuple[list[str], exponent_classes.ScanBuffers]]) -> bytes:
    """`encode` of the batches `jobs` (names, lent buffers) and of the tensors outside them."""
    use_conditional = format_version >= conditional.MIN_VERSION
    batches = _map(workers, lambda job: _Batched(job[0], base, target, job[1]), jobs)
    in_batches = {name for names, _ in jobs for name in names}
    rest = [name for name in target if name not in in_batches]
    pending = _map(workers, lambda name: _Pending(name, base[name], target[name], use_conditional), rest)
    symbols = [b.value_symbols() for b in batches]
    symbols += [p.analysis.value_symbols for p in pending if p.analysis is not None and p.changes]
    model = conditional.ValueModel.fit_symbols(symbols) if any(s.size for s in symbols) else None
    # v3: records with many changes use four interleaved rANS states (the payload states the rule)
    four_from = conditional.FOUR_STATES_FROM if format_version >= 3 else conditional.NEVER
    coded = {e.name: e for group in _map(workers, lambda b: b.entries(base, target, effort, model, four_from), batches)
             for e in group}
    coded.update((e.name, e) for e in _map(workers, lambda p: p.entry(effort, model, four_from), pending))
    entries = [coded[name] for name in target]
    shared = {}
    if model is not None and any(e.method == conditional.ID for e in entries):
        shared[conditional.SHARED_VALUE_TABLES] = model.pack()
        if four_from < conditional.NEVER:
            shared[conditional.SHARED_INTERLEAVE] = conditional.interleave_rule(four_from)
    return container.pack(Payload(format_version, entries, shared))


def _base_view(entry: Entry, tensor: torch.Tensor | None) -> np.ndarray:
    """The base tensor's elements after checking name, dtype and shape (its digest is checked lazily)."""
    if tensor is None:
        raise DeltaError("the base has no such tensor (delta made for another checkpoint)", tensor=entry.name)
    if tensor.dtype != entry.dtype.torch or tuple(tensor.shape) != entry.shape:
        raise DeltaError(f"base is {tensor.dtype} {tuple(tensor.shape)}, delta expects {entry.dtype.torch} {entry.shape}",
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
    if parsed.version < 3 and conditional.SHARED_INTERLEAVE in parsed.shared:
        raise DeltaError(f"a v{parsed.version} payload carries an interleave rule (a v3 field)")
    names = {e.name for e in parsed.entries}
    extra = [k for k in base if k not in names]
    if extra:
        raise DeltaError(f"base holds tensors the delta does not name ({', '.join(sorted(extra)[:5])}): wrong base")
    return parsed


def _decoded(entry: Entry, elems: np.ndarray, parsed: Payload, with_target: bool,
             digest: Running | None = None) -> tuple[int, Patch | None, np.ndarray | None]:
    """(changes, patch, target) of one entry, every failure a DeltaError naming the tensor. With
    with_target, methods that build the target while decoding (`decode_target`) do so (no copy of
    the base beforehand, no scatter, no patch; they feed `digest` the target as they finish it),
    the others' patch is applied to a copy."""
    module = methods.lookup(entry, parsed.version)
    build = getattr(module, "decode_target", None) if with_target else None
    patch = new = None
    try:
        if build is not None:
            count, new = build(entry, elems, parsed.shared, digest)
        else:
            patch = module.decode(entry, elems, parsed.shared)
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
    return _decoded(entry, elems, parsed, False)[1]


def _target_digest(entry: Entry, elems: np.ndarray, parsed: Payload) -> tuple[np.ndarray, bytes]:
    """The entry's whole reconstructed tensor, flat, and its digest: fed part by part while the
    decoder builds it, where the method and the kernels can (`hashing.running`), else computed
    afterwards."""
    digest = running(entry.dtype.name, entry.shape)
    _, patch, new = _decoded(entry, elems, parsed, True, digest)
    if new is not None:
        return new, digest.digest() if digest is not None else digest_elements(entry.dtype.name, entry.shape, new)
    new = elems.reshape(-1).copy()
    new[patch.index] = patch.values
    return new, digest_elements(entry.dtype.name, entry.shape, new)


def _decode_entry(base: Mapping[str, torch.Tensor], entry: Entry, parsed: Payload) -> torch.Tensor:
    elems = _base_view(entry, base.get(entry.name))
    if entry.method == same.ID:
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
            raise _explain(entry, elems, DeltaError("reconstruction does not match the target digest", tensor=entry.name))
    return tensors.tensor_from_elements(new, entry.dtype, entry.shape, copy=False)


def _decode_batched(base: Mapping[str, torch.Tensor], parsed: Payload, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The verified targets of conditional records over CPU BF16 bases, decoded in one compiled
    call straight into new tensors (`conditional.decode_at`). One that fails is left out:
    `_decode_entry` then decodes it alone and says why."""
    keep: list = []
    chosen, where, outs = [], [], []
    for entry in entries:
        tensor = base.get(entry.name)
        if tensor is None or not tensor.is_cpu or tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != entry.shape:
            continue
        out = torch.empty(entry.shape, dtype=torch.bfloat16)
        chosen.append(entry)
        outs.append(out)
        where.append((_elements_at(tensor, keep), out.data_ptr()))
    if not chosen:
        return {}
    headers = [header_bytes(e.dtype.name, e.shape) for e in chosen] if hashing.KERNEL_DIGESTS else None
    result = conditional.decode_at(chosen, np.array(where, np.uintp).reshape(-1, 2), parsed.shared, headers)
    del keep
    if result is None:
        return {}
    decoded, status, halves = result
    blob = digest_bytes(halves) if halves is not None else None
    done = {}
    for i, (entry, out) in enumerate(zip(chosen, outs)):
        if status[i] or decoded[i] != entry.changes:
            continue
        if blob is not None:
            digest = blob[16 * i: 16 * i + 16]
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
    batched = [e for e in parsed.entries if e.method == conditional.ID and conditional.batchable(e)]
    by_name = {e.name: e for e in batched}
    done: dict[str, torch.Tensor] = {}
    for part in _map(workers, lambda names: _decode_batched(base, parsed, [by_name[n] for n in names]),
                     _groups(list(by_name), by_name, workers, lambda e: e.numel)):
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


def apply_(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview) -> None:
    """Apply a payload in place (a live model's state_dict) and verify every tensor.

    On any failure every tensor is restored to its exact previous bits and DeltaError is raised.
    Extra memory is an undo log of the changed elements, not a copy of the checkpoint.
    """
    try:
        _apply(tensors_, payload)
    except MemoryError:  # apply_ has restored every tensor by the time the error leaves _apply
        raise DeltaError(_OUT_OF_MEMORY) from None


def _apply(tensors_: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview) -> None:
    parsed = _parse(tensors_, payload)
    views = {entry.name: _base_view(entry, tensors_.get(entry.name)) for entry in parsed.entries}
    for entry in parsed.entries:  # unchanged tensors are verified up front; changed ones after writing
        if entry.method == same.ID:
            if not _base_matches(entry, views[entry.name]):
                raise DeltaError(_WRONG_BASE, tensor=entry.name)
            _patch(entry, views[entry.name], parsed)  # validates the record (no data, equal digests)
    # Decode every patch before the first write: names that share storage (tied weights) must
    # not see each other's writes, and a bad stream is refused with nothing touched.
    patches = []
    for entry in parsed.entries:
        if entry.method == same.ID:
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
            entry = next(e for e in parsed.entries if e.name == exc.tensor)
            raise _explain(entry, tensors.element_view(tensors_[entry.name]), exc) from None
        raise
