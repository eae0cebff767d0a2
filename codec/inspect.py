"""Human-facing description of a payload without decoding it (for `deltarelay inspect`)."""

from __future__ import annotations

from . import container, methods


def describe(payload: bytes | bytearray | memoryview) -> dict:
    """Per tensor: dtype, shape, changed fraction, method, bytes per stream; and totals."""
    parsed = container.unpack(payload)
    rows = []
    for e in parsed.entries:
        module = methods.lookup(e, parsed.version)
        names = module.stream_names(e)
        streams = {names[i] if i < len(names) else f"stream{i}": len(s.stored) for i, s in enumerate(e.streams)}
        row = {
            "name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "method": module.NAME,
            "changed": e.changes, "changed_fraction": e.changes / e.numel if e.numel else 0.0,
            "bytes": len(e.params) + sum(streams.values()), "streams": streams,
        }
        extra = getattr(module, "describe_bits", None)
        if extra is not None:
            row.update(extra(e, parsed.shared))
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
