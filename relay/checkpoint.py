"""Checkpoints on local disk: one `.safetensors` file or a Hugging Face shard directory.

A directory holds `model.safetensors.index.json` (`weight_map`: tensor name -> shard file) and
its shards. Writes are atomic: a temporary sibling is renamed into place, so a reader (or a
crash) never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import stat
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import codec
from codec.tensors import dtype_of, element_view
from relay.files import atomic_path
from relay.manifest import INDEX_NAME, MAX_RECORD_BYTES, ManifestError, load_json

SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 << 30  # the shard cap of snapshots and of directories written without a layout


@dataclass
class Layout:
    """How tensors are spread over files; decode writes the target in the base's layout."""

    sharded: bool = False
    weight_map: dict[str, str] = field(default_factory=dict)  # sharded only
    metadata: dict[str, str] = field(default_factory=dict)


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return tensors, meta


def load(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Layout]:
    """Read a checkpoint file or shard directory. Raises FileNotFoundError / ValueError with the path."""
    p = Path(path)
    if p.is_dir():
        index = p / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            tensors: dict[str, torch.Tensor] = {}
            meta: dict[str, str] = {}
            for shard in sorted(set(weight_map.values())):
                part, meta = _read_file(p / shard)
                tensors.update(part)
            missing = set(weight_map) - set(tensors)
            if missing:
                raise ValueError(f"{p}: index names tensors no shard holds: {sorted(missing)[:5]}")
            return tensors, Layout(True, dict(weight_map), meta)
        single = p / SINGLE_NAME
        if single.exists():
            tensors, meta = _read_file(single)
            return tensors, Layout(False, {}, meta)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors")
        tensors, meta = {}, {}
        weight_map = {}
        for f in files:
            part, meta = _read_file(f)
            tensors.update(part)
            weight_map.update({k: f.name for k in part})
        return tensors, Layout(True, weight_map, meta)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint")
    tensors, meta = _read_file(p)
    return tensors, Layout(False, {}, meta)


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, str]:
    """Greedy weight_map keeping each shard under `max_shard_bytes` (a lone larger tensor gets its own)."""
    names = list(tensors)
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    total = len(groups)
    return {name: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, g in enumerate(groups) for name in g}


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and one storage per name: safetensors refuses names that share memory
    (tied weights in a live state_dict), so later aliases are written as copies of their own."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for k, v in tensors.items():
        v = v.detach().contiguous().cpu()
        ptr = v.untyped_storage().data_ptr()
        if v.numel() and ptr in storages:
            v = v.clone()
        storages.add(ptr)
        out[k] = v
    return out


def index_bytes(tensors: Mapping[str, torch.Tensor], weight_map: dict[str, str], **metadata: Any) -> bytes:
    """The Hugging Face index of a shard directory (`model.safetensors.index.json`): total size, any extra
    metadata, and the weight map. Deterministic, so two writers of one step write the same bytes."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return json.dumps({"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}, indent=1).encode()


# safetensors writes tensors sorted by dtype, in descending order of its Rust `Dtype` enum, then by name
# (safetensors' `prepare`); this is that enum's order, low to high, for every dtype both it and the codec know.
_ST_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
                   "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_ST_RANK = {name: i for i, name in enumerate(_ST_DTYPE_ORDER)}
STREAM_CHUNK = 16 << 20  # the largest piece a streamed file hands out (zero-copy views of tensor memory)


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array: its own memory for a CPU contiguous tensor, else a host copy."""
    return element_view(t).view(np.uint8)


@dataclass(frozen=True)
class StreamedFile:
    """A file as a byte stream: `head` (bytes), then each tensor's raw bytes in order. `size` is the total;
    `chunks()` hands out the bytes again on every call, as zero-copy views of CPU contiguous tensors (others
    are brought to the host one tensor at a time), so a shard never exists whole in memory."""

    head: bytes
    tensors: tuple[torch.Tensor, ...] = ()

    @property
    def size(self) -> int:
        return len(self.head) + sum(t.numel() * t.element_size() for t in self.tensors)

    def chunks(self, chunk: int = STREAM_CHUNK) -> Iterator[memoryview]:
        yield memoryview(self.head)
        for t in self.tensors:
            if not t.numel():
                continue
            raw = _raw_bytes(t).data
            for i in range(0, len(raw), chunk):
                yield raw[i:i + chunk]


def safetensors_stream(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                       ) -> StreamedFile:
    """The exact bytes `safetensors.torch.save(tensors, metadata)` writes, as a stream: the 8-byte
    little-endian header length, the JSON header (`__metadata__` first, then each tensor's dtype, shape
    and data_offsets in file order) padded with spaces to a multiple of 8, then the tensors' raw bytes in
    that order (by dtype as safetensors ranks them, then by name). Deterministic, so two writers of one
    snapshot write the same bytes (PROTOCOL §3.3). Names sharing storage (tied weights) are written as
    the copies safetensors would need; ValueError for a dtype safetensors cannot store."""
    entries = []
    for name, t in tensors.items():
        dt = dtype_of(t, name)
        if dt.name not in _ST_RANK:
            raise ValueError(f"tensor {name!r}: safetensors cannot store {dt.name} ({t.dtype})")
        entries.append((-_ST_RANK[dt.name], name.encode("utf-8"), name, dt.name, t))
    entries.sort(key=lambda e: (e[0], e[1]))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for _, _, name, dtype, t in entries:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    # serde_json's compact form: no spaces, non-ASCII as UTF-8, the same escapes as Python's json
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return StreamedFile(struct.pack("<Q", len(text)) + text, tuple(e[4] for e in entries))


def write_dir(tensors: dict[str, torch.Tensor], directory: Path, layout: Layout) -> None:
    """Write tensors into an existing empty directory in `layout`."""
    tensors = _contiguous(tensors)
    if layout.sharded:
        weight_map = {k: layout.weight_map[k] for k in tensors if k in layout.weight_map}
        if len(weight_map) != len(tensors):  # the layout does not place every tensor
            weight_map = shard_plan(tensors, DEFAULT_SHARD_BYTES)
        for shard in sorted(set(weight_map.values())):
            part = {k: tensors[k] for k, s in weight_map.items() if s == shard}
            save_file(part, str(directory / shard), metadata=layout.metadata or None)
        (directory / INDEX_NAME).write_bytes(index_bytes(tensors, weight_map))
    else:
        save_file(tensors, str(directory / SINGLE_NAME), metadata=layout.metadata or None)


def save(tensors: dict[str, torch.Tensor], path: str | os.PathLike, layout: Layout | None = None) -> None:
    """Atomically write a checkpoint: a single file at `path`, or a shard directory if sharded."""
    p = Path(path)
    layout = layout or Layout()
    p.parent.mkdir(parents=True, exist_ok=True)
    if not layout.sharded:
        with atomic_path(p) as tmp:
            save_file(_contiguous(tensors), str(tmp), metadata=layout.metadata or None)
        return
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent))
    try:
        write_dir(tensors, tmpdir, layout)
        if p.exists():
            old = p.with_name(f".{p.name}.old-{os.getpid()}")
            os.replace(p, old)
            os.replace(tmpdir, p)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:  # a single-file checkpoint replaced by a shard directory
                old.unlink(missing_ok=True)
        else:
            os.replace(tmpdir, p)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise


# the fewest bytes a safetensors header spends per JSON element: `"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}`
# spends 7.4, a real model's names twice that
HEADER_BYTES_PER_ITEM = 6
MAX_HEADER_BYTES = 100 << 20  # a safetensors header over this is refused before it is read (safetensors' own cap)
_READ_CHUNK = 16 << 20  # bytes per read: large enough for the disk, small enough to stay out of RSS


# What one tensor's entry can spend in an honest header (`"name":{"dtype":..,"shape":[<= MAX_DIMS],"data_offsets":[2]}`,
# and a sharded file's `rows` metadata naming it again): elements and bytes beyond its name, and a constant for the
# rest (`__metadata__`'s step, the object itself, padding). header_bound turns a record's tensors into a cap.
MAX_DIMS = 32
_ITEMS_PER_TENSOR = 6 + MAX_DIMS + 3  # one entry's ',' '{' 2x',' '[' dims-1 ',' '[' ',' + its [start, stop] rows
_BYTES_PER_TENSOR = 1024  # an entry's keys, dtype, 32 dims and 2 offsets of 20 digits, its rows: ~870
_HEADER_SLACK_ITEMS = 64
_HEADER_SLACK_BYTES = 4096


class HeaderBound(NamedTuple):
    """The most a safetensors header of a snapshot file may be, from the step's (trusted) record."""

    nbytes: int
    items: int


def header_bound(names: Iterable[str]) -> HeaderBound:
    """What a header of a file holding any subset of the tensors `names` (a record's) may be, honestly: one entry
    per tensor at its longest (its name as the entry's key and, escaped twice over, in a sharded file's rows;
    each `[`, `{` or `,` in it counted by load_json's element scan), and a constant for the metadata. Bounds
    the header before it is read or parsed, so a small record's hostile file costs a few KB, not the 100 MiB
    cap's ~1 GB of objects; honest sharded files hold subsets, so one bound per record serves each of them."""
    nbytes, items = _HEADER_SLACK_BYTES, _HEADER_SLACK_ITEMS
    for name in names:
        nbytes += (len(json.dumps(name, ensure_ascii=False).encode("utf-8"))  # the entry's, as safetensors writes
                   + len(json.dumps(json.dumps(name))) + _BYTES_PER_TENSOR)  # the rows', a string in a string
        items += _ITEMS_PER_TENSOR + 2 * sum(name.count(c) for c in ",[{")
    return HeaderBound(min(nbytes, MAX_HEADER_BYTES), items)


class SafetensorsError(ValueError):
    """A safetensors file that this reader refuses: the path and the reason."""


@dataclass
class _Span:
    name: str
    dtype: Any  # codec.tensors.DType
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(fd: int, size: int, where: str, bound: HeaderBound | None = None
                ) -> tuple[list[_Span], dict[str, str], int]:
    """(tensors in file order, metadata, data start) of the safetensors file open at `fd` (`size` bytes):
    `parse_header` over positional reads."""
    return parse_header(lambda n, offset: _pread_exact(fd, n, offset, where), size, where, bound)


def parse_header(read: Callable[[int, int], bytes], size: int, where: str, bound: HeaderBound | None = None
                 ) -> tuple[list[_Span], dict[str, str], int]:
    """(tensors in file order, metadata, data start) of a safetensors object of `size` bytes, whose bytes
    [offset, offset + n) `read(n, offset)` returns (the 8-byte length first, then the header).

    Strict, since the file may come from anywhere: the header length (8 bytes, little-endian) is
    capped before it is read; every entry needs a known dtype, a shape of non-negative integers and
    data_offsets that match it; the tensors' bytes must tile the data exactly (sorted, no overlap, no
    gap, nothing after), as safetensors itself requires. `bound` (header_bound of the step's record) caps
    the header's bytes before they are read and its elements before they are parsed; without one, only
    safetensors' own 100 MiB cap.
    """
    from codec.tensors import DTYPES  # names as docs/FORMAT.md's table (safetensors' names)

    by_name = {d.name: d for d in DTYPES}
    if size < 8:
        raise SafetensorsError(f"{where}: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(read(8, 0), "little")
    if bound is not None and n > bound.nbytes:
        raise SafetensorsError(f"{where}: header of {n} bytes, more than the {bound.nbytes} a file of its step's "
                               f"record may have (refused before it is read)")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise SafetensorsError(f"{where}: header of {n} bytes (file {size} bytes, cap {MAX_HEADER_BYTES})")
    try:  # the bounded reader: a 100 MiB header of `{}` would otherwise build ~35M objects before any check
        doc = load_json(read(n, 8), f"{where}: header", MAX_HEADER_BYTES, HEADER_BYTES_PER_ITEM,
                        None if bound is None else bound.items)
    except ManifestError as exc:
        raise SafetensorsError(f"{where}: header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings")
    spans = []
    for name, info in doc.items():
        w = f"{where}: tensor {name[:100]!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{w}: needs exactly dtype, shape and data_offsets")
        dt = by_name.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dt is None:
            raise SafetensorsError(f"{w}: unknown dtype {str(info['dtype'])[:40]!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsError(f"{w}: shape must be a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{w}: data_offsets must be two integers, begin <= end")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * dt.itemsize:
            raise SafetensorsError(f"{w}: data_offsets span {offsets[1] - offsets[0]} bytes, its dtype and shape "
                                   f"need {numel * dt.itemsize}")
        spans.append(_Span(name, dt, tuple(shape), offsets[0], offsets[1]))
    spans.sort(key=lambda s: (s.begin, s.end))
    at = 0
    for s in spans:
        if s.begin != at:
            raise SafetensorsError(f"{where}: tensor {s.name[:100]!r} starts at {s.begin}, expected {at} "
                                   f"(overlapping or missing data)")
        at = s.end
    if 8 + n + at != size:
        raise SafetensorsError(f"{where}: data is {size - 8 - n} bytes, the tensors cover {at}")
    return spans, dict(meta), 8 + n


def _pread_exact(fd: int, n: int, offset: int, where: str) -> bytes:
    out = bytearray(n)
    _preadinto(fd, memoryview(out), offset, where)
    return bytes(out)


def _preadinto(fd: int, buf: memoryview, offset: int, where: str) -> None:
    """Fill `buf` from `fd` at `offset` in chunks; a file that ends early is refused."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:done + _READ_CHUNK]], offset + done)
        if got <= 0:
            raise SafetensorsError(f"{where}: ends {len(buf) - done} bytes early")
        done += got


class NotARegularFile(SafetensorsError):
    """A path that should be a safetensors file is a directory, a FIFO, a device: never opened for reading."""


class SafetensorsFile:
    """An open safetensors file (no links followed) with its strictly parsed header (`read_header`): `spans`
    in file order, `metadata`; `read(span)` reads one tensor with plain chunked reads into a new tensor."""

    def __init__(self, path: str | os.PathLike, where: str | None = None, bound: HeaderBound | None = None) -> None:
        self.where = where or str(path)
        # O_NONBLOCK: a FIFO in place of a file must not block the open (no effect on a regular file)
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise NotARegularFile(f"{self.where}: not a regular file")
            self.spans, self.metadata, self.start = read_header(self.fd, os.fstat(self.fd).st_size, self.where,
                                                                bound)
        except BaseException:
            os.close(self.fd)
            raise

    def read(self, span: _Span) -> torch.Tensor:
        t = _new_tensor(span, self.where)
        if span.end > span.begin:
            _preadinto(self.fd, t.view(-1).view(torch.uint8).numpy().data, self.start + span.begin,
                       self.where)
        return t

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_tensor(span: _Span, where: str) -> torch.Tensor:
    try:
        return torch.empty(span.shape, dtype=span.dtype.torch)
    except RuntimeError as exc:  # torch's CPU allocator reports exhaustion as a RuntimeError
        if "alloc" in str(exc).lower():
            raise MemoryError(f"{where}: cannot allocate {span.name!r} ({exc})") from None
        raise


def stream_into(chunks: Iterable[bytes], size: int, where: str, feed: Callable[[memoryview], None],
                max_bytes: int | None = None, bound: HeaderBound | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, bytes]]:
    """(tensors, metadata, each tensor's codec digest) of a safetensors object of `size` bytes arriving as
    `chunks`, copied straight into new tensors (no file, no copy of the object's bytes: memory is the
    tensors and one chunk). Every byte is passed to `feed` in order (the caller's check of the object's
    hash, which must pass before any tensor is used); each tensor is digested (codec.hashing) as its bytes
    arrive, while in cache. Strict header (parse_header); SafetensorsError if the object is malformed, or
    ends before or runs past `size` bytes, or its header declares more than `max_bytes` of tensors (checked,
    like a lack of memory for them, before they are allocated: `size` may be an unsigned claim), or a header
    over `bound` (checked before the header is taken from the stream)."""
    from codec.hashing import digester

    it = iter(chunks)
    head = bytearray()
    got = 0

    def pull() -> memoryview | None:
        nonlocal got
        for chunk in it:
            if chunk:
                view = memoryview(chunk).cast("B")
                got += len(view)
                if got > size:
                    raise SafetensorsError(f"{where}: runs past its {size} bytes")
                feed(view)
                return view
        return None

    def header_bytes(n: int, offset: int) -> bytes:
        while len(head) < offset + n:
            view = pull()
            if view is None:
                raise SafetensorsError(f"{where}: ends after {len(head)} bytes, in its header")
            head.extend(view)
        return bytes(head[offset:offset + n])

    if size > 8:  # the length, and then (within the cap parse_header checks first) the header
        header_bytes(8, 0)
        cap = MAX_HEADER_BYTES if bound is None else bound.nbytes
        header_bytes(min(int.from_bytes(head[:8], "little"), cap, size - 8), 8)
    spans, meta, start = parse_header(header_bytes, size, where, bound)
    declared = sum(sp.end - sp.begin for sp in spans)
    if max_bytes is not None and declared > max_bytes:
        raise SafetensorsError(f"{where}: header declares {declared} bytes of tensors, more than the {max_bytes} "
                               "its step's record lists")
    tensors = {sp.name: _new_tensor(sp, where) for sp in spans}
    hashers = {sp.name: digester(sp.dtype.name, sp.shape) for sp in spans}
    flat = {sp.name: tensors[sp.name].view(-1).view(torch.uint8).numpy().data for sp in spans if sp.end > sp.begin}
    pending = memoryview(bytes(head[start:]))  # data bytes already read with the header
    for sp in (x for x in spans if x.end > x.begin):
        out, h = flat[sp.name], hashers[sp.name]
        done = 0
        while done < sp.end - sp.begin:
            if not len(pending):
                view = pull()
                if view is None:
                    raise SafetensorsError(f"{where}: ends {size - got} bytes early")
                pending = view
            take = min(len(pending), sp.end - sp.begin - done)
            out[done:done + take] = pending[:take]
            h.update(pending[:take])
            pending, done = pending[take:], done + take
    if len(pending) or pull() is not None or got != size:
        raise SafetensorsError(f"{where}: {got} bytes where its header and size say {size}")
    return tensors, meta, {name: h.digest() for name, h in hashers.items()}


def read_file_into(path: str | os.PathLike, where: str | None = None, bound: HeaderBound | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, read with plain chunked reads straight into new tensors
    (no mmap, no intermediate bytes: resident memory is the tensors alone). Strict header (read_header);
    SafetensorsError on a malformed file, FileNotFoundError if absent. Links are not followed."""
    with SafetensorsFile(path, where, bound) as f:
        return {s.name: f.read(s) for s in f.spans}, f.metadata


class StreamedWriter:
    """A safetensors file written tensor by tensor, in the order of `spans` (names, dtypes, shapes, and
    offsets that tile the data, as `read_header` returns them): the header first, then each tensor's
    bytes as it comes, so a checkpoint is rewritten without holding it. Created exclusively (no links)."""

    def __init__(self, path: str | os.PathLike, spans: list[_Span], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.spans = spans
        self._next = 0
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        for s in spans:
            header[s.name] = {"dtype": s.dtype.name, "shape": list(s.shape), "data_offsets": [s.begin, s.end]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors pads
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self.start = 8 + len(raw)
        self._pwrite(len(raw).to_bytes(8, "little") + raw, 0)

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")  # bytes or a numpy array (both buffers)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:done + _READ_CHUNK], offset + done)

    def write(self, t: torch.Tensor) -> None:
        """The next span's tensor (its dtype and shape checked)."""
        s = self.spans[self._next]
        if t.dtype != s.dtype.torch or tuple(t.shape) != s.shape:
            raise ValueError(f"{self.path}: {s.name!r} expects {s.dtype.name} {s.shape}")
        if s.end > s.begin:
            self._pwrite(t.detach().contiguous().view(-1).view(torch.uint8).numpy(), self.start + s.begin)
        self._next += 1

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "StreamedWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        done = self._next == len(self.spans)
        self.close()
        if exc[0] is None and not done:
            raise ValueError(f"{self.path}: closed after {self._next} of {len(self.spans)} tensors")


def tensor_bytes(infos: Mapping[str, Any]) -> int:
    """The bytes of the tensors that descriptions (dtype names and shapes, relay.manifest.TensorInfo) describe."""
    from codec.tensors import DTYPES

    size = {d.name: d.itemsize for d in DTYPES}
    total = 0
    for info in infos.values():
        n = size[info.dtype]
        for d in info.shape:
            n *= d
        total += n
    return total


def index_bytes_of(infos: dict[str, Any], weight_map: dict[str, str], **metadata: Any) -> bytes:
    """index_bytes from tensor descriptions (dtype names and shapes, relay.manifest.TensorInfo) instead of tensors."""
    return json.dumps({"metadata": {"total_size": tensor_bytes(infos), **metadata}, "weight_map": weight_map},
                      indent=1).encode()


# ---------------------------------------------------------------- snapshot files in either format

SNAPSHOT_FORMATS = ("safetensors", "compressed")  # a snapshot file's bytes: safetensors, or codec's DRSN object


def declares_compressed(index: bytes) -> bool:
    """Whether a snapshot index says its files are compressed snapshot objects (metadata snapshot_format)."""
    try:
        meta = load_json(index, INDEX_NAME, MAX_RECORD_BYTES).get("metadata", {})
        return isinstance(meta, dict) and meta.get("snapshot_format") == "compressed"
    except (ManifestError, AttributeError):
        return False


def snapshot_file_format(path: str | os.PathLike) -> str:
    """"compressed" for a codec snapshot object (its magic `DRSN`), else "safetensors" (which
    `read_header` then parses strictly): what a reader of a snapshot file needs, whatever the index says."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        head = os.pread(fd, 4, 0)
    finally:
        os.close(fd)
    return "compressed" if head == codec.SNAPSHOT_MAGIC else "safetensors"


def read_snapshot_file(path: str | os.PathLike, where: str | None = None, only: set[str] | None = None,
                       max_bytes: int | None = None, bound: HeaderBound | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a snapshot file in either format (`snapshot_file_format`): a safetensors file
    as `read_file_into` reads it (`only` then filters), a compressed one decoded tensor by tensor, each
    checked against its own digest (`only`: just those, by seeking). A compressed file has no metadata
    ({}). SafetensorsError, naming `where`, for any file this refuses, in either format; links are not
    followed. The caller still checks the tensors against the step's record, as for any snapshot.
    `max_bytes` bounds a compressed file's tensors before each is allocated (`codec.decode_snapshot`); a
    safetensors file's are bounded by its size, its header by `bound` (header_bound of the step's record)."""
    where = where or str(path)
    if snapshot_file_format(path) == "safetensors":
        tensors, meta = read_file_into(path, where, bound)
        return (tensors if only is None else {k: v for k, v in tensors.items() if k in only}), meta
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:
            # our own spool and staging files: mapped (no other process truncates them under us)
            return dict(codec.decode_snapshot(f, only=only, where=where, map_files=True, max_bytes=max_bytes)), {}
    except codec.SnapshotError as exc:
        raise SafetensorsError(f"compressed snapshot {exc}") from None


@dataclass
class SpooledSnapshot:
    """A compressed snapshot file encoded into a spool file (memory: one tensor's output), with what
    `Store.put_new_stream` needs up front: `size`, `xxh3`; `chunks()` streams it again on every call.
    `close()` (or the context manager) removes the spool file."""

    path: Path
    size: int
    xxh3: str

    def chunks(self, chunk: int = 8 << 20) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            while True:
                data = f.read(chunk)
                if not data:
                    return
                yield data

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "SpooledSnapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spool_compressed_snapshot(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike | None = None
                              ) -> SpooledSnapshot:
    """`tensors` as a compressed snapshot file (codec.encode_snapshot, in the mapping's order) in a new
    temporary file under `directory` (default the system's): the writer counterpart of
    `read_snapshot_file` for a publisher or relay that uploads with `put_new_stream(key, s.chunks(),
    s.size, xxh3=s.xxh3)`."""
    fd, name = tempfile.mkstemp(prefix=".snapshot-", suffix=".drsn", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            size, tag = codec.write_snapshot(tensors.items(), f)
    except BaseException:
        os.unlink(name)
        raise
    return SpooledSnapshot(Path(name), size, tag)
