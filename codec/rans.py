"""The rANS coder's definition and tables: a 64-bit state, 32-bit words, "hybrid uint" tokens.

Why our own coder: the conditional method interleaves symbols from many small static models
(one per class or exponent) with raw bits in a single stream, inside compiled loops; a library
call per symbol would cost more than the coding itself. The hot loops themselves are written out
in `methods/conditional.py` (inlined numba helpers returning tuples cost 2-3x there); this module
holds what they share: constants, token bounds, the multi-chunk raw-bit paths, the encoder's
reciprocals, and the table builders.

State x lives in [L, L << 32) with L = 2**31, so it fits a signed int64 and numba never mixes
signed and unsigned arithmetic. Words are 32 bits. Encoding runs backwards over the symbols
and pushes words; decoding pops them from the end. After the last symbol the decoder's state
must equal L again and every word must be consumed: a free integrity check.

Tokens ("hybrid uint"): values below 8 are their own token; a larger value v with top bit n
becomes token 8 + 4*(n-3) + (the two bits below the top bit), followed by n-2 raw bits.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from codec._intrinsic import typed_intrinsic

RANS_L = 1 << 31
WORD_MASK = (1 << 32) - 1
DIRECT = 8  # values below this are their own token
SUB_BITS = 2


def token_count(max_bits: int) -> int:
    """Alphabet size for values below 2**max_bits."""
    return DIRECT + (max_bits - 3) * (1 << SUB_BITS)


@nb.njit(inline="always", cache=True)
def token_base(tok):
    """(smallest value of token, n_extra_bits)."""
    if tok < DIRECT:
        return tok, 0
    k = tok - DIRECT
    n = 3 + (k >> SUB_BITS)
    sub = k & ((1 << SUB_BITS) - 1)
    nbits = n - SUB_BITS
    return ((1 << SUB_BITS) | sub) << nbits, nbits


@typed_intrinsic
def umulhi(typingctx, a, b):
    """High 64 bits of the 128-bit product of two uint64 (one multiply instruction)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


_RECIPROCALS: tuple[np.ndarray, np.ndarray] | None = None


def reciprocals(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, s) per frequency with x // f == umulhi(x, m) >> s for every 0 <= x < 2**63 (f >= 2;
    f == 1 has s = -1). m = ceil(2**(63 + l) / f) with 2**l >= f: the round-up method of
    Granlund and Montgomery, exact because m * f - 2**(63 + l) < f <= 2**l. A multiply
    instead of a 64-bit division per coded symbol."""
    global _RECIPROCALS
    if _RECIPROCALS is None:
        top = 1 << 15
        m = np.zeros(top, np.uint64)
        s = np.full(top, -1, np.int64)
        for f in range(2, top):
            bits = (f - 1).bit_length()
            m[f] = -(-(1 << (63 + bits)) // f)
            s[f] = bits - 1
        _RECIPROCALS = (m, s)
    freqs = np.asarray(freq, np.int64)
    if freqs.size and (freqs.min() < 0 or freqs.max() >= 1 << 15):
        raise ValueError("reciprocals cover frequencies below 2**15")
    return _RECIPROCALS[0][freqs], _RECIPROCALS[1][freqs]


@nb.njit(inline="always", cache=True)
def enc_bits(x, words, nw, value, nbits):
    """Raw bits as uniform symbols, in chunks of at most 16 bits (low chunk decoded first)."""
    # decoding reads low chunk first, so encode high chunks first
    # a uniform symbol has freq 1, so enc_put's division reduces to a shift
    nchunks = (nbits + 15) // 16
    for c in range(nchunks - 1, -1, -1):
        width = min(16, nbits - 16 * c)
        if x >= (RANS_L >> width) << 32:
            words[nw] = x & WORD_MASK
            nw += 1
            x >>= 32
        x = (x << width) | ((value >> (16 * c)) & ((1 << width) - 1))
    return x, nw


@nb.njit(inline="always", cache=True)
def dec_renorm(x, words, pos):
    """Pull a word if the state fell below L. pos < 0 after the last word signals exhaustion (-2 = error)."""
    if x < RANS_L:
        if pos < 0:
            return x, -2
        x = (x << 32) | words[pos]
        pos -= 1
    return x, pos


@nb.njit(inline="always", cache=True)
def dec_bits(x, words, pos, nbits):
    value = 0
    c = 0
    while 16 * c < nbits:
        width = min(16, nbits - 16 * c)
        v = x & ((1 << width) - 1)
        x = x >> width
        x, pos = dec_renorm(x, words, pos)
        value |= v << (16 * c)
        c += 1
    return value, x, pos


def words_to_bytes(words: np.ndarray, nw: int, states: tuple[int, ...]) -> bytes:
    """The stream: the emitted words in emission order, then each final state as (low, high)."""
    out = np.empty(nw + 2 * len(states), np.uint32)
    out[:nw] = words[:nw]
    for i, x in enumerate(states):
        out[nw + 2 * i] = x & WORD_MASK
        out[nw + 2 * i + 1] = x >> 32
    return out.astype("<u4").tobytes()


def bytes_to_words(data: bytes | memoryview, n_states: int = 1) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """(the words, a read-only uint32 view without copy; initial states) or None if malformed."""
    if len(data) % 4 or len(data) < 8 * n_states:
        return None
    w = np.frombuffer(data, "<u4")
    tail = w[w.size - 2 * n_states:].astype(np.int64)
    states = tuple(int(tail[2 * i]) | (int(tail[2 * i + 1]) << 32) for i in range(n_states))
    if not all(RANS_L <= x < (1 << 63) for x in states):
        return None
    return w[: w.size - 2 * n_states], states


def normalize(counts: np.ndarray, scale: int, floor_all: bool) -> np.ndarray:
    """Integer frequencies summing to 2**scale, deterministic, every counted symbol >= 1.

    `floor_all` gives every symbol at least 1 (parametric tables must code any value).
    No symbol gets the whole range, so the int64 state never overflows.
    """
    total = 1 << scale
    counts = np.asarray(counts, dtype=np.float64)
    keep = np.ones(counts.size, bool) if floor_all else counts > 0
    if keep.sum() < 2:  # make room for a second symbol
        spare = int(np.flatnonzero(~keep)[0]) if (~keep).any() else (0 if counts.size > 1 else None)
        keep[spare] = True
    freq = np.zeros(counts.size, np.int64)
    mass = counts[keep].sum()
    share = counts[keep] / mass if mass > 0 else np.full(keep.sum(), 1.0 / keep.sum())
    budget = total - int(keep.sum())
    freq[keep] = 1 + np.floor(share * budget).astype(np.int64)
    freq[int(np.argmax(np.where(keep, counts, -1.0)))] += total - int(freq.sum())
    return freq


def normalize_rows(counts: np.ndarray, scale: int) -> np.ndarray:
    """`normalize(row, scale, floor_all=False)` for every row of integer counts at once (each row
    with at least one count); the same result exactly, without a numpy round trip per row."""
    total = 1 << scale
    counts = np.asarray(counts, dtype=np.float64)
    keep = counts > 0
    lonely = keep.sum(axis=1) < 2  # make room for a second symbol: the first empty one
    if lonely.any():
        rows = np.flatnonzero(lonely)
        keep[rows, np.argmax(~keep[rows], axis=1)] = True
    mass = counts.sum(axis=1, keepdims=True)  # integer-valued: exact in any order
    budget = total - keep.sum(axis=1, keepdims=True)
    freq = np.where(keep, 1 + np.floor(counts / mass * budget), 0).astype(np.int64)
    top = np.argmax(np.where(keep, counts, -1.0), axis=1)
    freq[np.arange(freq.shape[0]), top] += total - freq.sum(axis=1)
    return freq


def slot_table(freq: np.ndarray, scale: int) -> np.ndarray:
    """Per row, the symbol owning each of the 2**scale slots (uint8: symbols < 256).

    What `dec_symbol` looks up: one byte per slot keeps a row of a 2**14 table at 16 KiB."""
    rows = np.atleast_2d(freq)
    if rows.shape[-1] > 256:
        raise ValueError("slot tables hold symbols below 256")
    if rows.size and (rows.min() < 0 or (rows.sum(axis=-1) != 1 << scale).any()):
        raise ValueError(f"slot tables need frequencies summing to 2**{scale} in every row")
    out = _slot_rows(np.ascontiguousarray(rows.reshape(-1, rows.shape[-1]), np.int64), 1 << scale)
    return out.reshape(freq.shape[:-1] + (1 << scale,))


@nb.njit(cache=True, nogil=True)
def _slot_rows(freq, slots):
    """`slot_table`'s loop (a payload's decoder builds one per value key)."""
    out = np.empty((freq.shape[0], slots), np.uint8)
    for r in range(freq.shape[0]):
        at = 0
        for t in range(freq.shape[1]):
            out[r, at:at + freq[r, t]] = t
            at += freq[r, t]
    return out


def cumulative(freq: np.ndarray) -> np.ndarray:
    """Cumulative frequencies (int32: small tables stay in cache), one more column than `freq`."""
    cum = np.zeros(freq.shape[:-1] + (freq.shape[-1] + 1,), np.int64)
    np.cumsum(freq, axis=-1, out=cum[..., 1:])
    return cum.astype(np.int32)
