"""Compiled in-place patching for apply_: swap a patch into a tensor's elements, digesting as it goes.

A patch touches ~1% of a tensor's elements. numpy's fancy indexing gathers the old values and
scatters the new ones in two passes with temporaries; here one compiled pass per tensor walks
the tensor in chunks, swaps the changes that fall in each chunk (the patch's values array comes
back holding the old elements: the undo log costs no new memory) and feeds the finished chunk
to the running digest while it is in cache, so verifying costs no separate read of the tensor.
The kernels release the GIL: apply_ runs them for several tensors at once.
"""

from __future__ import annotations

import numba as nb

from .hashing import hash_update

CHUNK = 1 << 15  # elements per digest feed: a few tens of KiB, in L1/L2 while swapped and hashed


@nb.njit(cache=True, nogil=True)
def swap_digest(elems, index, values, function, state):
    """Swap values[j] with elems[index[j]] for every j, in order; feed elems to the running digest
    (`hashing.Running` fields; `function` 0: no digest) chunk by chunk after its swaps.

    `index` must be strictly increasing and inside elems; the pass stops at the first position
    that is not and returns how many swaps it made (the caller undoes exactly those), else
    index.size. A stopped pass has fed the digest only part of the tensor."""
    n = elems.size
    m = index.size
    j = 0
    last = -1
    for o in range(0, n, CHUNK):
        e = min(o + CHUNK, n)
        while j < m and index[j] < e:
            p = index[j]
            if p <= last:  # out of order (or below 0): stop, the caller reverts the j swaps made
                return j
            v = elems[p]
            elems[p] = values[j]
            values[j] = v
            last = p
            j += 1
        if function:
            hash_update(function, state, elems, o, e)
    return j


@nb.njit(cache=True, nogil=True)
def put(elems, index, values, count):
    """elems[index[j]] = values[j] for j < count: an undo (no allocation, so it cannot fail for memory)."""
    for j in range(count):
        elems[index[j]] = values[j]
