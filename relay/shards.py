"""Reader-side pieces of sharded runs and partial replicas (docs/PROTOCOL.md §3.2, §3.3, §6).

A sharded trainer's step has one delta part per rank, and a part may cover only some rows
(dimension 0) of a tensor (`Part.rows`); its snapshot has one set of files per rank, where a file
holds a row slice under the tensor's name and says which rows in its safetensors metadata. These
helpers turn such objects into targets for `codec.apply_` and into whole tensors, and refuse
anything that does not tile every tensor exactly (overlaps, gaps, rows out of range), naming the
object and the reason: whoever can write the bucket must not be able to make a reader apply a
slice twice or leave rows unverified. They also tell a partial replica which objects it needs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

import codec
from relay.checkpoint import HEADER_BYTES_PER_ITEM, MAX_HEADER_BYTES, HeaderBound, header_bound, tensor_bytes
from relay.manifest import (MAX_RECORD_BYTES, ManifestError, ObjRef, Part, Snapshot, TensorInfo, load_json,
                            safe_shard_name)

ROWS_KEY = "rows"  # safetensors metadata of a snapshot file holding row slices: JSON {name: [start, stop]}
SLICES_KEY = "slices"  # the snapshot index's metadata: {name: [[start, stop, file], ...]} for sliced tensors

Selector = Callable[[str], bool]


class ShardError(ValueError):
    """Objects (by reference) that do not tile a step's tensors, or whose slices do not fit them."""

    def __init__(self, refs: list[ObjRef], reason: str) -> None:
        super().__init__(reason)
        self.refs = refs


def selector(tensors: Any) -> Selector | None:
    """A partial replica's selection as a predicate: None (every tensor), a predicate, or names."""
    if tensors is None:
        return None
    if callable(tensors):
        return tensors
    if isinstance(tensors, str):
        raise TypeError("tensors: give a list of names or a predicate, not one string")
    names = frozenset(tensors)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError("tensors: a non-empty collection of tensor names, or a predicate")
    return names.__contains__


def needs_part(part: Part, want: Selector | None) -> bool:
    """Whether a reader that holds the tensors `want` selects must download `part`."""
    return want is None or part.tensors is None or any(want(n) for n in part.tensors)


def check_tiling(step: int, parts: Iterable[Part], tensors: Mapping[str, torch.Tensor]) -> None:
    """The parts of `step` cover every tensor of `tensors` exactly once: whole, or by row ranges that
    tile its rows with no overlap and no gap. ShardError naming the tensor and the parts otherwise."""
    parts = list(parts)
    refs = [p.ref for p in parts]
    if any(p.tensors is None for p in parts):
        if len(parts) > 1:
            raise ShardError(refs, f"step {step}: a part covering every tensor is not the only part")
        return
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for p in parts:
        for name in p.tensors or ():
            if name not in tensors:
                continue  # a tensor this reader does not hold (a partial replica); the head check covers the rest
            rows = (p.rows or {}).get(name)
            n = tensors[name].shape[0] if tensors[name].dim() else 0
            if rows is None:
                rows = (0, n)
            elif not tensors[name].dim() or rows[1] > n:
                raise ShardError(refs, f"step {step}: {p.ref.key} covers rows {list(rows)} of {name!r}, "
                                       f"which has {n} rows")
            ranges.setdefault(name, []).append((*rows, p.ref.key))
    for name, t in tensors.items():
        got = sorted(ranges.get(name, []))
        n = t.shape[0] if t.dim() else 0
        if not got:
            raise ShardError(refs, f"step {step}: no part covers tensor {name!r}")
        pos = 0
        for start, stop, key in got:
            if start != pos:
                what = "overlap at" if start < pos else "gap before"
                raise ShardError(refs, f"step {step}: the parts' rows of {name!r} {what} row {start} ({key})")
            pos = stop
        if pos != n:
            raise ShardError(refs, f"step {step}: the parts cover rows 0-{pos} of {name!r}, which has {n} rows")


def part_targets(part: Part, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `codec.apply_` updates for `part`: each covered tensor this reader holds, or for a row
    range the view tensors[name][start:stop] (contiguous, so the payload writes straight into the
    held tensor). Call check_tiling on the step first: it refuses ranges outside a tensor."""
    if part.tensors is None:
        return dict(tensors)
    rows = part.rows or {}
    out = {}
    for name in part.tensors:
        if name not in tensors:
            continue
        r = rows.get(name)
        out[name] = tensors[name] if r is None else tensors[name][r[0]:r[1]]
    return out


def _header(data: bytes, ref: ObjRef, bound: HeaderBound | None = None) -> dict:
    """A safetensors file's JSON header, parsed from its bytes; ShardError naming the file if it has none, or
    one over `bound` (header_bound of its step's record: refused before it is parsed)."""
    where = ref.key
    if len(data) < 8:
        raise ShardError([ref], f"{where}: not a safetensors file (shorter than its header size)")
    n = int.from_bytes(data[:8], "little")
    if bound is not None and n > bound.nbytes:
        raise ShardError([ref], f"{where}: safetensors header of {n} bytes, more than the {bound.nbytes} a file of "
                                f"its step's record may have")
    if n > min(len(data) - 8, MAX_HEADER_BYTES):
        raise ShardError([ref], f"{where}: not a safetensors file (header of {n} bytes)")
    try:
        header = load_json(bytes(data[8:8 + n]), f"{where}: safetensors header", MAX_HEADER_BYTES,
                           HEADER_BYTES_PER_ITEM, None if bound is None else bound.items)
    except ManifestError as exc:
        raise ShardError([ref], f"{where}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ShardError([ref], f"{where}: unreadable safetensors header (not an object)")
    return header


def file_rows(data: bytes, ref: ObjRef, bound: HeaderBound | None = None) -> dict[str, tuple[int, int]]:
    """The row ranges a snapshot file's safetensors metadata gives its slices ({} for whole tensors)."""
    return metadata_rows(_header(data, ref, bound).get("__metadata__") or {}, ref)


def file_names(data: bytes, ref: ObjRef, bound: HeaderBound | None = None) -> set[str]:
    """The tensors a snapshot file holds, from its header alone (safetensors) or its trailer and index (a
    compressed snapshot object): what its snapshot's index must map to it."""
    if bytes(data[:4]) == codec.SNAPSHOT_MAGIC:
        try:
            return {e.name for e in codec.read_snapshot_index(bytes(data), where=ref.key)}
        except codec.SnapshotError as exc:
            raise ShardError([ref], f"not a snapshot file ({exc})") from None
    return {k for k in _header(data, ref, bound) if k != "__metadata__"}


def metadata_rows(meta: Any, ref: ObjRef) -> dict[str, tuple[int, int]]:
    """The row ranges in a snapshot file's safetensors metadata (the `__metadata__` mapping, as
    relay.checkpoint's strict reader returns it): {} for a file of whole tensors."""
    where = ref.key
    try:
        raw = load_json(meta[ROWS_KEY], f"{where}: {ROWS_KEY}", MAX_HEADER_BYTES) if ROWS_KEY in meta else {}
    except (ManifestError, AttributeError, TypeError) as exc:
        raise ShardError([ref], f"{where}: unreadable safetensors metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict):
        raise ShardError([ref], f"{where}: metadata {ROWS_KEY!r} is not an object")
    out = {}
    for name, r in raw.items():
        if (not isinstance(r, list) or len(r) != 2 or not all(type(v) is int for v in r)
                or not 0 <= r[0] < r[1]):
            raise ShardError([ref], f"{where}: metadata rows of {str(name)[:80]!r} are not [start, stop]")
        out[name] = (r[0], r[1])
    return out


def assemble(files: list[tuple[ObjRef, bytes]], infos: Mapping[str, TensorInfo],
             want: Selector | None = None) -> dict[str, torch.Tensor]:
    """assemble_read over files given as their bytes (safetensors, or compressed snapshot objects: whole
    tensors, each checked against its own digest as it is decoded)."""
    budget = Budget.of(infos)
    return assemble_read([read_bytes(ref, data, budget) for ref, data in files], infos, want)


class Budget:
    """What the compressed files of one snapshot may still decode to: the record's tensors, all files together;
    and what each file's safetensors header may be (`header`: header_bound of the record, None for no record)."""

    def __init__(self, nbytes: int, header: HeaderBound | None = None) -> None:
        self.left = nbytes
        self.header = header

    @classmethod
    def of(cls, infos: Mapping[str, TensorInfo]) -> "Budget":
        """The budget a step's record (its tensors, `infos`) implies."""
        return cls(tensor_bytes(infos), header_bound(infos))


def read_bytes(ref: ObjRef, data: bytes, budget: Budget
               ) -> tuple[ObjRef, dict[str, tuple[int, int]], dict[str, torch.Tensor]]:
    """One snapshot file given as its bytes, read as assemble_read takes it. The tensors own their memory,
    so a caller can let the bytes go before it fetches the next file (one file's bytes at a time)."""
    from safetensors.torch import load as st_load

    if bytes(data[:4]) == codec.SNAPSHOT_MAGIC:
        try:
            held = dict(codec.decode_snapshot(data, where=ref.key, max_bytes=max(budget.left, 0)))
        except codec.SnapshotError as exc:
            raise ShardError([ref], f"not a snapshot file ({exc})") from None
        budget.left -= sum(t.nbytes for t in held.values())
        return ref, {}, held
    rows = file_rows(data, ref, budget.header)
    try:
        held = st_load(bytes(data))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types on bad bytes
        raise ShardError([ref], f"{ref.key}: not a safetensors file ({exc})") from None
    budget.left -= sum(t.nbytes for t in held.values())
    return ref, rows, held


def assemble_read(files: list[tuple[ObjRef, dict[str, tuple[int, int]], dict[str, torch.Tensor]]],
                  infos: Mapping[str, TensorInfo], want: Selector | None = None) -> dict[str, torch.Tensor]:
    """The tensors a snapshot's files hold (those `want` selects), row slices put together into whole
    tensors shaped as the record says. Each file is given read: (its reference, its metadata's rows
    (metadata_rows), its tensors). ShardError, blaming every file given, when a tensor appears
    twice, slices overlap, leave a gap, or do not fit the record; the digests are the caller's check."""
    refs = [r for r, _, _ in files]
    whole: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, int, torch.Tensor, str]]] = {}
    for ref, rows, held in files:
        if set(rows) - set(held):
            raise ShardError([ref], f"{ref.key}: metadata gives rows of tensors it does not hold "
                                    f"{sorted(set(rows) - set(held))[:5]}")
        for name, t in held.items():
            if want is not None and not want(name):
                continue
            if name in whole or (name not in rows and name in pieces):
                raise ShardError(refs, f"snapshot: tensor {name!r} is held twice ({ref.key})")
            if name in rows:
                pieces.setdefault(name, []).append((*rows[name], t, ref.key))
            else:
                whole[name] = t
    for name, ps in pieces.items():
        info = infos.get(name)
        if info is None or not info.shape:
            raise ShardError(refs, f"snapshot: slices of {name!r}, which the record has no rows of")
        ps.sort(key=lambda p: p[0])
        pos = 0
        for start, stop, t, key in ps:
            if start != pos:
                what = "overlap at" if start < pos else "gap before"
                raise ShardError(refs, f"snapshot: slices of {name!r} {what} row {start} ({key})")
            if tuple(t.shape) != (stop - start, *info.shape[1:]) or t.dtype != ps[0][2].dtype:
                raise ShardError(refs, f"{key}: slice of {name!r} is {t.dtype} {tuple(t.shape)}, rows "
                                       f"{start}-{stop} of {info.shape} need ({stop - start}, *{info.shape[1:]})")
            pos = stop
        if pos != info.shape[0]:
            raise ShardError(refs, f"snapshot: slices of {name!r} end at row {pos}, the record has {info.shape[0]}")
        full = torch.empty(info.shape, dtype=ps[0][2].dtype)
        for start, stop, t, _ in ps:
            full[start:stop].copy_(t)
        whole[name] = full
    return whole


def index_files(data: bytes, snap: Snapshot) -> dict[str, set[str]]:
    """Snapshot file key -> the tensors it holds, from the snapshot's index (weight_map, plus the
    metadata's slices for row-sliced tensors). ManifestError if the index is not one of this snapshot."""
    where = snap.index.key
    doc = load_json(data, where, MAX_RECORD_BYTES)
    prefix = snap.index.key.rsplit("/", 1)[0] + "/"
    keys = {f.key for f in snap.files}
    out: dict[str, set[str]] = {}

    def add(name: Any, file: Any) -> None:
        if not isinstance(name, str) or not safe_shard_name(file) or prefix + str(file) not in keys:
            raise ManifestError(f"{where}: maps {str(name)[:80]!r} to {str(file)[:80]!r}, not a file of the snapshot")
        out.setdefault(prefix + str(file), set()).add(name)

    try:
        for name, file in doc["weight_map"].items():
            add(name, file)
        for name, slices in (doc.get("metadata") or {}).get(SLICES_KEY, {}).items():
            for item in slices:
                add(name, item[2])
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ManifestError(f"{where}: not a snapshot index ({type(exc).__name__}: {exc})") from None
    return out


__all__ = ["ShardError", "selector", "needs_part", "check_tiling", "part_targets", "file_rows", "file_names",
           "metadata_rows", "Budget", "read_bytes",
           "assemble", "assemble_read", "index_files", "ROWS_KEY", "SLICES_KEY"]
