"""What a payload says about itself without decoding it: `describe` (for `deltarelay inspect`) and
`digests` (the trainer's digests it carries, for a publisher's record)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from . import container, methods, tensors


def describe(payload: bytes | bytearray | memoryview, base: Mapping[str, torch.Tensor] | None = None) -> dict:
    """Per tensor: dtype, shape, changed fraction, method, bytes per stream; and totals.

    With the `base` it was made for, the payload is decoded (and verified) too, and methods say
    more (`Method.describe`: conditional tensors report how many bits per change go to the mask
    and to the values).
    """
    parsed = container.unpack(payload)
    target = None
    if base is not None:
        from .api import decode

        target = decode(base, payload)
    rows = []
    for e in parsed.entries:
        method = methods.lookup(e, parsed.version)
        names = method.stream_names(e)
        streams = {names[i] if i < len(names) else f"stream{i}": len(s.stored) for i, s in enumerate(e.streams)}
        row = {
            "name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "method": method.name,
            "changed": e.changes, "changed_fraction": e.changes / e.numel if e.numel else 0.0,
            "bytes": len(e.params) + sum(streams.values()), "streams": streams,
        }
        if base is not None and target is not None:  # target: decoded from base
            row.update(method.describe(e, parsed.shared, tensors.element_view(base[e.name]),
                                       tensors.element_view(target[e.name])))
        else:
            row.update(method.describe(e, parsed.shared, None, None))
        rows.append(row)
    total = len(bytes(payload)) if not isinstance(payload, memoryview) else payload.nbytes
    return {
        "format_version": parsed.version,
        "tensors": rows,
        "total_bytes": total,
        "body_bytes": parsed.body_size,
        "overhead_bytes": total - parsed.body_size,
        "changed": sum(r["changed"] for r in rows),
        "elements": sum(e.numel for e in parsed.entries),
    }


class TensorDigests(NamedTuple):
    """One tensor of a payload: dtype name, shape, and the digests (hex, `codec.hashing.digest_elements`) of
    its base and of its target, as encode computed them; `changes`, how many of its elements changed."""

    dtype: str
    shape: tuple[int, ...]
    base: str
    target: str
    changes: int = 0


def digests(payload: bytes | bytearray | memoryview, *, compiled: bool = True) -> dict[str, TensorDigests]:
    """Per tensor, in payload order, what its index records: encode digests base and target while it
    scans them, so a publisher writes its step's record from here instead of hashing the state again.
    The payload's checksum and structure are checked (DeltaError); nothing is decoded. compiled=False
    parses in Python only (no kernel runs: `encode(..., compiled=False)`'s caller)."""
    parsed = container.unpack(payload, compiled=compiled)
    return {e.name: TensorDigests(e.dtype.name, e.shape, e.base_digest.hex(), e.target_digest.hex(), e.changes)
            for e in parsed.entries}
