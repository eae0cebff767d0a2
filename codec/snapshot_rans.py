"""The compressed snapshot's BF16 kernels: the exponent byte rANS-coded, sign and mantissa kept as bytes.

What was measured on all-MiniLM-L6-v2 in BF16 (`scripts/snapshot_entropy.py`): order-0
exponent entropy is 2.614 bits per element; conditioning on the previous element's exponent
gives 2.610, the sign is 1.000 bits whatever its context, and the mantissa conditioned on the
exponent 6.924 of 7 bits. So a block codes its exponents with one static order-0 table
(per block of 2**18 elements: local statistics bring 2.614 down to ~2.59) and stores
`sign << 7 | mantissa` as a plain byte plane, which a decoder copies at memory speed.

Coder: the codec's rANS conventions (`rans.py`: 64-bit state in [2**31, 2**63), 32-bit words
read from the end) with precision 2**12 and four interleaved states (element i uses state
i mod 4: four independent dependency chains). The decoder looks up one packed uint32 per
slot (`symbol | freq << 8 | (slot - cum) << 20`), so a symbol costs one load, a multiply and
an add; the word pull is branch-free and an over-read is caught by the end check.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import rans

SCALE = 12
STATES = 4
CHUNK = 1 << 12  # elements decoded before their sign and mantissa are merged (L1-sized)
PAD = 4  # zero words before a block's stream in the decoder: one group's worth of pulls
_U = np.uint64


@nb.njit(cache=True, nogil=True)
def packed_table(freq):
    """The decoder's slot table for 256 frequencies summing to 2**SCALE (each < 2**SCALE): slot
    `cum[s] + j` of symbol s holds `s | freq[s] << 8 | j << 20`."""
    table = np.empty(1 << SCALE, np.uint32)
    at = 0
    for s in range(256):
        f = freq[s]
        for j in range(f):
            table[at + j] = np.uint32(s | (f << 8) | (j << 20))
        at += f
    return table


@nb.njit(cache=True, nogil=True)
def histograms(elems):
    """(exponent counts, residual-byte counts) of a block of BF16 bit patterns."""
    he = np.zeros(256, np.int64)
    hr = np.zeros(256, np.int64)
    for i in range(elems.size):
        b = elems[i]
        he[(b >> 7) & 0xFF] += 1
        hr[((b >> 8) & 0x80) | (b & 0x7F)] += 1
    return he, hr


@nb.njit(cache=True, nogil=True)
def encode_block(elems, freq, cum, rcp, rsh, residual):
    """rANS-code the exponents of `elems` backwards (element i with state i % 4) and write each
    element's `sign << 7 | mantissa` into `residual`. Returns (words, n_words, x0, x1, x2, x3)."""
    n = elems.size
    words = np.empty(3 * n // 8 + 64, np.int64)  # a symbol of freq >= 1 costs at most 12 bits
    nw = 0
    L = rans.RANS_L
    WM = rans.WORD_MASK
    xs = np.full(4, L, np.int64)
    for i in range(n - 1, -1, -1):
        b = elems[i]
        residual[i] = ((b >> 8) & 0x80) | (b & 0x7F)
        s = _U((b >> 7) & 0xFF)
        k = i & 3
        x = xs[k]
        f = np.int64(freq[s])
        if x >= ((L >> SCALE) << 32) * f:
            if nw >= words.size:  # cannot happen with valid tables; a guard, not a path
                return words, -1, xs[0], xs[1], xs[2], xs[3]
            words[nw] = x & WM
            nw += 1
            x >>= 32
        q = x if f == 1 else np.int64(rans.umulhi(np.uint64(x), rcp[s]) >> np.uint64(rsh[s]))
        xs[k] = (q << SCALE) + (x - q * f) + cum[s]
    return words, nw, xs[0], xs[1], xs[2], xs[3]


@nb.njit(cache=True, nogil=True, inline="always")
def merge(residual, out, start, stop):
    """Sign and mantissa into elements [start, stop) of `out`, which hold their exponents: a loop of
    its own, which the compiler vectorises."""
    for j in range(start, stop):
        r = np.uint16(residual[j])
        out[j] |= ((r & np.uint16(0x80)) << np.uint16(8)) | (r & np.uint16(0x7F))


@nb.njit(cache=True, nogil=True)
def decode_block(table, words, x0, x1, x2, x3, residual, out):
    """The inverse of `encode_block` into `out` (uint16, residual.size elements). Returns True
    only if every word was consumed and all four states ended at exactly 2**31. The rANS loop
    writes only the exponents; sign and mantissa are merged after each chunk of CHUNK elements, in a
    loop the compiler vectorises (measured ~10% faster than merging in the serial loop), while the
    chunk is still in cache."""
    n = out.size
    L = rans.RANS_L
    M = (1 << SCALE) - 1
    # the words behind PAD zeros, so that a group of four symbols needs one bounds check: a
    # forged stream that runs out reads those zeros and is refused right after its group
    padded = np.zeros(words.size + PAD, np.uint32)
    for j in range(words.size):
        padded[j + PAD] = words[j]
    pos = np.int64(words.size) - 1
    i = 0
    n4 = n - (n & 3)
    while i < n4:
        start = i
        stop = min(i + CHUNK, n4)
        while i < stop:
            if pos < -1:
                return False
            e = np.int64(table[_U(x0 & M)])
            x0 = ((e >> 8) & M) * (x0 >> SCALE) + (e >> 20)
            if x0 < L:
                x0 = (x0 << 32) | np.int64(padded[_U(pos + PAD)])
                pos -= 1
            out[_U(i)] = np.uint16((e & 0xFF) << 7)
            e = np.int64(table[_U(x1 & M)])
            x1 = ((e >> 8) & M) * (x1 >> SCALE) + (e >> 20)
            if x1 < L:
                x1 = (x1 << 32) | np.int64(padded[_U(pos + PAD)])
                pos -= 1
            out[_U(i + 1)] = np.uint16((e & 0xFF) << 7)
            e = np.int64(table[_U(x2 & M)])
            x2 = ((e >> 8) & M) * (x2 >> SCALE) + (e >> 20)
            if x2 < L:
                x2 = (x2 << 32) | np.int64(padded[_U(pos + PAD)])
                pos -= 1
            out[_U(i + 2)] = np.uint16((e & 0xFF) << 7)
            e = np.int64(table[_U(x3 & M)])
            x3 = ((e >> 8) & M) * (x3 >> SCALE) + (e >> 20)
            if x3 < L:
                x3 = (x3 << 32) | np.int64(padded[_U(pos + PAD)])
                pos -= 1
            out[_U(i + 3)] = np.uint16((e & 0xFF) << 7)
            i += 4
        merge(residual, out, start, stop)  # while the chunk is in L1/L2
    if pos < -1:
        return False
    while i < n:  # the last n % 4 elements: states 0, 1, 2 in turn
        k = i & 3
        x = x0 if k == 0 else (x1 if k == 1 else x2)
        e = np.int64(table[_U(x & M)])
        x = ((e >> 8) & M) * (x >> SCALE) + (e >> 20)
        if x < L:
            if pos < 0:
                return False
            x = (x << 32) | np.int64(padded[_U(pos + PAD)])
            pos -= 1
        out[_U(i)] = np.uint16((e & 0xFF) << 7)
        if k == 0:
            x0 = x
        elif k == 1:
            x1 = x
        else:
            x2 = x
        i += 1
    merge(residual, out, n4, n)
    return pos == -1 and x0 == L and x1 == L and x2 == L and x3 == L
