"""Tensor digests: xxh3-128 over dtype, shape and raw bytes.

xxh3 runs at memory speed (~10 GB/s on one core), so verifying every reconstruction costs
less than copying it. Dtype and shape are hashed too: the same bytes read as another tensor
must not verify.
"""

from __future__ import annotations

import numpy as np
import xxhash

DIGEST_SIZE = 16


def digester(dtype_name: str, shape: tuple[int, ...]) -> xxhash.xxh3_128:
    """A tensor's running digest: `feed` it the tensor's elements in order, in any pieces (xxh3
    streams: the digest does not depend on how the bytes were split)."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype_name}{list(shape)}".encode())
    return h


def feed(h: xxhash.xxh3_128, elems: np.ndarray) -> None:
    h.update(memoryview(np.ascontiguousarray(elems)).cast("B"))


def digest_elements(dtype_name: str, shape: tuple[int, ...], elems: np.ndarray) -> bytes:
    h = digester(dtype_name, shape)
    feed(h, elems)
    return h.digest()
