"""Checkpoints on local disk: one `.safetensors` file or a Hugging Face shard directory.

A directory holds `model.safetensors.index.json` (`weight_map`: tensor name -> shard file) and
its shards. Writes are atomic: a temporary sibling is renamed into place, so a reader (or a
crash) never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from codec.tensors import dtype_of, element_view
from relay.files import atomic_path
from relay.manifest import INDEX_NAME

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
