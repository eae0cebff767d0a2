"""encode / decode / apply_: the codec's public entry points over mappings of tensors."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import container, device, methods, tensors
from .container import Entry, Payload
from .errors import CheckpointMismatchError, DeltaError
from .hashing import Running, digest_elements, running
from .methods import conditional, exponent_classes, same, sparse, xor_planes
from .methods.base import Patch

EFFORTS = ("fast", "default", "max")
DENSE_FRACTION = 0.25  # above this changed fraction, also try the dense XOR path
# BF16 tensors up to this many elements (norm weights, biases) are analysed and coded in batches:
# one compiled call each for all of them, instead of two per tensor and their Python wrappers
SMALL_TENSOR = 1 << 14


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


def _small(base: torch.Tensor, target: torch.Tensor) -> bool:
    return (target.dtype == torch.bfloat16 and target.device.type == "cpu" and base.device.type == "cpu"
            and 0 < target.numel() <= SMALL_TENSOR)


class _Pending:
    """One tensor on its way into the payload; host copies of device tensors are made on demand."""

    batched = False  # analysed with other small tensors (`batch`): coded with them too

    def __init__(self, name: str, base: torch.Tensor, target: torch.Tensor, use_conditional: bool) -> None:
        self.name = name
        self.dt = tensors.dtype_of(target, name)
        self.shape = tuple(target.shape)
        self._tensors = (base, target)
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self.analysis: conditional.Analysis | None = None
        self.target_digest: bytes | None = None
        on_device = target.device.type != "cpu" and base.device == target.device
        if use_conditional and self.dt is tensors.BF16 and not on_device:
            # both digests fed by the scan, part by part while in cache: one read of each tensor
            b, t = (a.reshape(-1) for a in self.host)
            hb, ht = running(self.dt.name, self.shape), running(self.dt.name, self.shape)
            self.analysis = conditional.analyze(b, t, (hb, ht) if hb and ht else None)
            self.index: np.ndarray | None = None  # the scan does not keep positions; sparse finds them if asked
            self.changes = self.analysis.changes
            if hb and ht:
                self.base_digest, self.target_digest = hb.digest(), ht.digest()
            else:  # kernels cannot hash here (hashing.NATIVE): from Python, a second read
                self.base_digest = digest_elements(self.dt.name, self.shape, b)
                self.target_digest = digest_elements(self.dt.name, self.shape, t)
            return
        if use_conditional and self.dt is tensors.BF16:
            self.analysis = device.analyze_on_device(base, target)
            self.index = self.analysis.index
        else:
            b, t = self.host
            self.index = exponent_classes.differences(b, t) if b.dtype == np.uint16 else np.flatnonzero(b != t)
        self.changes = int(self.index.size)
        self.base_digest = digest_elements(self.dt.name, self.shape, self.host[0])

    @classmethod
    def batch(cls, names: list[str], base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
              ) -> dict[str, _Pending]:
        """Small BF16 CPU tensors (`_small`), analysed in one compiled call."""
        if not names:
            return {}
        hosts = [(tensors.element_view(base[n]), tensors.element_view(target[n])) for n in names]
        out = {}
        for name, host, analysis in zip(names, hosts, conditional.analyze_many(*zip(*hosts))):
            p = cls.__new__(cls)
            p.name, p.dt, p.shape = name, tensors.BF16, tuple(target[name].shape)
            p._tensors, p._host = (base[name], target[name]), host
            p.analysis, p.index, p.changes, p.batched = analysis, None, analysis.changes, True
            p.base_digest = digest_elements(p.dt.name, p.shape, host[0])
            p.target_digest = digest_elements(p.dt.name, p.shape, host[1])
            out[name] = p
        return out

    @property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host is None:
            self._host = (tensors.element_view(self._tensors[0]), tensors.element_view(self._tensors[1]))
        return self._host


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

    def prepare(item: tuple[str, torch.Tensor]) -> _Pending:
        return _Pending(item[0], base[item[0]], item[1], use_conditional)

    def run(fn, items):  # threads only when asked for: one core means no pool overhead either
        if workers <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, items))

    small = {name for name, t in target.items() if use_conditional and _small(base[name], t)}
    ready = _Pending.batch([name for name in target if name in small], base, target)
    rest = dict(zip((name for name in target if name not in small),
                    run(prepare, [item for item in target.items() if item[0] not in small])))
    pending = [ready[name] if name in small else rest[name] for name in target]
    analyses = [p.analysis for p in pending if p.analysis is not None and p.changes]
    model = conditional.ValueModel.fit(analyses) if analyses else None
    # the batch's sparse tensors are coded together; dense ones (and every one at "max") race methods
    together = [p for p in pending if p.batched and p.changes and effort != "max"
                and p.changes <= DENSE_FRACTION * p.host[0].size]
    # v3: records with many changes use four interleaved rANS states (the payload states the rule)
    four_from = conditional.FOUR_STATES_FROM if format_version >= 3 else conditional.NEVER
    coded = dict(zip((p.name for p in together),
                     conditional.encode_many([p.analysis for p in together], model, four_from))) if together else {}

    def code(p: _Pending) -> Entry:
        if not p.changes:
            return Entry(p.name, p.dt, p.shape, same.ID, 0, p.base_digest, p.base_digest)
        b, t = p.host
        if p.name in coded:
            c = _Candidate(conditional.ID, *coded[p.name])
        else:
            c = _encode_tensor(b, t, p.dt, p.changes, p.index, effort, p.analysis, model, four_from)
        td = p.target_digest if p.target_digest is not None else digest_elements(p.dt.name, p.shape, t)
        return Entry(p.name, p.dt, p.shape, c.method, p.changes, p.base_digest, td, c.params, c.streams)

    entries = run(code, pending)
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


def _decode_small(base: Mapping[str, torch.Tensor], parsed: Payload) -> dict[str, torch.Tensor]:
    """The verified targets of the payload's small conditional tensors, decoded in one compiled
    call. One that fails is left out: `_decode_entry` then decodes it alone and says why."""
    small = [e for e in parsed.entries if e.method == conditional.ID and e.dtype is tensors.BF16
             and 0 < e.numel <= SMALL_TENSOR and e.changes]
    if not small:
        return {}
    views = [_base_view(e, base.get(e.name)) for e in small]
    done = {}
    for entry, result in zip(small, conditional.decode_targets(small, views, parsed.shared)):
        if result is None or result[0] != entry.changes:
            continue
        new = result[1]
        if digest_elements(entry.dtype.name, entry.shape, new) == entry.target_digest:
            done[entry.name] = tensors.tensor_from_elements(new, entry.dtype, entry.shape, copy=False)
    return done


def decode(base: Mapping[str, torch.Tensor], payload: bytes | bytearray | memoryview, *,
           workers: int = 1) -> dict[str, torch.Tensor]:
    """The target checkpoint, every tensor verified against the trainer's digest.

    Raises DeltaError, producing nothing, if the payload is corrupt or made for another base.
    `workers` > 1 decodes tensors on that many threads (the compiled kernels release the GIL).
    """
    parsed = _parse(base, payload)
    done = _decode_small(base, parsed)
    rest = [entry for entry in parsed.entries if entry.name not in done]
    if workers <= 1:
        done.update((entry.name, _decode_entry(base, entry, parsed)) for entry in rest)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            # largest first, so one big tensor does not start last
            order = sorted(rest, key=lambda e: -e.numel)
            done.update(zip((e.name for e in order), pool.map(lambda e: _decode_entry(base, e, parsed), order)))
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

    def _put(self, index: np.ndarray, values: np.ndarray) -> None:
        idx = torch.from_numpy(index).to(self.flat.device)
        vals = torch.from_numpy(np.ascontiguousarray(values).view(self.np_dtype)).to(self.flat.device)
        with torch.no_grad():
            self.flat[idx] = vals

    def write(self, patch: Patch) -> np.ndarray:
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
