"""General-purpose byte compressors raced per stream; the smallest output wins.

Decompression is always bounded by the length the index declares, so a forged stream cannot
make us allocate more than the base tensor justifies.
"""

from __future__ import annotations

from collections.abc import Iterable

import brotli
import lz4.block
import numpy as np
import zstandard

from .errors import DeltaError

RAW, ZSTD, LZ4, BROTLI = 0, 1, 2, 3
NAMES = {RAW: "raw", ZSTD: "zstd", LZ4: "lz4", BROTLI: "brotli"}

# (codec, level) candidates by effort. "fast" keeps encode near memory speed. Brotli races at
# "max" only: it saves little on these streams, and its per-call setup on hundreds of small
# streams costs more than the rest of the encode (`deltarelay bench` measures both).
EFFORT = {
    "fast": ((ZSTD, 1),),
    "default": ((ZSTD, 3), (LZ4, 0)),
    "max": ((ZSTD, 3), (ZSTD, 19), (LZ4, 0), (BROTLI, 9), (BROTLI, 11)),
}


def compress(codec: int, data: bytes | memoryview, level: int = 3) -> bytes:
    if codec == RAW:
        return bytes(data)
    if codec == ZSTD:
        return zstandard.ZstdCompressor(level=level, write_content_size=False).compress(data)
    if codec == LZ4:
        return lz4.block.compress(data, store_size=False)
    if codec == BROTLI:
        return brotli.compress(bytes(data), quality=level)
    raise ValueError(f"unknown codec {codec}")


def compress_best(data: bytes | bytearray | memoryview | np.ndarray, effort: str = "default",
                  candidates: Iterable[tuple[int, int]] | None = None) -> tuple[int, bytes]:
    """Try each candidate codec and keep the smallest output (raw if nothing helps). `data` is
    any contiguous buffer: the compressors read it in place, and it is copied only if raw wins."""
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    best_codec, best_len = RAW, view.nbytes
    best: bytes | None = None
    if not best_len:
        return best_codec, b""
    cands = tuple(candidates) if candidates is not None else EFFORT[effort]
    seen = set()
    for codec, level in cands:
        if (codec, level) in seen:
            continue
        seen.add((codec, level))
        out = compress(codec, view, level)
        if len(out) < best_len:
            best_codec, best, best_len = codec, out, len(out)
    return best_codec, (bytes(view) if best is None else best)


def decompress(codec: int, data: bytes | memoryview, raw_len: int, what: str) -> bytes:
    """Decompress exactly `raw_len` bytes or raise DeltaError naming `what`."""
    try:
        if codec == RAW:
            out = bytes(data)
        elif codec == ZSTD:
            frame = bytes(data)
            # decompress() allocates the size a frame header declares, ignoring max_output_size
            if zstandard.frame_content_size(frame) > raw_len:
                raise DeltaError(f"{what}: zstd frame declares more than the {raw_len} bytes the index declares")
            out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(raw_len, 1))
        elif codec == LZ4:
            out = lz4.block.decompress(bytes(data), uncompressed_size=raw_len) if raw_len else b""
        elif codec == BROTLI:
            dec = brotli.Decompressor()  # the limit is soft (buffer-sized), so output stays bounded
            out = dec.process(bytes(data), output_buffer_limit=raw_len + 1)
            if not dec.is_finished():
                raise DeltaError(f"{what}: brotli stream is longer than the {raw_len} bytes the index declares")
        else:
            raise DeltaError(f"{what}: unknown compressor code {codec}")
    except DeltaError:
        raise
    except Exception as exc:  # noqa: BLE001 - zstd/lz4/brotli raise their own types on corrupt input
        raise DeltaError(f"{what}: {NAMES.get(codec, codec)} stream is corrupt ({exc})") from None
    if len(out) != raw_len:
        raise DeltaError(f"{what}: stream decompressed to {len(out)} bytes, index says {raw_len}")
    return out
