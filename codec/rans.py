"""A 64-bit-state rANS entropy coder, compiled with numba, plus the "hybrid uint" tokenizer.

Why our own coder: the conditional method interleaves symbols from many small static models
(one per context) with raw bits in a single stream, and must run inside the same compiled loop
that walks the tensor; a library call per symbol would cost more than the coding itself.

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

RANS_L = 1 << 31
WORD_MASK = (1 << 32) - 1
DIRECT = 8  # values below this are their own token
SUB_BITS = 2


def token_count(max_bits: int) -> int:
    """Alphabet size for values below 2**max_bits."""
    return DIRECT + (max_bits - 3) * (1 << SUB_BITS)


@nb.njit(inline="always", cache=True)
def bit_length(v):
    n = 0
    if v >= (1 << 32):
        v >>= 32
        n += 32
    if v >= (1 << 16):
        v >>= 16
        n += 16
    if v >= (1 << 8):
        v >>= 8
        n += 8
    if v >= (1 << 4):
        v >>= 4
        n += 4
    if v >= (1 << 2):
        v >>= 2
        n += 2
    if v >= (1 << 1):
        v >>= 1
        n += 1
    return n + v


@nb.njit(inline="always", cache=True)
def tokenize(v):
    """(token, n_extra_bits, extra) for a value v >= 0."""
    if v < DIRECT:
        return v, 0, 0
    n = bit_length(v) - 1
    nbits = n - SUB_BITS
    sub = (v >> nbits) & ((1 << SUB_BITS) - 1)
    return DIRECT + (n - 3) * (1 << SUB_BITS) + sub, nbits, v & ((1 << nbits) - 1)


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


@nb.njit(inline="always", cache=True)
def enc_put(x, words, nw, start, freq, scale):
    x_max = ((RANS_L >> scale) << 32) * freq
    if x >= x_max:
        words[nw] = x & WORD_MASK
        nw += 1
        x >>= 32
    q = x // freq  # the only division per symbol
    return (q << scale) + (x - q * freq) + start, nw


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
def dec_symbol(x, words, pos, cum, freq, slots, row, scale):
    """Decode one symbol with row `row` of 2-D tables (`slots` from `slot_table`).

    One load finds the symbol of the state's slot: no search, no data-dependent branch.
    Tables are indexed in place, never sliced (a row view would cost reference counting
    per symbol). Returns (symbol, x, pos)."""
    slot = x & ((1 << scale) - 1)
    s = np.int64(slots[row, slot])
    x = freq[row, s] * (x >> scale) + slot - cum[row, s]
    x, pos = dec_renorm(x, words, pos)
    return s, x, pos


@nb.njit(inline="always", cache=True)
def dec_token_value(x, words, pos, cum, freq, slots, row, scale):
    """A hybrid-uint value: its token under row `row`, then the token's raw bits.

    Tokens with at most 16 raw bits (every value token, nearly every gap) take the
    straight-line path. Returns (value, x, pos)."""
    tok, x, pos = dec_symbol(x, words, pos, cum, freq, slots, row, scale)
    base, nbits = token_base(tok)
    if nbits <= 16:
        value = x & ((1 << nbits) - 1)
        x >>= nbits
        x, pos = dec_renorm(x, words, pos)
        return base + value, x, pos
    extra, x, pos = dec_bits(x, words, pos, nbits)
    return base + extra, x, pos


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


def words_to_bytes(words: np.ndarray, nw: int, x: int) -> bytes:
    out = np.empty(nw + 2, np.uint32)
    out[:nw] = words[:nw]
    out[nw] = x & WORD_MASK
    out[nw + 1] = x >> 32
    return out.astype("<u4").tobytes()


def bytes_to_words(data: bytes) -> tuple[np.ndarray, int] | None:
    """(words as int64, initial state) or None if malformed."""
    if len(data) % 4 or len(data) < 8:
        return None
    w = np.frombuffer(data, "<u4").astype(np.int64)
    x = int(w[-2]) | (int(w[-1]) << 32)
    if not RANS_L <= x < (1 << 63):
        return None
    return w[:-2].copy(), x


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


def slot_table(freq: np.ndarray, scale: int) -> np.ndarray:
    """Per row, the symbol owning each of the 2**scale slots (uint8: symbols < 256).

    What `dec_symbol` looks up: one byte per slot keeps a row of a 2**14 table at 16 KiB."""
    rows = np.atleast_2d(freq)
    if rows.shape[-1] > 256:
        raise ValueError("slot tables hold symbols below 256")
    out = np.empty((rows.shape[0], 1 << scale), np.uint8)
    symbols = np.arange(rows.shape[-1], dtype=np.uint8)
    for i, row in enumerate(rows):
        out[i] = np.repeat(symbols, row)
    return out.reshape(freq.shape[:-1] + (1 << scale,))


def cumulative(freq: np.ndarray) -> np.ndarray:
    """Cumulative frequencies (int32: small tables stay in cache), one more column than `freq`."""
    cum = np.zeros(freq.shape[:-1] + (freq.shape[-1] + 1,), np.int64)
    np.cumsum(freq, axis=-1, out=cum[..., 1:])
    return cum.astype(np.int32)
