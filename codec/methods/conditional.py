"""Method 3, `conditional` (codec v2): BF16 changes entropy-coded with models conditioned on the base.

The receiver holds the base, and the base predicts the delta: an AdamW step shows up in BF16
when it crosses a rounding boundary, i.e. with probability ~|dw| / ulp(w), and ulp(w) depends
only on the exponent. So every element gets a context: its base exponent (the key).

- Mask: each tensor splits the exponent axis into at most 8 classes (intervals chosen to minimise
  the mask's order-0 cost, `exponent_classes.py`); the changed elements of a class form a
  Bernoulli sequence. We code the gaps (runs of unchanged elements of the same class) with a
  geometric model whose parameter is sent as one of 256 quantised levels per (tensor, class).
  Cost ~ the order-0 entropy of the mask given (tensor, exponent class), paid per change, not per
  element; 8 intervals come within ~2% of one context per exponent, and let the scans
  describe a block of 64 elements with 7 vector comparisons.
- Values: the change as a signed step in ordered-integer space (ord(x) = ~x for negatives,
  x ^ 0x8000 for positives), zigzagged and tokenized, coded with one table per key shared by all
  tensors of the payload (small weights move more ULPs). Exponent/sign changes, zero crossings,
  NaN and Inf are just large steps: no escape needed, every bit pattern round-trips.
- v4, column votes: the changes of a weight's column mostly move the same way (an update's sign
  is shared along its input axis), so each column keeps a saturating counter (-4..4) of its
  changes' directions, and a change's value is coded with the table of (key, |counter|), its
  step negated where the counter is negative: values ~1.38 -> ~1.12 bits per change on MiniLM
  (scripts/context_study.py measured the alternatives; the encoder keeps v3's key tables where
  votes would cost more, e.g. tiny payloads).
- One rANS stream per tensor: every class's gaps first, then the values in tensor order, so
  the decoder runs three tight compiled phases (class bitmaps, one pass over the base that
  deposits them into positions, values) instead of stopping its scan at every change.

Measured on MiniLM corpora (see the closing notes): the base's top mantissa bit adds nothing to
the mask (ulp is constant within a binade); per-tensor mask levels win ~2-9%; the key cuts the
value stream from ~1.8 to ~1.35 bits per change; the base's sign adds < 0.01 bit.

`Conditional` (at the end) is this method behind the codec's `Method` interface (base.py): the
batched scans, the payload's value tables and interleave rule, the batched decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numba as nb
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros

import torch

from .. import hashing, memory, rans, tensors
from ..container import Entry, Stream
from ..compressors import RAW
from ..errors import DeltaError
from ..hashing import Running, digest_bytes, hash_digest, hash_reset, hash_update, header_bytes
from ..wire import _decode_uvarints, put_uvarint, read_uvarints, uvarints
from . import exponent_classes as ec
from .base import Job, Method, Patch, SharedBlock, parsed_block

# numba's own intrinsic, typed as kernels call it (codec._intrinsic says why)
leading_zeros: Callable[..., Any] = _leading_zeros
trailing_zeros: Callable[..., Any] = _trailing_zeros

ID = 3
NAME = "conditional"
VERSIONS = (2, 3, 4)
# The dtypes coded: both 16-bit floats with the sign in bit 15. The model reads bit patterns only, so F16 is coded as
# is; its key (bits 14..7) is then the 5 exponent bits and the top 3 mantissa bits, which predict a change as BF16's
# exponent does. Every decoder since v2 takes method 3 on any 2-byte element (docs/FORMAT.md), so no version is
# needed; encoders code F16 with it from F16_FROM on, so that v2 and v3 encodes (and their vectors) stay as they were.
CODED = (tensors.BF16, tensors.F16)
F16_FROM = 4
SHARED_VALUE_TABLES = 1  # key in Payload.shared
SHARED_INTERLEAVE = 2  # key in Payload.shared (v3): from how many changes a record uses four states
SHARED_VOTE_TABLES = 3  # key in Payload.shared (v4): value tables keyed by (key, column vote strength)

KEY_SHIFT = ec.KEY_SHIFT  # key = (bits >> 7) & 0xFF: the exponent
MAX_CLASSES = ec.MAX_CLASSES
N_KEYS = 256
N_LEVELS = 256
LEVELS_PER_OCTAVE = 6
GAP_BITS = 48
GAP_TOKENS = rans.token_count(GAP_BITS)
VALUE_BITS = 17
VALUE_TOKENS = rans.token_count(VALUE_BITS)
VALUE_SYMBOL_BITS = ec.VALUE_SYMBOL_BITS  # a value symbol is key << 6 | token (`_value_symbols`)
if VALUE_TOKENS > 1 << VALUE_SYMBOL_BITS:
    raise ImportError("value tokens must fit the value symbols' 6 bits")
# v4's value context (docs/FORMAT.md, "Column votes"; the vote symbols are made by the encoder's
# scan, `exponent_classes._part_votes`): a change is coded with the table of (key, |its column's
# counter|), its step negated where the counter is negative.
VOTE_LIMIT = ec.VOTE_LIMIT
VOTE_LEVELS = ec.VOTE_LEVELS
N_CONTEXTS = N_KEYS * VOTE_LEVELS
CONTEXT_MASK = 0x7FF  # (symbol >> 6) & CONTEXT_MASK: the table row's context, v3 symbols' key alike
FLIP_BIT = ec.FLIP_BIT
# v4: a record whose params' first byte has this bit (with vote tables in the payload) is still:
# its columns do not vote (every counter stays 0), so its values are key-table values coded with
# each key's counter-0 table. The encoder keeps votes for records whose changes follow them.
STILL = 0x80
STILL_AGREEMENT = 0.6  # votes kept where at least this share of changes with a counter follow it
STILL_MIN_VOTED = 64  # and at least this many changes had one
_column = ec._column
if N_CONTEXTS > CONTEXT_MASK + 1 or (N_CONTEXTS << VALUE_SYMBOL_BITS) > 1 << FLIP_BIT:
    raise ImportError("vote contexts must fit the vote symbols' bits")
MASK_SCALE = 15
VALUE_SCALE = 12
BUCKET_SHIFT = 4  # the decoder's value-slot buckets (`ValueModel.slots`): 2**4 slots each
STATES = 2  # interleaved rANS states of a record, or FOUR_STATES where the payload's rule says
FOUR_STATES = 4
FOUR_STATES_FROM = 4096  # the rule this encoder writes in v3: records with this many changes or more
NEVER = 1 << 62  # the rule of a payload without one (v2): no record uses four states
# Hot loops index with unsigned integers: numba then emits no negative-index wraparound code
# (measured 1.6x on the value loop).
_U = np.uint64
# Each gap token's smallest value and raw bit count (rans.token_base as tables: the decoder then
# needs no branch on whether a token carries raw bits)
_GAP_TOKEN_BASE = np.array([rans.token_base.py_func(t)[0] for t in range(GAP_TOKENS)], np.int64)
_GAP_TOKEN_BITS = np.array([rans.token_base.py_func(t)[1] for t in range(GAP_TOKENS)], np.int64)


# floor(2**52 * 2**(-r/6)) for r = 0..5: the levels are exact binary fractions, so every
# machine builds bit-identical tables (no libm pow/exp in the format's definition).
_LEVEL_MANTISSAS = (4503599627370496, 4012251135041684, 3574509393065758, 3184525836262886,
                    2837089985411397, 2527559831251808)


def level_probability() -> np.ndarray:
    """p of each mask level j: 2**(-(j+1)/6) (as an exact binary fraction), 0.89 down to ~1.5e-13."""
    j = np.arange(N_LEVELS) + 1
    mant = np.array(_LEVEL_MANTISSAS, dtype=np.float64)[j % LEVELS_PER_OCTAVE]
    return np.ldexp(mant, -(52 + j // LEVELS_PER_OCTAVE))


def _geometric_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frequencies of gap tokens under Geometric(p) for every level.

    Deterministic on any IEEE-754 machine: q**a is built from repeated squaring and products
    only (no libm pow/exp), then quantised with integer arithmetic.
    """
    q = 1.0 - level_probability()
    bounds = np.array([int(_token_base_py(t)[0]) for t in range(GAP_TOKENS)] + [1 << GAP_BITS], dtype=np.int64)
    sq = np.empty((GAP_BITS + 1, N_LEVELS))
    sq[0] = q
    for k in range(1, GAP_BITS + 1):
        sq[k] = sq[k - 1] * sq[k - 1]
    powers = np.ones((N_LEVELS, bounds.size))
    for k in range(GAP_BITS + 1):
        bit = ((bounds >> k) & 1).astype(bool)
        powers[:, bit] *= sq[k][:, None]
    probs = powers[:, :-1] - powers[:, 1:]
    probs[:, -1] = powers[:, -2]  # the last token takes the whole tail
    freq = np.stack([rans.normalize(row, MASK_SCALE, floor_all=True) for row in probs])
    cum = rans.cumulative(freq)
    return freq.astype(np.int32), cum, rans.slot_table(freq, MASK_SCALE)


def _token_base_py(tok: int) -> tuple[int, int]:
    return rans.token_base.py_func(tok)


_MASK_TABLES: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def mask_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(freq, cum, symbol-of-slot) for every mask level, built once per process (8 MiB of slots)."""
    global _MASK_TABLES
    if _MASK_TABLES is None:
        _MASK_TABLES = _geometric_tables()
    return _MASK_TABLES


_MASK_RECIPROCALS: tuple[np.ndarray, np.ndarray] | None = None


def mask_reciprocals() -> tuple[np.ndarray, np.ndarray]:
    """The encoder's division-free form of every mask frequency (rans.reciprocals)."""
    global _MASK_RECIPROCALS
    if _MASK_RECIPROCALS is None:
        _MASK_RECIPROCALS = rans.reciprocals(mask_tables()[0])
    return _MASK_RECIPROCALS


# ---------------------------------------------------------------- compiled kernels

@nb.njit(cache=True, nogil=True)
def _value_symbols(pairs):
    """Each change's value symbol: key << 6 | token of its zigzagged step (VALUE_TOKENS = 64).
    Branch-free, so the loop vectorises (lzcnt and all); the value tables' statistics and the
    encoder's value loop both read these instead of recomputing the step."""
    out = np.empty(pairs.size, np.uint16)
    _value_symbols_into(pairs, out)
    return out


@nb.njit(inline="always", cache=True)
def _key_and_token(pair):
    """(key, token of the zigzagged step) of a change's (base << 16 | target) pair. Branch-free,
    so loops over it vectorise (lzcnt and all)."""
    bv = np.int64(pair >> np.uint32(16))
    v = ec._zigzag(bv, np.int64(pair & np.uint32(0xFFFF)))
    n = 63 - np.int64(leading_zeros(np.uint64(v | 1)))
    big = (rans.DIRECT + (n - 3) * (1 << rans.SUB_BITS)
           + ((v >> max(n - rans.SUB_BITS, 0)) & ((1 << rans.SUB_BITS) - 1)))
    return (bv >> KEY_SHIFT) & 0xFF, (v if v < rans.DIRECT else big)


@nb.njit(cache=True, nogil=True)
def _value_symbols_into(pairs, out):
    """`_value_symbols` into out[:pairs.size]."""
    for j in range(pairs.size):
        key, tok = _key_and_token(pairs[j])
        out[j] = np.uint16((key << VALUE_SYMBOL_BITS) | tok)


@nb.njit(cache=True, nogil=True)
def _counter0_symbols(pairs, out, j0, j1):
    """out[j0:j1]: the vote symbols of a still record's changes (STILL), from their pairs
    pairs[j0:j1]: context key * VOTE_LEVELS (counter 0), the token as is, never flipped."""
    for j in range(j0, j1):
        key, tok = _key_and_token(pairs[j])
        out[j] = np.uint32(((key * VOTE_LEVELS) << VALUE_SYMBOL_BITS) | tok)


@nb.njit(cache=True, nogil=True)
def _settle(tally, pairs, votes, first):
    """v4's still records (STILL): for each tensor i (changes [first[i], first[i + 1])), whether
    its columns' votes are worth coding with, from its tally (`exponent_classes._part_votes`:
    changes that met a counter, those that moved its way, and whether the scan stopped voting
    early): at least STILL_MIN_VOTED of its changes met a counter (|v| >= 1) and at least
    STILL_AGREEMENT of those moved its way. Where not, the tensor's vote symbols are rewritten in
    place as counter-0 ones (context key * VOTE_LEVELS, never flipped), from its pairs.
    Returns still (uint8) per tensor.

    Why: on MiniLM only the embedding (or an untied head) has columns that lean (~93% agree);
    the dense layers' changes follow their column's counter half the time, and mixed into the
    same vote contexts they flatten the embedding's skew (their values cost ~7% more that way)."""
    m = first.size - 1
    still = np.zeros(m, np.uint8)
    for i in range(m):
        voted, agreed, early = tally[i, 0], tally[i, 1], tally[i, 2]
        if early == 0 and voted >= STILL_MIN_VOTED and agreed >= STILL_AGREEMENT * voted:
            continue
        still[i] = 1
        _counter0_symbols(pairs, votes, first[i], first[i + 1])
    return still


@nb.njit(cache=True, nogil=True)
def _count_votes(symbols, votes, keys):
    """Both of v4's histograms from its vote symbols, in one pass: votes[context << 6 | token] +=
    1 (`_count_symbols`), and keys[key << 6 | token] += 1, the value symbol the change would have
    without votes (`_value_symbols`): key = context // VOTE_LEVELS, and the token unflipped. The
    flip negates the step, which toggles zigzag's low bit, and a token holds that bit only below
    rans.DIRECT (above, it is among the raw bits). So the payload's key tables are costed without
    making, or counting, a value symbol per change."""
    for j in range(symbols.size):
        sym = np.uint64(symbols[j])  # unsigned: no wraparound code
        ctx = (sym >> np.uint64(VALUE_SYMBOL_BITS)) & np.uint64(CONTEXT_MASK)
        tok = sym & np.uint64(VALUE_TOKENS - 1)
        flip = (sym >> np.uint64(FLIP_BIT)) & np.uint64(1)
        votes[(ctx << np.uint64(VALUE_SYMBOL_BITS)) | tok] += 1
        plain = tok ^ (flip & np.uint64(tok < np.uint64(rans.DIRECT)))
        keys[((ctx // np.uint64(VOTE_LEVELS)) << np.uint64(VALUE_SYMBOL_BITS)) | plain] += 1


@nb.njit(cache=True, nogil=True)
def _count_symbols(symbols, hist):
    """hist[context << 6 | token] += 1 per symbol (hist: the flat contexts x VALUE_TOKENS
    histogram; a vote symbol's flip bit is not part of it)."""
    for j in range(symbols.size):
        hist[np.uint64(symbols[j]) & np.uint64((1 << FLIP_BIT) - 1)] += 1  # unsigned: no wraparound code


def vote_columns(shape: tuple[int, ...]) -> int:
    """The columns of a tensor for its column votes: its last dimension when it has two or more,
    else 1 (the whole tensor is one column)."""
    return max(int(shape[-1]), 1) if len(shape) >= 2 else 1


def _specialised(four: bool):
    """The kernels whose hot loops rotate the interleaved rANS states, compiled for two states or,
    with `four`, for four. `four` is a closure constant, so neither version's loops test it (a
    runtime flag in the loops cost the four-state decoder its ~5% gain). Returns (encode,
    decode_gaps, decode_values)."""

    def encode(pairs, symbols, cls, ranks, class_changes, level_of_class, mcum, mfreq, mrcp, mrsh, vcum, vfreq, vrcp,
               vrsh, vrow_of_key):
        """rANS-code the changes in reverse of the order the decoder consumes them (docs/FORMAT.md):
        first every class's gaps (class 0 first), then every value in tensor order. Symbol i of that
        order uses state i % 2, or i % 4 if `four`: interleaved states split the decoder's
        dependency chain (four decode a tensor with many changes ~6% faster than two).

        Each symbol: its token's raw bits, then the token (the decoder reads the token first). The
        values' keys and tokens are `_value_symbols`; the step itself is recomputed only for tokens
        with raw bits. The loops are written out: inlined helpers returning tuples cost 2-3x here,
        and the division by the token's frequency is a multiply by its reciprocal (rans.reciprocals).
        Returns (words, n_words, final states 0..3; states 2 and 3 stay 2**31 unless `four`)."""
        k = pairs.size
        words = np.empty(8 * k + 16, np.int64)
        nw = np.int64(0)
        # the gaps' ranks grouped by class while the values are coded (a stable counting sort, filled
        # from each class's end as j runs backwards: its stores hide behind the values' coding, where
        # a pass of their own stalled on the counters, ~1.3 ms of MiniLM's 8.7)
        end = np.zeros(MAX_CLASSES + 1, np.int64)  # end[c + 1]: where class c's ranks end, then start
        for ci in range(class_changes.size):
            end[ci + 1] = class_changes[ci]
        for ci in range(MAX_CLASSES):
            end[ci + 1] += end[ci]
        stop = end.copy()
        grouped = np.empty(k, np.int64)  # ranks, class by class
        L = rans.RANS_L
        x = np.int64(L)  # the current symbol's state; p1..p3 those of the symbols before it
        p1 = np.int64(L)
        p2 = np.int64(L)
        p3 = np.int64(L)
        WM = rans.WORD_MASK
        for j in range(k - 1, -1, -1):  # values, last change first
            c = _U(cls[j]) + _U(1)
            g = end[c] - 1
            end[c] = g
            grouped[_U(g)] = ranks[j]
            sym = np.int64(symbols[j])
            row = _U(vrow_of_key[_U((sym >> 6) & CONTEXT_MASK)])  # the key (v3) or the vote context (v4)
            tok = sym & 63
            if tok >= rans.DIRECT:  # value tokens carry at most 15 raw bits: one chunk
                v = ec._zigzag(np.int64(pairs[j] >> np.uint32(16)), np.int64(pairs[j] & np.uint32(0xFFFF)))
                v ^= (sym >> FLIP_BIT) & 1  # a vote symbol's flipped step (v3 symbols have no such bit)
                nbits = 1 + ((tok - rans.DIRECT) >> rans.SUB_BITS)
                if x >= (L >> nbits) << 32:
                    words[_U(nw)] = x & WM
                    nw += 1
                    x >>= 32
                x = (x << nbits) | (v & ((1 << nbits) - 1))
            t = _U(tok)
            f = np.int64(vfreq[row, t])
            if x >= ((L >> VALUE_SCALE) << 32) * f:
                words[nw] = x & WM
                nw += 1
                x >>= 32
            q = x if f == 1 else np.int64(rans.umulhi(np.uint64(x), vrcp[row, t]) >> np.uint64(vrsh[row, t]))
            y = (q << VALUE_SCALE) + (x - q * f) + vcum[row, t]
            if four:  # loop-invariant: predicted every time
                x, p1, p2, p3 = p1, p2, p3, y
            else:
                x, p1 = p1, y
        for c in range(MAX_CLASSES - 1, -1, -1):  # class by class, each with its table rows hoisted
            lo = end[c + 1]  # class c's ranks are grouped[lo:stop[c + 1]]
            if lo >= stop[c + 1]:
                continue
            lv = level_of_class[c]
            fr = mfreq[lv]
            cu = mcum[lv]
            rc = mrcp[lv]
            rs = mrsh[lv]
            for jj in range(stop[c + 1] - 1, lo - 1, -1):
                v = grouped[_U(jj)] - (grouped[_U(jj - 1)] if jj > lo else -1) - 1  # the gap
                tok = v
                if v >= rans.DIRECT:
                    n = 63 - np.int64(leading_zeros(np.uint64(v)))
                    nbits = n - rans.SUB_BITS
                    tok = rans.DIRECT + (n - 3) * (1 << rans.SUB_BITS) + ((v >> nbits) & ((1 << rans.SUB_BITS) - 1))
                    if nbits > 16:
                        x, nw = rans.enc_bits(x, words, nw, v & ((1 << nbits) - 1), nbits)
                    else:  # emits written branch-free: gaps almost all carry raw bits, and whether
                        # a word goes out is a coin flip (measured ~8% faster than branches here)
                        e = np.int64(x >= (L >> nbits) << 32)
                        words[_U(nw)] = x & WM
                        nw += e
                        x >>= 32 * e
                        x = (x << nbits) | (v & ((1 << nbits) - 1))
                t = _U(tok)
                f = np.int64(fr[t])
                e = np.int64(x >= ((L >> MASK_SCALE) << 32) * f)
                words[_U(nw)] = x & WM
                nw += e
                x >>= 32 * e
                q = x if f == 1 else np.int64(rans.umulhi(np.uint64(x), rc[t]) >> np.uint64(rs[t]))
                y = (q << MASK_SCALE) + (x - q * f) + cu[t]
                if four:
                    x, p1, p2, p3 = p1, p2, p3, y
                else:
                    x, p1 = p1, y
        # after symbol 0 the rotation left state 0 in the last slot, state 1 before it, ...
        if four:
            return words, nw, p3, p2, p1, x
        return words, nw, p1, x, np.int64(L), np.int64(L)

    def decode_gaps(n, padded, words, x, o1, o2, o3, level_of_class, class_changes, mcum, mfreq, mslot):
        """Phase 1: every class's changes from its gap symbols, class 0 first, as the class bitmaps
        `ec.positions` reads (`ec.rank_bitmaps` layout: bit r of class c's region set where element r
        of the class changed). x is the state of the next symbol, o1..o3 the others (o1 the next's):
        they rotate per symbol, over two states (x, o1) or, if `four`, all four. The hot loop is
        written out (not via rans helpers): their inlined tuple returns cost 2-3x here.

        Words are pulled branch-free (whether the state needs one is a coin flip per symbol, and
        40% of gaps carry raw bits: branches there cost ~12% of this phase). A pull past the
        stream's first word reads a harmless word and leaves pos below -1, which every exit checks:
        the stream then ends early (status 1), whatever else went wrong after it.
        Returns (bits, start, lim, x, o1, o2, o3, pos, status)."""
        bits = np.zeros(ec.bitmap_words(padded), np.uint64)
        start = np.zeros(MAX_CLASSES, np.int64)
        lim = np.zeros(MAX_CLASSES, np.int64)
        pos = words.size - 1
        some = words.size > 0  # an empty stream has no word to read, even a harmless one
        at = 0
        L = rans.RANS_L
        mmask = (1 << MASK_SCALE) - 1
        for c in range(MAX_CLASSES):
            start[c] = at
            if c >= class_changes.size:
                continue
            lv = level_of_class[c]
            sl = mslot[lv]
            fr = mfreq[lv]
            cu = mcum[lv]
            r = -1
            for _ in range(class_changes[c]):
                slot = x & mmask
                t = _U(sl[_U(slot)])
                x = np.int64(fr[t]) * (x >> MASK_SCALE) + slot - cu[t]
                e = np.int64(x < L)  # pull a word if the state fell below L
                w = np.int64(words[_U(max(pos, 0))]) if some else 0
                x = (x << (32 * e)) | (w & -e)
                pos -= e
                nbits = _GAP_TOKEN_BITS[t]
                gap = _GAP_TOKEN_BASE[t]
                if nbits > 16:  # rare: gaps of 2**18 and more
                    if pos < -1:
                        return bits, start, lim, x, o1, o2, o3, pos, 1
                    extra, x, pos = rans.dec_bits(x, words, pos, nbits)
                    if pos == -2:
                        return bits, start, lim, x, o1, o2, o3, pos, 1
                    gap += extra
                else:  # nbits may be 0: then nothing moves
                    gap += x & ((1 << nbits) - 1)
                    x >>= nbits
                    e = np.int64(x < L)
                    w = np.int64(words[_U(max(pos, 0))]) if some else 0
                    x = (x << (32 * e)) | (w & -e)
                    pos -= e
                if four:  # loop-invariant: predicted every time
                    x, o1, o2, o3 = o1, o2, o3, x
                else:
                    x, o1 = o1, x
                r += gap + 1
                if r >= n:  # a rank beyond the tensor (also keeps r from overflowing)
                    return bits, start, lim, x, o1, o2, o3, pos, 1 if pos < -1 else 6
                w = at + (r >> 6)
                if w + 2 >= bits.size:  # more than any honest tensor's classes hold
                    return bits, start, lim, x, o1, o2, o3, pos, 1 if pos < -1 else 2
                bits[_U(w)] |= _U(1) << _U(r & 63)
            if pos < -1:
                return bits, start, lim, x, o1, o2, o3, pos, 1
            if r >= 0:
                lim[c] = (r >> 6) + 1
            at += lim[c] + 2
            if at > bits.size:
                return bits, start, lim, x, o1, o2, o3, pos, 2
        return bits, start, lim, x, o1, o2, o3, pos, 0

    def decode_values(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow_of_key, vals, out):
        """Phase 3, for changes j0..j1-1 (positions at[j]): their new values, in tensor order, into
        `out` (the target under construction) or, when `out` is empty, into vals. Returns
        (x, o1, o2, o3, pos, status)."""
        L = rans.RANS_L
        vmask = (1 << VALUE_SCALE) - 1
        writing = out.size > 0
        for j in range(j0, j1):
            where = _U(at[j])
            bv = np.int64(b[where])
            srow = vrow_of_key[_U((bv >> KEY_SHIFT) & 0xFF)]
            if srow < 0:
                return x, o1, o2, o3, pos, 3
            row = _U(srow)
            slot = x & vmask
            t = _U(vslot[row, _U(slot >> BUCKET_SHIFT)])  # the bucket's first token, then the slot's
            while vcum[row, t + _U(1)] <= slot:
                t += _U(1)
            x = np.int64(vfreq[row, t]) * (x >> VALUE_SCALE) + slot - vcum[row, t]
            if x < L:
                if pos < 0:
                    return x, o1, o2, o3, pos, 1
                x = (x << 32) | words[_U(pos)]
                pos -= 1
            tok = np.int64(t)
            u = tok
            if tok >= rans.DIRECT:  # value tokens carry at most 15 raw bits: one chunk
                u, nbits = rans.token_base(tok)
                u += x & ((1 << nbits) - 1)
                x >>= nbits
                if x < L:
                    if pos < 0:
                        return x, o1, o2, o3, pos, 1
                    x = (x << 32) | words[_U(pos)]
                    pos -= 1
            if four:
                x, o1, o2, o3 = o1, o2, o3, x
            else:
                x, o1 = o1, x
            o = ec.ordered(bv) + ec.unzigzag(u)
            if o < 0 or o > 0xFFFF:
                return x, o1, o2, o3, pos, 4
            new = ec.unordered(o)
            if writing:
                out[where] = new
            else:
                vals[j] = new
        return x, o1, o2, o3, pos, 0

    def decode_values_vote(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow_of_ctx, cols, votes,
                           vals, out):
        """`decode_values` with v4's column votes (docs/FORMAT.md): change j's table is that of
        its (key, |counter of its column|), its step negated where the counter is negative, and
        the counter (votes[column], carried across calls) moves by the step's direction. A
        change's column follows from the one before (`_column`): positions rise."""
        L = rans.RANS_L
        vmask = (1 << VALUE_SCALE) - 1
        writing = out.size > 0
        row0 = np.int64(0)
        for j in range(j0, j1):
            p = np.int64(at[j])
            where = _U(p)
            col, row0 = _column(p, cols, row0)
            c = _U(col)
            v = np.int64(votes[c])
            neg = np.int64(v < 0)
            bv = np.int64(b[where])
            srow = vrow_of_ctx[_U(((bv >> KEY_SHIFT) & 0xFF) * VOTE_LEVELS + (v ^ -neg) + neg)]
            if srow < 0:
                return x, o1, o2, o3, pos, 3
            row = _U(srow)
            slot = x & vmask
            t = _U(vslot[row, _U(slot >> BUCKET_SHIFT)])  # the bucket's first token, then the slot's
            while vcum[row, t + _U(1)] <= slot:
                t += _U(1)
            x = np.int64(vfreq[row, t]) * (x >> VALUE_SCALE) + slot - vcum[row, t]
            if x < L:
                if pos < 0:
                    return x, o1, o2, o3, pos, 1
                x = (x << 32) | words[_U(pos)]
                pos -= 1
            tok = np.int64(t)
            u = tok
            if tok >= rans.DIRECT:  # value tokens carry at most 15 raw bits: one chunk
                u, nbits = rans.token_base(tok)
                u += x & ((1 << nbits) - 1)
                x >>= nbits
                if x < L:
                    if pos < 0:
                        return x, o1, o2, o3, pos, 1
                    x = (x << 32) | words[_U(pos)]
                    pos -= 1
            if four:
                x, o1, o2, o3 = o1, o2, o3, x
            else:
                x, o1 = o1, x
            u ^= neg  # the coded step was negated where the column's counter is negative
            votes[c] = ec.vote_after(v, u)
            o = ec.ordered(bv) + ec.unzigzag(u)
            if o < 0 or o > 0xFFFF:
                return x, o1, o2, o3, pos, 4
            new = ec.unordered(o)
            if writing:
                out[where] = new
            else:
                vals[j] = new
        return x, o1, o2, o3, pos, 0

    kernels = []
    for fn in (encode, decode_gaps, decode_values, decode_values_vote):
        # a name of its own per state count: compiled code is linked by name, and two cached
        # kernels with one name (and the same per-process serial) would call each other's code
        fn.__name__ = f"_{fn.__name__}{FOUR_STATES if four else STATES}"
        fn.__qualname__ = fn.__name__
        kernels.append(nb.njit(cache=True, nogil=True)(fn))
    return tuple(kernels)


_encode2, _decode_gaps2, _decode_values2, _decode_values_vote2 = _specialised(False)
_encode4, _decode_gaps4, _decode_values4, _decode_values_vote4 = _specialised(True)


@nb.njit(cache=True, nogil=True)
def _encode(pairs, symbols, cls, ranks, class_changes, level_of_class, mcum, mfreq, mrcp, mrsh, vcum, vfreq, vrcp,
            vrsh, vrow_of_key, four):
    """`_specialised`'s encoder for two or four states (see there)."""
    if four:
        return _encode4(pairs, symbols, cls, ranks, class_changes, level_of_class, mcum, mfreq, mrcp, mrsh, vcum, vfreq,
                        vrcp, vrsh, vrow_of_key)
    return _encode2(pairs, symbols, cls, ranks, class_changes, level_of_class, mcum, mfreq, mrcp, mrsh, vcum, vfreq,
                    vrcp, vrsh, vrow_of_key)


@nb.njit(cache=True, nogil=True)
def _decode_gaps(n, padded, words, x, o1, o2, o3, four, level_of_class, class_changes, mcum, mfreq, mslot):
    """`_specialised`'s phase 1 for two or four states (see there)."""
    if four:
        return _decode_gaps4(n, padded, words, x, o1, o2, o3, level_of_class, class_changes, mcum, mfreq, mslot)
    return _decode_gaps2(n, padded, words, x, o1, o2, o3, level_of_class, class_changes, mcum, mfreq, mslot)


@nb.njit(cache=True, nogil=True)
def _decode_values(b, at, j0, j1, words, x, o1, o2, o3, four, pos, vcum, vfreq, vslot, vrow_of_key, vals, out):
    """`_specialised`'s phase 3 for two or four states (see there)."""
    if four:
        return _decode_values4(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow_of_key, vals, out)
    return _decode_values2(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow_of_key, vals, out)


@nb.njit(cache=True, nogil=True)
def _decode_values_any(b, at, j0, j1, words, x, o1, o2, o3, four, pos, vcum, vfreq, vslot, vrow, cols, votes, vals,
                       out):
    """Phase 3 of either model: `_decode_values` where `cols` is 0 (v2, v3: tables by key), else
    `decode_values_vote` over `cols` columns with their counters in `votes`."""
    if cols == 0:
        return _decode_values(b, at, j0, j1, words, x, o1, o2, o3, four, pos, vcum, vfreq, vslot, vrow, vals, out)
    if four:
        return _decode_values_vote4(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow, cols, votes,
                                    vals, out)
    return _decode_values_vote2(b, at, j0, j1, words, x, o1, o2, o3, pos, vcum, vfreq, vslot, vrow, cols, votes, vals,
                                out)


# Elements per round of the decoder's scan: a round's values are decoded while its base and
# output (8 KiB each) are still in L1. A separate pass over the whole tensor re-read both from
# memory: the model's decode 10% slower (2**11..2**13 measure the same).
CHUNK = 1 << 12


@nb.njit(cache=True, nogil=True)
def _decode_start(b, bb, words, x0, x1, x2, x3, four, thresholds, levels, counts, mcum, mfreq, mslot):
    """Phase 1, every class's gaps into bitmaps, and the state the scan starts from:
    (bitmaps, scan state (`ec.scan_state`), st = [x, o1, o2, o3, pos, changes decoded], status)."""
    bits, start, lim, x, o1, o2, o3, pos, status = _decode_gaps(b.size, bb.size, words, x0, x1, x2, x3, four, levels,
                                                                counts,
                                                           mcum, mfreq, mslot)
    lanes, nclass, ge, cursor, guard = ec.scan_state(thresholds, start, lim)
    st = np.array([x, o1, o2, o3, pos, 0], np.int64)
    return bits, lanes, nclass, ge, cursor, guard, st, status


@nb.njit(cache=True, nogil=True)
def _decode_span(b, bb, o0, o1, words, st, four, bits, lanes, nclass, ge, cursor, guard, vcum, vfreq, vslot,
                 vrow_of_key, cols, votes, at, vals, out, copy_to, function, digest):
    """Phases 2 and 3 over elements [o0, o1) (whole blocks), chunk by chunk: positions from a
    scan of the base, then those changes' values, so a chunk's base and output are decoded while
    in L1. Resumable: st = [x, y1, y2, y3, pos, changes decoded] carries on. Building a target (`out`
    not empty), `at` holds one chunk's positions (and ec.POSITION_SLACK spare entries); otherwise
    at and vals collect the patch. Building, with `function` not 0, each finished chunk of the
    target is fed to the running digest `digest` (`hashing.Running`) while in L1. `cols` and
    `votes`: the value model (`_decode_values_any`). Returns the status."""
    x, y1, y2, y3, pos, total = st[0], st[1], st[2], st[3], st[4], st[5]
    building = out.size > 0
    for o in range(o0, o1, CHUNK):
        done = 0 if building else total
        k, status = ec.positions_between(b.size, bb, o, min(o + CHUNK, o1), lanes, nclass, ge, bits, cursor, guard,
                                         at, done, copy_to)
        if status:
            return status
        x, y1, y2, y3, pos, status = _decode_values_any(b, at, done, k, words, x, y1, y2, y3, four, pos, vcum, vfreq,
                                                        vslot, vrow_of_key, cols, votes, vals, out)
        if status:
            return status
        total += k - done
        if building and function:
            hash_update(function, digest, out, o, min(o + CHUNK, b.size))
    st[0], st[1], st[2], st[3], st[4], st[5] = x, y1, y2, y3, pos, total
    return 0


@nb.njit(cache=True, nogil=True)
def _decode_end(st, expected):
    """The stream must end exactly: every change decoded, every state back at L (states 2 and 3
    start there when unused), every word consumed."""
    if st[5] != expected:
        return 2
    L = rans.RANS_L
    if st[0] != L or st[1] != L or st[2] != L or st[3] != L or st[4] != -1:
        return 7
    return 0


@nb.njit(cache=True, nogil=True)
def _decode(b, bb, words, x0, x1, x2, x3, four, thresholds, levels, counts, mcum, mfreq, mslot, vcum, vfreq, vslot,
            vrow_of_key, cols, out, copy_to, function, digest):
    """The three phases in one compiled call: (positions, values, changes decoded, status).

    With an empty `out`, the positions and values of every change are returned (a patch). With
    a non-empty `out` the target is built there instead: the base copied during the scan (into
    `copy_to`, which is `out` itself when the base needs no padding to whole blocks), the values
    written as they are decoded, and positions kept only for the current chunk (no per-change
    arrays to allocate and fill), and fed to the running digest `digest` as it is finished when
    `function` is not 0 (`_decode_span`). `cols`: 0, or the columns of v4's vote model."""
    bits, lanes, nclass, ge, cursor, guard, st, status = _decode_start(b, bb, words, x0, x1, x2, x3, four, thresholds,
                                                                       levels, counts, mcum, mfreq, mslot)
    expected = counts.sum()
    building = out.size > 0
    votes = np.zeros(cols, np.int8)
    # positions: a chunk's at a time when building, else all; the scan's slack after them
    at = np.empty((min(expected, CHUNK) if building else expected) + ec.POSITION_SLACK, np.int64)
    vals = np.empty(0 if building else expected, np.uint16)
    if status:
        return at, vals, 0, status
    if building and not copy_to.size:
        for i in range(b.size):  # a loop, not `out[:] = b` (codec/_warmup.py says why)
            out[i] = b[i]
    status = _decode_span(b, bb, 0, bb.size, words, st, four, bits, lanes, nclass, ge, cursor, guard, vcum, vfreq,
                          vslot, vrow_of_key, cols, votes, at, vals, out, copy_to, function, digest)
    if status == 0:
        status = _decode_end(st, expected)
    return at[:at.size - ec.POSITION_SLACK], vals, st[5], status


@nb.njit(cache=True, nogil=True)
def _decode_in_place(b, bb, words, x0, x1, x2, x3, four, thresholds, levels, counts, mcum, mfreq, mslot, vcum, vfreq,
                     vslot, vrow_of_key, cols, function, digest):
    """The three phases writing the target into the base b itself, in one pass over it: chunk by
    chunk, the positions from the scan of bb (b, or its padded copy), those changes' values,
    then each swapped into b (the old element kept in its place in `vals`: the undo log) and the
    finished chunk fed to the running digest while in L1 (`function` not 0). Separate decode
    and write passes read the tensor twice from memory. Returns (positions, old values, changes
    decoded, status); on a status other than 0, every element written is put back first (b is
    exactly the base again). A chunk's values are decoded before any of them is written, so the
    writes are always changes [0, total) of a prefix of chunks."""
    bits, lanes, nclass, ge, cursor, guard, st, status = _decode_start(b, bb, words, x0, x1, x2, x3, four, thresholds,
                                                                       levels, counts, mcum, mfreq, mslot)
    expected = counts.sum()
    at = np.empty(expected + ec.POSITION_SLACK, np.int64)
    vals = np.empty(expected, np.uint16)
    none = np.zeros(0, np.uint16)
    votes = np.zeros(cols, np.int8)
    total = 0
    if status == 0:
        x, y1, y2, y3, pos = st[0], st[1], st[2], st[3], st[4]
        for o in range(0, bb.size, CHUNK):
            end = min(o + CHUNK, bb.size)
            k, status = ec.positions_between(b.size, bb, o, end, lanes, nclass, ge, bits, cursor, guard, at, total,
                                             none)
            if status:
                break
            x, y1, y2, y3, pos, status = _decode_values_any(b, at, total, k, words, x, y1, y2, y3, four, pos, vcum,
                                                            vfreq, vslot, vrow_of_key, cols, votes, vals, none)
            if status:
                break
            for j in range(total, k):
                p = _U(at[j])
                old = b[p]
                b[p] = vals[j]
                vals[j] = old
            total = k
            if function:
                hash_update(function, digest, b, o, min(end, b.size))
        st[0], st[1], st[2], st[3], st[4], st[5] = x, y1, y2, y3, pos, total
        if status == 0:
            status = _decode_end(st, expected)
    if status:
        for j in range(total):  # back to the base, exactly
            b[_U(at[j])] = vals[j]
    return at[:expected], vals, total, status


_STATUS = {
    1: "entropy stream ends early", 2: "a class's changes lie beyond its elements",
    3: "a change falls under an exponent (or vote context) with no value table",
    4: "a decoded step leaves the 16-bit range",
    6: "a change's rank lies beyond the tensor",
    7: "entropy stream has leftover state (corrupt or forged)",
}


# ---------------------------------------------------------------- encoder side

@dataclass
class Analysis:
    """What the encoder's scans learned: enough to pick a method and to code it. Per change, in
    tensor order: its (base, target) pair, its class and its rank among its class's elements."""

    thresholds: np.ndarray  # exponents where classes 1.. start (strictly increasing)
    class_sizes: np.ndarray  # elements per class, MAX_CLASSES entries
    pairs: np.ndarray  # uint32 base << 16 | target of each change
    classes: np.ndarray  # class of each change
    ranks: np.ndarray  # rank of each change among the elements of its class
    index: np.ndarray | None = None  # changed positions, where the scan had them for free
    cols: int = 1  # the tensor's columns (`vote_columns`), for v4's vote symbols
    still: bool = False  # v4: coded without votes (STILL; `settle`)
    _class_changes: np.ndarray | None = field(default=None, repr=False, compare=False)
    _steps: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    _symbols: np.ndarray | None = field(default=None, repr=False, compare=False)
    _votes: np.ndarray | None = field(default=None, repr=False, compare=False)
    _tally: np.ndarray | None = field(default=None, repr=False, compare=False)  # the votes' (`_settle`)

    @property
    def changes(self) -> int:
        return int(self.pairs.size)

    @property
    def nclass(self) -> int:
        return int(self.thresholds.size) + 1

    def class_changes(self) -> np.ndarray:
        if self._class_changes is None:
            self._class_changes = np.bincount(self.classes, minlength=MAX_CLASSES)[: self.nclass]
        return self._class_changes

    @property
    def keys(self) -> np.ndarray:
        """The base exponent of each change."""
        return self._pair_steps()[0]

    @property
    def zig(self) -> np.ndarray:
        """The zigzagged ULP step of each change."""
        return self._pair_steps()[1]

    def _pair_steps(self) -> tuple[np.ndarray, np.ndarray]:
        if self._steps is None:
            self._steps = ec.pair_steps(self.pairs)
        return self._steps

    @property
    def value_symbols(self) -> np.ndarray:
        """Each change's value symbol, key << 6 | token (`_value_symbols`), computed once: the
        value tables count them, the coder codes them."""
        if self._symbols is None:
            self._symbols = _value_symbols(self.pairs)
        return self._symbols

    def settle(self) -> None:
        """Whether this tensor codes its values without votes (`_settle`), its vote symbols
        rewritten to match."""
        votes = self.vote_symbols()
        if self._tally is None:
            raise ValueError("this analysis's vote symbols came without their tally")
        self.still = bool(_settle(self._tally.reshape(1, 3), self.pairs, votes,
                                  np.array([0, self.changes], np.int64))[0])

    def coded_symbols(self, vote: bool) -> np.ndarray:
        """The symbols its record codes with a vote model (`vote`) or with key tables."""
        if not vote:
            return self.value_symbols
        if self.still:  # made afresh, whatever vote_symbols holds: they must match the params' bit
            out = np.empty(self.changes, np.uint32)
            _counter0_symbols(self.pairs, out, 0, self.changes)
            return out
        return self.vote_symbols()

    def vote_symbols(self) -> np.ndarray:
        """Each change's v4 vote symbol (`exponent_classes.vote_symbols_into`), from its position
        (`index`)."""
        if self._votes is None:
            if self.index is None or self.index.size != self.pairs.size:
                raise ValueError("vote symbols need the changes' positions (Analysis.index)")
            self._votes = np.empty(self.pairs.size, np.uint32)
            self._tally = ec.vote_symbols_into(self.pairs, self.index.astype(np.int64, copy=False), self.cols,
                                               self._votes)
        return self._votes


def choose_thresholds(n_e: np.ndarray, k_e: np.ndarray, stride: int) -> np.ndarray:
    """Class thresholds from (elements, changes) per exponent among every stride-th element;
    none if no sampled element changed."""
    if not k_e.any():
        return np.empty(0, np.int64)
    return ec.choose_classes(n_e * stride, k_e * stride, MAX_CLASSES)


def analyze(base: np.ndarray, target: np.ndarray, cols: int = 1) -> Analysis:
    """The changes of two BF16 tensors (as uint16), with classes chosen for them, and their
    positions (for vote symbols over `cols` columns)."""
    thresholds, pairs, classes, ranks, sizes, changes = ec.analyze(base.reshape(-1), target.reshape(-1))
    return Analysis(thresholds, sizes, pairs, classes, ranks, index=ec.differences(base, target), cols=cols,
                    _class_changes=changes[: thresholds.size + 1])


@dataclass
class Batch:
    """The analyses of many tensors, made in one compiled call (`exponent_classes.analyze_at`):
    their changes back to back (tensor i's are [first[i], first[i + 1]) of pairs, classes and
    ranks), a row per tensor for the rest. `encode_batch` codes them where they lie."""

    pairs: np.ndarray
    classes: np.ndarray
    ranks: np.ndarray
    first: np.ndarray
    thresholds: np.ndarray  # row i: tensor i's thresholds in its first nthr[i] entries
    nthr: np.ndarray
    class_sizes: np.ndarray  # (tensors, MAX_CLASSES)
    class_changes: np.ndarray  # (tensors, MAX_CLASSES)
    digests: np.ndarray | None  # row i: (low, high) halves of the base's digest, then the target's
    buffers: ec.ScanBuffers | None = field(default=None, repr=False, compare=False)  # where the changes lie
    _symbols: np.ndarray | None = field(default=None, repr=False, compare=False)
    cols: np.ndarray | None = field(default=None, repr=False, compare=False)  # each tensor's, for votes
    _votes: np.ndarray | None = field(default=None, repr=False, compare=False)  # made by the scan, with cols
    tally: np.ndarray | None = field(default=None, repr=False, compare=False)  # the scan's, with cols (`_settle`)
    still: np.ndarray | None = field(default=None, repr=False, compare=False)  # v4: per tensor (`settle`)

    def __len__(self) -> int:
        return int(self.nthr.size)

    def changes(self) -> np.ndarray:
        """Changes per tensor."""
        return np.diff(self.first)

    @property
    def value_symbols(self) -> np.ndarray:
        """Every change's value symbol (`Analysis.value_symbols`), from one compiled call."""
        if self._symbols is None:
            if self.buffers is None:
                self._symbols = _value_symbols(self.pairs)
            else:  # into the buffers' room, grown if need be
                if self.buffers.symbols.size < self.pairs.size:
                    self.buffers.symbols = np.empty(self.buffers.pairs.size, np.uint16)
                self._symbols = self.buffers.symbols[: self.pairs.size]
                _value_symbols_into(self.pairs, self._symbols)
        return self._symbols

    def settle(self) -> None:
        """Which tensors code their values without votes (`_settle`), their vote symbols rewritten."""
        votes = self.vote_symbols()
        self.still = _settle(self.tally, self.pairs, votes, self.first)

    def vote_symbols(self) -> np.ndarray:
        """Every change's v4 vote symbol, which the scan made (`analyze_at` with `cols`). Those of a
        tensor whose scan stopped voting (tally[i, 2]) are made only once `settle` has run."""
        if self._votes is None:
            raise ValueError("this batch was scanned without columns: it has no vote symbols")
        return self._votes

    def digest_pairs(self) -> list[tuple[bytes, bytes]] | None:
        """(base, target) digest of each tensor, where the scan made them (`analyze_at` with headers)."""
        if self.digests is None:
            return None
        blob = digest_bytes(self.digests)
        return [(blob[32 * i: 32 * i + 16], blob[32 * i + 16: 32 * i + 32]) for i in range(len(self))]

    def analysis(self, i: int) -> Analysis:
        """Tensor i's analysis (views into the batch's arrays)."""
        a, b, nthr = int(self.first[i]), int(self.first[i + 1]), int(self.nthr[i])
        return Analysis(self.thresholds[i, :nthr], self.class_sizes[i], self.pairs[a:b], self.classes[a:b],
                        self.ranks[a:b], cols=1 if self.cols is None else int(self.cols[i]),
                        still=self.still is not None and bool(self.still[i]),
                        _class_changes=self.class_changes[i, : nthr + 1],
                        _symbols=None if self._symbols is None else self._symbols[a:b],
                        _votes=None if self._votes is None else self._votes[a:b],
                        _tally=None if self.tally is None else self.tally[i])


def analyze_at(where: np.ndarray, sizes: np.ndarray, headers: list[bytes] | None = None,
               buffers: ec.ScanBuffers | None = None, cols: np.ndarray | None = None,
               hash_base: np.ndarray | None = None) -> Batch:
    """`analyze` of many BF16 tensors given by address (`exponent_classes.analyze_at`); with
    `headers`, the scan also digests every target and every base whose `hash_base` flag is set
    (default: all; Batch.digests). With `buffers`, the batch's changes and value symbols lie in
    them: valid until they are lent to another scan. With `cols` (each tensor's `vote_columns`),
    the scan also makes the changes' v4 vote symbols (`Batch.vote_symbols`)."""
    pairs, classes, ranks, votes, first, thresholds, nthr, class_sizes, class_changes, digests, tally = ec.analyze_at(
        where, sizes, headers=headers, buffers=buffers, hash_base=hash_base, cols=cols)
    return Batch(pairs, classes, ranks, first, thresholds, nthr, class_sizes, class_changes, digests, buffers=buffers,
                 cols=cols, _votes=votes, tally=tally)


@nb.njit(cache=True, nogil=True)
def _pack_tables(keys, freq):
    """`ValueModel.pack`: the keys' count, then per key its delta, its non-zero tokens' count and
    each one's (token delta, frequency), as varints."""
    out = np.empty(10 * (2 + keys.size * (2 + 2 * freq.shape[1])), np.uint8)
    n = put_uvarint(out, 0, keys.size)
    prev = -1
    for i in range(keys.size):
        n = put_uvarint(out, n, keys[i] - prev - 1)
        prev = keys[i]
        nz = 0
        for t in range(freq.shape[1]):
            nz += freq[i, t] != 0
        n = put_uvarint(out, n, nz)
        last = -1
        for t in range(freq.shape[1]):
            if freq[i, t]:
                n = put_uvarint(out, n, t - last - 1)
                n = put_uvarint(out, n, freq[i, t])
                last = t
    return out[:n]


@nb.njit(cache=True, nogil=True)
def _unpack_tables(vals, n_keys):
    """`ValueModel.unpack_checked`'s parse of the block's varints (keys below n_keys), accepting
    exactly what it accepts: (0, keys, freq), or (1, ...) for anything it would refuse."""
    keys = np.zeros(0, np.int64)
    freq = np.zeros((0, VALUE_TOKENS), np.int64)
    if vals.size == 0 or vals[0] > n_keys:
        return 1, keys, freq
    n = vals[0]
    at = 1
    keys = np.zeros(n, np.int64)
    freq = np.zeros((n, VALUE_TOKENS), np.int64)
    key = -1
    for i in range(n):
        if at + 2 > vals.size or vals[at] > n_keys or vals[at + 1] > VALUE_TOKENS:
            return 1, keys, freq
        key += vals[at] + 1
        count = vals[at + 1]
        at += 2
        if key >= n_keys:
            return 1, keys, freq
        keys[i] = key
        tok = -1
        total = 0
        top = 0
        for _ in range(count):
            if at + 2 > vals.size or vals[at] > VALUE_TOKENS or vals[at + 1] > (1 << VALUE_SCALE):
                return 1, keys, freq
            tok += vals[at] + 1
            if tok >= VALUE_TOKENS:
                return 1, keys, freq
            freq[i, tok] = vals[at + 1]
            total += vals[at + 1]
            top = max(top, vals[at + 1])
            at += 2
        if total != 1 << VALUE_SCALE or top >= 1 << VALUE_SCALE:
            return 1, keys, freq
    if at != vals.size:
        return 1, keys, freq
    return 0, keys, freq


def _table_bits(counts: np.ndarray, freq: np.ndarray, keys: np.ndarray) -> float:
    """Bits of the token symbols counted in `counts` (a row per table) under the tables `freq`
    (of contexts `keys`), plus the tables' own block (`ValueModel.cost`)."""
    used = counts > 0
    code = float((counts[used] * (VALUE_SCALE - np.log2(freq[used]))).sum())
    return code + 8.0 * _pack_tables(keys.astype(np.int64), np.asarray(freq, np.int32)).size


def _fitted(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(contexts used, their normalised tables, what they cost: `_table_bits`) of a histogram
    with a row per context."""
    keys = np.flatnonzero(hist.sum(axis=1))
    freq = rans.normalize_rows(hist[keys], VALUE_SCALE) if keys.size else np.zeros((0, VALUE_TOKENS), np.int64)
    return keys, freq, _table_bits(hist[keys], freq, keys)


class ValueModel:
    """One value-token table per key (v2, v3), or per vote context (v4, `vote`: key *
    VOTE_LEVELS + |column counter|), shared by every conditional tensor of a payload."""

    def __init__(self, freq: np.ndarray, keys: np.ndarray, vote: bool = False) -> None:
        self.vote = vote
        n_keys = N_CONTEXTS if vote else N_KEYS
        self.freq = np.asarray(freq, np.int32)  # (rows, VALUE_TOKENS); int32 keeps tables in cache
        self.cum = rans.cumulative(freq)
        # The decoder's slot lookup: per row, the token owning the first slot of each bucket of
        # 2**BUCKET_SHIFT slots; the kernels step from it to the slot's own token over the
        # cumulative counts (rarely more than one step: a row has a few dozen tokens at most).
        # 256 bytes a row instead of 4096 keep v4's hundred-odd vote rows in L2.
        slots = (rans.slot_table(self.freq, VALUE_SCALE) if freq.shape[0]
                 else np.zeros((0, 1 << VALUE_SCALE), np.uint8))
        self.slots = np.ascontiguousarray(slots[:, ::1 << BUCKET_SHIFT])
        self._reciprocals: tuple[np.ndarray, np.ndarray] | None = None  # the encoder's; built on demand
        self.row_of_key = np.full(n_keys, -1, np.int64)  # of a context, for vote models
        self.row_of_key[keys] = np.arange(keys.size)
        self.keys = keys
        # a still record's (`STILL`): each key's row at counter 0, for the key-table kernels
        self.row_plain = self.row_of_key[np.arange(N_KEYS) * VOTE_LEVELS] if vote else self.row_of_key

    def rows(self, shape: tuple[int, ...], still: bool) -> tuple[np.ndarray, int]:
        """(row of each context, `cols`) the decoding kernels take for a record of this shape:
        a still record's values are key-table values over its counter-0 rows."""
        return (self.row_plain, 0) if still else (self.row_of_key, self.columns(shape))

    def columns(self, shape: tuple[int, ...]) -> int:
        """The `cols` argument of the decoding kernels for a record of this shape: 0 (no votes)
        unless this is a vote model."""
        return vote_columns(shape) if self.vote else 0

    @property
    def rcp(self) -> np.ndarray:
        return self.reciprocals()[0]

    @property
    def rsh(self) -> np.ndarray:
        return self.reciprocals()[1]

    def reciprocals(self) -> tuple[np.ndarray, np.ndarray]:
        if self._reciprocals is None:
            self._reciprocals = rans.reciprocals(self.freq)
        return self._reciprocals

    @classmethod
    def fit(cls, analyses: list[Analysis]) -> "ValueModel":
        return cls.fit_symbols([a.value_symbols for a in analyses])

    @classmethod
    def fit_symbols(cls, symbols: list[np.ndarray], vote: bool = False) -> "ValueModel":
        """The tables of changes whose value symbols (`_value_symbols`; with `vote`, vote
        symbols, `_vote_symbols_into`) these arrays hold."""
        hist = np.zeros((N_CONTEXTS if vote else N_KEYS, VALUE_TOKENS), np.int64)
        flat = hist.reshape(-1)
        for sym in symbols:
            _count_symbols(sym, flat)
        return cls.fit_histogram(hist, vote)

    @classmethod
    def fit_votes(cls, symbols: list[np.ndarray]) -> "ValueModel":
        """v4's value model for changes whose vote symbols these arrays hold (still records'
        rewritten, `_settle`): the vote tables, or the key tables where those cost the payload
        less (a small payload, whose five times the tables do not pay). Both are costed from one
        counting pass (`_count_votes`) and only the one chosen is built."""
        votes = np.zeros((N_CONTEXTS, VALUE_TOKENS), np.int64)
        keys = np.zeros((N_KEYS, VALUE_TOKENS), np.int64)
        for sym in symbols:
            _count_votes(sym, votes.reshape(-1), keys.reshape(-1))
        by_vote, by_key = _fitted(votes), _fitted(keys)
        if by_vote[2] < by_key[2]:
            return cls.fit_histogram(votes, True, by_vote)
        return cls.fit_histogram(keys, False, by_key)

    @classmethod
    def fit_histogram(cls, hist: np.ndarray, vote: bool = False,
                      fitted: tuple[np.ndarray, np.ndarray, float] | None = None) -> "ValueModel":
        """The tables of changes whose (context, token) counts `hist` holds (`_fitted`, unless given)."""
        keys, freq, bits = _fitted(hist) if fitted is None else fitted
        model = cls(freq, keys, vote)
        model.fitted_bits = bits
        return model

    fitted_bits = 0.0  # what `fit_symbols` expects its symbols and tables to cost

    def cost(self, counts: np.ndarray) -> float:
        """Bits of the token symbols counted in `counts` (a row per table) under these tables,
        plus the tables' own block: what the model costs the payload (raw bits aside, which any
        model pays alike)."""
        return _table_bits(counts, self.freq, self.keys)

    def pack(self) -> bytes:
        """The shared value-tables block (docs/FORMAT.md), built in one compiled pass."""
        return _pack_tables(self.keys.astype(np.int64), self.freq).tobytes()

    @classmethod
    def unpack(cls, data: bytes, vote: bool = False) -> "ValueModel":
        """The shared value-tables block (with `vote`, the vote tables: the same layout, keyed by
        context), parsed in one compiled pass; a block that pass declines goes through
        `unpack_checked`, which names the fault."""
        vals, n = _decode_uvarints(np.frombuffer(data, np.uint8))
        if n >= 0:
            status, keys, freq = _unpack_tables(vals[:n], N_CONTEXTS if vote else N_KEYS)
            if status == 0:
                return cls(freq, keys, vote)
        return cls.unpack_checked(data, vote)

    @classmethod
    def unpack_checked(cls, data: bytes, vote: bool = False) -> "ValueModel":
        """`unpack`, field by field, every fault a DeltaError saying what is wrong."""
        n_keys = N_CONTEXTS if vote else N_KEYS
        vals = read_uvarints(data, "vote tables" if vote else "value tables")
        at = 0

        def take(limit: int) -> int:
            nonlocal at
            if at >= len(vals):
                raise DeltaError("truncated value tables")
            v = vals[at]
            at += 1
            if v > limit:
                raise DeltaError(f"value {v} in value tables exceeds its limit {limit}")
            return v

        n = take(n_keys)
        keys = np.zeros(n, np.int64)
        freq = np.zeros((n, VALUE_TOKENS), np.int64)
        key = -1
        for i in range(n):
            key += take(n_keys) + 1
            if key >= n_keys:
                raise DeltaError("value tables: key out of range")
            keys[i] = key
            tok = -1
            for _ in range(take(VALUE_TOKENS)):
                tok += take(VALUE_TOKENS) + 1
                if tok >= VALUE_TOKENS:
                    raise DeltaError("value tables: token out of range")
                freq[i, tok] = take(1 << VALUE_SCALE)
            total = int(freq[i].sum())
            if total != 1 << VALUE_SCALE or freq[i].max() >= 1 << VALUE_SCALE:
                raise DeltaError(f"value tables: key {key} frequencies sum to {total}, expected {1 << VALUE_SCALE}")
        if at != len(vals):
            raise DeltaError(f"{len(vals) - at} trailing values after the value tables")
        return cls(freq, keys, vote)


def _tokens(zig: np.ndarray) -> np.ndarray:
    """Tokens of hybrid uints, vectorised (the kernels compute the same inline)."""
    v = zig.astype(np.int64)
    out = v.copy()
    big = v >= rans.DIRECT
    if big.any():
        vb = v[big]
        n = np.floor(np.log2(vb.astype(np.float64))).astype(np.int64)
        n -= (np.left_shift(1, n) > vb)  # guard float rounding at powers of two
        n += (np.left_shift(1, n + 1) <= vb)
        sub = (vb >> (n - rans.SUB_BITS)) & ((1 << rans.SUB_BITS) - 1)
        out[big] = rans.DIRECT + (n - 3) * (1 << rans.SUB_BITS) + sub
    return out


_LEVEL_LOGS: np.ndarray | None = None


@nb.njit(inline="always", cache=True)
def _level_cost(n, k, logs, j):
    return -(k * logs[0, j] + (n - k) * logs[1, j])


@nb.njit(cache=True, nogil=True)
def _argmin_levels(n, k, logs):
    """Per class, the first level of least cost (`_level_cost`: the ideal Bernoulli cost of k
    changes among n elements). The cost is convex in the level (log p falls linearly with it,
    -log(1 - p) is convex), so a walk from the level nearest k / n finds it in a few steps
    instead of trying all 256: left while not worse, then right while better (tested against
    the exhaustive search)."""
    out = np.empty(n.size, np.int64)
    top = logs.shape[1] - 1
    for c in range(n.size):
        j = top
        if k[c] > 0:  # p_j = 2**(-(j + 1) / 6)
            j = min(max(np.int64(np.round(-LEVELS_PER_OCTAVE * np.log2(k[c] / max(n[c], 1.0)))) - 1, 0), top)
        cost = _level_cost(n[c], k[c], logs, j)
        while j > 0:
            left = _level_cost(n[c], k[c], logs, j - 1)
            if left > cost:
                break
            j -= 1
            cost = left
        while j < top:
            right = _level_cost(n[c], k[c], logs, j + 1)
            if not right < cost:
                break
            j += 1
            cost = right
        out[c] = j
    return out


@nb.njit(cache=True, nogil=True)
def _argmin_levels_exhaustive(n, k, logs):
    """`_argmin_levels` by trying every level (its reference in the tests)."""
    out = np.empty(n.size, np.int64)
    for c in range(n.size):
        best = np.inf
        for j in range(logs.shape[1]):
            cost = _level_cost(n[c], k[c], logs, j)
            if cost < best:
                best = cost
                out[c] = j
    return out


def _level_logs() -> np.ndarray:
    """log2 p and log2 (1 - p) of every mask level (for choosing levels)."""
    global _LEVEL_LOGS
    if _LEVEL_LOGS is None:
        p = level_probability()
        _LEVEL_LOGS = np.stack([np.log2(p), np.log2(1.0 - p)])
    return _LEVEL_LOGS


def _choose_levels(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Mask level minimising the ideal Bernoulli cost of k changes among n elements, per class."""
    return _argmin_levels(np.asarray(n, np.float64), np.asarray(k, np.float64), _level_logs())


@nb.njit(cache=True, nogil=True)
def _encode_many(pairs, symbols, cls, ranks, first, thr, nthr, sizes, changes, which, still, logs, mcum, mfreq, mrcp,
                 mrsh, vcum, vfreq, vrcp, vrsh, vrow_of_key, four_from):
    """Params and stream of the tensors `which` of a batch (tensor i's changes are
    [first[i], first[i+1]) of pairs, symbols, cls and ranks; its classes, sizes and changes are
    row i of the rest), into two buffers: (params bytes, params offsets, stream words, stream
    offsets), a record per entry of `which`. The stream is the emitted words then each final
    state as (low, high) 32-bit words (docs/FORMAT.md): four states for a tensor with at least
    four_from changes, else two. still[i]: tensor i's record is still (the STILL bit; its symbols
    say so already)."""
    m = which.size
    total = 0
    for w in range(m):
        total += first[which[w] + 1] - first[which[w]]
    params = np.empty(m * (2 * MAX_CLASSES + 10 * MAX_CLASSES), np.uint8)
    poff = np.zeros(m + 1, np.int64)
    streams = np.empty(8 * total + 20 * m, np.uint32)
    soff = np.zeros(m + 1, np.int64)
    p = 0
    q = 0
    for w in range(m):
        i = which[w]
        a = first[i]
        b = first[i + 1]
        nclass = nthr[i] + 1
        seen = np.zeros(MAX_CLASSES, np.int64)  # the coder lays out each class's gaps from these counts: checked
        for j in range(a, b):
            c = cls[j]
            if c >= nclass:
                raise ValueError("internal: a change's class is past the tensor's classes")
            seen[c] += 1
        for c in range(nclass):
            if seen[c] != changes[i, c]:
                raise ValueError("internal: the analysis's per-class change counts disagree with its changes' classes")
        levels = _argmin_levels(sizes[i, :nclass].astype(np.float64), changes[i, :nclass].astype(np.float64), logs)
        four = b - a >= four_from
        words, nw, x0, x1, x2, x3 = _encode(pairs[a:b], symbols[a:b], cls[a:b], ranks[a:b], changes[i, :nclass], levels,
                                            mcum, mfreq, mrcp, mrsh, vcum, vfreq, vrcp, vrsh, vrow_of_key, four)
        params[p] = nclass | (STILL if still[i] else 0)
        p += 1
        for c in range(nclass - 1):
            params[p] = thr[i, c]
            p += 1
        for c in range(nclass):
            params[p] = levels[c]
            p += 1
        for c in range(nclass):
            p = put_uvarint(params, p, changes[i, c])
        poff[w + 1] = p
        for j in range(nw):
            streams[q + j] = words[j]
        q += nw
        final = (x0, x1, x2, x3)
        for j in range(FOUR_STATES if four else STATES):
            streams[q] = final[j] & rans.WORD_MASK
            streams[q + 1] = final[j] >> 32
            q += 2
        soff[w + 1] = q
    return params, poff, streams, soff


def _records(pairs: np.ndarray, symbols: np.ndarray, cls: np.ndarray, ranks: np.ndarray, first: np.ndarray,
             thr: np.ndarray, nthr: np.ndarray, sizes: np.ndarray, changes: np.ndarray, which: np.ndarray,
             model: ValueModel, four_from: int, still: np.ndarray | None = None) -> list[tuple[bytes, list[Stream]]]:
    """(params, streams) of the tensors `which` of a batch laid out as `_encode_many` reads it
    (`still`: per tensor, for a vote model)."""
    if still is None or not model.vote:
        still = np.zeros(nthr.size, np.uint8)
    wrong = which[changes[which].sum(axis=1) != first[which + 1] - first[which]]
    if wrong.size:  # the coder trusts these counts to lay out its gaps
        i = int(wrong[0])
        raise ValueError(f"analysis counts {changes[i].sum()} changes by class, holds {first[i + 1] - first[i]}")
    mfreq, mcum, _ = mask_tables()
    mrcp, mrsh = mask_reciprocals()
    params, poff, streams, soff = _encode_many(pairs, symbols, cls, ranks, first, thr, nthr, sizes, changes, which,
                                               still.astype(np.uint8, copy=False), _level_logs(), mcum, mfreq, mrcp,
                                               mrsh, model.cum, model.freq, model.rcp, model.rsh, model.row_of_key,
                                               four_from)
    # every record's bytes cut from two blobs (one conversion each, not one per record)
    m = which.size
    words = streams[: soff[m]].astype("<u4", copy=False).tobytes()
    heads = params[: poff[m]].tobytes()
    soff, poff = (4 * soff).tolist(), poff.tolist()
    out = []
    for i in range(m):
        data = words[soff[i]: soff[i + 1]]
        out.append((heads[poff[i]: poff[i + 1]], [Stream(RAW, len(data), data)]))
    return out


def encode_batch(batch: Batch, which: np.ndarray, model: ValueModel, four_from: int = NEVER
                 ) -> list[tuple[bytes, list[Stream]]]:
    """(params, streams) of the batch's tensors `which`, coded where the batch holds them, in
    one compiled call. Tensors with at least `four_from` changes use four interleaved states
    (the payload's SHARED_INTERLEAVE rule, which the caller writes). A vote model codes the
    batch's vote symbols."""
    symbols = batch.vote_symbols() if model.vote else batch.value_symbols  # (still ones rewritten: `settle`)
    return _records(batch.pairs, symbols, batch.classes, batch.ranks, batch.first, batch.thresholds,
                    batch.nthr, batch.class_sizes, batch.class_changes, np.asarray(which, np.int64), model, four_from,
                    batch.still)


def encode_many(analyses: list[Analysis], model: ValueModel, four_from: int = NEVER
                ) -> list[tuple[bytes, list[Stream]]]:
    """(params, streams) of each analysed tensor, coded in one compiled call (as `encode_batch`)."""
    m = len(analyses)
    if m == 1:
        a = analyses[0]
        pairs, symbols, cls, ranks = a.pairs, a.coded_symbols(model.vote), a.classes, a.ranks
    else:
        pairs = np.concatenate([a.pairs for a in analyses])
        symbols = np.concatenate([a.coded_symbols(model.vote) for a in analyses])
        cls = np.concatenate([a.classes for a in analyses])
        ranks = np.concatenate([a.ranks for a in analyses])
    first = np.zeros(m + 1, np.int64)
    np.cumsum([a.changes for a in analyses], out=first[1:])
    nthr = np.array([a.thresholds.size for a in analyses], np.int64)
    thr = np.zeros((m, MAX_CLASSES - 1), np.int64)
    changes = np.zeros((m, MAX_CLASSES), np.int64)
    for i, a in enumerate(analyses):  # ragged rows
        thr[i, : nthr[i]] = a.thresholds
        changes[i, : a.nclass] = a.class_changes()
    sizes = np.stack([a.class_sizes for a in analyses]).astype(np.int64, copy=False)
    still = np.array([a.still for a in analyses], np.uint8)
    return _records(pairs, symbols, cls, ranks, first, thr, nthr, sizes, changes, np.arange(m), model, four_from, still)


def encode(a: Analysis, model: ValueModel, four_from: int = NEVER) -> tuple[bytes, list[Stream]]:
    return encode_many([a], model, four_from)[0]


def interleave_rule(four_from: int) -> bytes:
    """The SHARED_INTERLEAVE block: records with at least `four_from` changes use four states."""
    return uvarints(np.array([four_from], np.int64))


def _four_from(shared: dict) -> int:
    """The payload's interleave rule (NEVER without one: v2)."""
    data = shared.get(SHARED_INTERLEAVE)
    if data is None:
        return NEVER
    vals = read_uvarints(data, "interleave rule")
    if len(vals) != 1:
        raise DeltaError(f"interleave rule holds {len(vals)} values, expected 1")
    return min(vals[0], NEVER)


# ---------------------------------------------------------------- decoder side

@nb.njit(cache=True, nogil=True)
def _parse_params(p, changes, thr, levels, counts, flags):
    """A conditional record's params (docs/FORMAT.md: class count, thresholds, a mask level per
    class, the changes per class as varints) into thr, levels and counts (room for MAX_CLASSES).
    With `flags` (a payload with vote tables), the first byte's STILL bit is the record's.
    Returns (status, classes, counts read, still): status 0, or the `_params_error` case."""
    nclass = np.int64(p[0]) if p.size else 0
    still = flags and nclass & STILL != 0
    if still:
        nclass ^= STILL
    if not 1 <= nclass <= MAX_CLASSES or p.size < 2 * nclass:
        return 1, nclass, 0, still
    for c in range(nclass - 1):
        thr[c] = p[1 + c]
        if thr[c] <= (thr[c - 1] if c else 0):
            return 2, nclass, 0, still
    for c in range(nclass):
        levels[c] = p[nclass - 1 + 1 + c]
    n = 0
    v = np.int64(0)
    shift = 0
    total = 0
    for i in range(2 * nclass, p.size):
        byte = np.int64(p[i])
        v |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 56:
                return 3, nclass, n, still
        else:
            if n < MAX_CLASSES:
                counts[n] = v
            n += 1
            if v > changes:  # (also keeps the total from overflowing)
                return 5, nclass, n, still
            total += v
            v = 0
            shift = 0
    if shift:
        return 3, nclass, n, still
    if n != nclass:
        return 4, nclass, n, still
    if total != changes:
        return 5, nclass, n, still
    return 0, nclass, n, still


def _params(entry: Entry, shared: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(class thresholds, mask level of each class, changes per class, still?), checked against
    the index; the STILL bit only where the payload has vote tables."""
    p = np.frombuffer(entry.params, np.uint8)
    thr = np.zeros(MAX_CLASSES, np.int64)
    levels = np.zeros(MAX_CLASSES, np.int64)
    counts = np.zeros(MAX_CLASSES, np.int64)
    status, nclass, n, still = _parse_params(p, entry.changes, thr, levels, counts, SHARED_VOTE_TABLES in shared)
    if status:
        raise DeltaError(_params_error(entry, status, nclass, n), tensor=entry.name)
    return thr[:nclass - 1], levels[:nclass], counts[:nclass], bool(still)


def _params_error(entry: Entry, status: int, nclass: int, n: int) -> str:
    if status == 1 and nclass & STILL and 1 <= nclass ^ STILL <= MAX_CLASSES:
        return "conditional params set the still bit (0x80), which only a payload with vote tables allows"
    if status == 1:
        return f"conditional params declare {nclass} classes in {len(entry.params)} bytes"
    if status == 2:
        return "class thresholds are not strictly increasing from 1"
    if status == 3:
        return f"malformed varint in params of {entry.name!r}"
    if status == 4:
        return f"params hold {n} class counts for {nclass} classes"
    try:
        total = sum(read_uvarints(bytes(entry.params)[2 * nclass:], "params"))  # exact, however large
    except DeltaError:  # a count too large, then a malformed varint
        return f"class counts exceed the {entry.changes} changes the index says"
    return f"class counts add up to {total} changes, index says {entry.changes}"


def _parse_model(shared: dict) -> ValueModel:
    data = shared.get(SHARED_VALUE_TABLES)
    if data is None:
        raise DeltaError("payload has conditional tensors but no value tables")
    return ValueModel.unpack(data)


def _parse_vote_model(shared: dict) -> ValueModel:
    return ValueModel.unpack(shared[SHARED_VOTE_TABLES], vote=True)


def _model(shared: dict) -> ValueModel:
    """The payload's value model, parsed once per payload (its records all share it): the vote
    tables where the payload has them (v4; other versions refuse the block when opened), else
    the value tables."""
    if SHARED_VOTE_TABLES in shared:
        return parsed_block(shared, SHARED_VOTE_TABLES, _parse_vote_model)
    return parsed_block(shared, SHARED_VALUE_TABLES, _parse_model)


def _rule(shared: dict) -> int:
    """`_four_from`, parsed once per payload."""
    return parsed_block(shared, SHARED_INTERLEAVE, _four_from)


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    at, val, _ = _decode_entry(entry, base, shared, None)
    return Patch(at, val)


def decode_target(entry: Entry, base: np.ndarray, shared: dict, digest: Running | None = None
                  ) -> tuple[int, np.ndarray]:
    """(changes decoded, the whole target tensor, flat), built in the decoding pass: no copy of
    the base beforehand, no scatter, no per-change arrays. `digest`, if given, is fed the target
    in order, each few KiB as soon as it is finished (while in cache)."""
    out = memory.new_elements(base.size, base.dtype)
    _, _, count = _decode_entry(entry, base, shared, out, digest)
    return count, out


def decode_in_place(entry: Entry, elems: np.ndarray, shared: dict, digest: Running | None = None) -> Patch:
    """The record applied to `elems` (the base's writable elements) in the decoding pass itself
    (`_decode_in_place`), feeding `digest` the target as it is finished. Returns the changed
    positions with the elements they held (the undo log). On DeltaError `elems` hold the base."""
    if not elems.flags.writeable or not elems.flags.c_contiguous:
        raise ValueError(f"{entry.name!r}: decode_in_place needs writable contiguous elements")
    base, thresholds, levels, counts, words, states, four, model, vrow, cols = _checked(entry, elems, shared)
    x0, x1, x2, x3 = (np.int64(x) for x in states)
    function, state = (digest.function, digest.state) if digest is not None else (0, 0)
    mfreq, mcum, mslot = mask_tables()
    at, old, _, status = _decode_in_place(base, ec.blocks(base), words, x0, x1, x2, x3, four, thresholds, levels,
                                          counts, mcum, mfreq, mslot, model.cum, model.freq, model.slots, vrow,
                                          cols, np.uintp(function), np.uintp(state))
    if status:
        raise DeltaError(_STATUS[status], tensor=entry.name)
    return Patch(at, old)


_NO_OUT = np.empty(0, np.uint16)


def _stream(entry: Entry, four: bool) -> tuple[np.ndarray, np.ndarray]:
    """(words, states 0..3) of the entry's one raw rANS stream, checked: four states if `four`,
    else two (states 2 and 3 then stay at 2**31, unused)."""
    if len(entry.streams) != 1:
        raise DeltaError(f"method expects 1 stream, index has {len(entry.streams)}", tensor=entry.name)
    s = entry.streams[0]
    if s.codec != RAW or s.raw_len != len(s.stored):
        raise DeltaError("entropy stream must be stored raw", tensor=entry.name)
    if len(s.stored) % 4:
        raise DeltaError("entropy stream is malformed", tensor=entry.name)
    words, states, bad = _stream_states(np.frombuffer(s.stored, "<u4"), FOUR_STATES if four else STATES)
    if bad:
        raise DeltaError("entropy stream is malformed", tensor=entry.name)
    return words, states


def _checked(entry: Entry, base: np.ndarray, shared: dict) -> tuple:
    """(flat base, thresholds, levels, changes per class, words, states 0..3, four states?, value
    model, value rows and columns (`ValueModel.rows`)) of a record, every field checked."""
    if base.dtype != np.uint16:
        raise DeltaError("`conditional` applies to 2-byte elements only", tensor=entry.name)
    thresholds, levels, counts, still = _params(entry, shared)
    try:
        four = entry.changes >= _rule(shared)
    except DeltaError as exc:
        raise DeltaError(exc.reason, tensor=entry.name) from None
    words, states = _stream(entry, four)
    try:
        model = _model(shared)
    except DeltaError as exc:
        raise DeltaError(exc.reason, tensor=entry.name) from None
    vrow, cols = model.rows(tuple(entry.shape), still)
    return base.reshape(-1), thresholds, levels, counts, words, states, four, model, vrow, cols


def _decode_entry(entry: Entry, base: np.ndarray, shared: dict, out: np.ndarray | None,
                  digest: Running | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions, values, changes decoded) of a record; with `out`, the target is built there
    instead (see `_decode`), feeding `digest` if given."""
    base, thresholds, levels, counts, words, states, four, model, vrow, cols = _checked(entry, base, shared)
    x0, x1, x2, x3 = (np.int64(x) for x in states)
    bb = ec.blocks(base)
    copy_to = _NO_OUT
    if out is None:
        out = _NO_OUT
    elif base.size % ec.BLOCK == 0:
        copy_to = out  # the base is its own blocks: the scan copies it block by block
    function, state = (digest.function, digest.state) if digest is not None and out.size else (0, 0)
    mfreq, mcum, mslot = mask_tables()
    at, val, count, status = _decode(base, bb, words, x0, x1, x2, x3, four, thresholds, levels, counts, mcum, mfreq,
                                     mslot, model.cum, model.freq, model.slots, vrow, cols, out, copy_to,
                                     np.uintp(function), np.uintp(state))
    if status:
        raise DeltaError(_STATUS[status], tensor=entry.name)
    return at, val, int(count)


@nb.njit(cache=True, nogil=True)
def _stream_states(words, nstates):
    """(words before the states, states 0..3, status) of a stream whose last 2 * nstates words
    hold the final states (low, high; states past nstates are 2**31): status 0, or 1 when they
    are missing or out of range."""
    states = np.full(FOUR_STATES, rans.RANS_L, np.int64)
    if words.size < 2 * nstates:
        return words, states, 1
    n = words.size - 2 * nstates
    for j in range(nstates):
        hi = words[n + 2 * j + 1]
        states[j] = np.int64(words[n + 2 * j]) | (np.int64(hi) << 32)
        if hi >= 0x80000000 or states[j] < rans.RANS_L:
            return words[:n], states, 1
    return words[:n], states, 0


@nb.njit(cache=True, nogil=True)
def _decode_batch(where, sizes, params, poff, words, woff, changes, four_from, mcum, mfreq, mslot, vcum, vfreq, vslot,
                  vrow_of_key, vrow_plain, cols, headers, hoff, functions, state):
    """`_decode` building the targets of many tensors in one compiled call, their records parsed
    here too: tensor i's base is at address where[i, 0] (sizes[i] elements, readable in whole
    blocks), its target goes to where[i, 1] (sizes[i] elements), its params are
    params[poff[i]:poff[i + 1]] and its stream words[woff[i]:woff[i + 1]]. With `functions`
    (`hashing.NATIVE.functions()`), each target is digested as it is built: the XXH3 state at
    `state` reset per tensor and fed its header, headers[hoff[i]:hoff[i + 1]], first. Returns
    (changes decoded, status, digests (low, high halves)) of each: status 0, or not 0 when the
    record or its stream fails (decoding that one alone names the reason). A still record (the
    STILL bit, read where cols has any: a vote model) decodes over vrow_plain without votes."""
    m = sizes.size
    flags = m > 0 and cols.max() > 0
    hashing = functions.size > 0
    decoded = np.zeros(m, np.int64)
    status = np.zeros(m, np.int64)
    digests = np.zeros((m, 2), np.uint64)
    thr = np.zeros(MAX_CLASSES, np.int64)
    levels = np.zeros(MAX_CLASSES, np.int64)
    counts = np.zeros(MAX_CLASSES, np.int64)
    # allocated here, not a module global: numba freezes a global array as a read-only constant,
    # and `_decode` would then be compiled twice (here, and again for apply_'s writable one)
    none = np.zeros(0, np.uint16)
    for i in range(m):
        bad, nc, _, still = _parse_params(params[poff[i]:poff[i + 1]], changes[i], thr, levels, counts, flags)
        four = changes[i] >= four_from
        w, x, broken = _stream_states(words[woff[i]:woff[i + 1]], FOUR_STATES if four else STATES)
        if bad or broken:
            status[i] = 8
            continue
        n = sizes[i]
        padded = -(-n // ec.BLOCK) * ec.BLOCK
        bb = nb.carray(ec._u16_at(where[i, 0]), padded)
        out = nb.carray(ec._u16_at(where[i, 1]), n)
        copy_to = out if n == padded else none  # else `_decode` copies the base up front
        function = np.uintp(0)
        if hashing:
            hash_reset(functions[0], state)
            hash_update(functions[1], state, headers, hoff[i], hoff[i + 1])
            function = functions[1]
        _, _, decoded[i], status[i] = _decode(bb[:n], bb, w, x[0], x[1], x[2], x[3], four, thr[:nc - 1], levels[:nc],
                                              counts[:nc], mcum, mfreq, mslot, vcum, vfreq, vslot,
                                              vrow_plain if still else vrow_of_key, 0 if still else cols[i],
                                              out, copy_to, function, state)
        if hashing and status[i] == 0:
            digests[i, 0], digests[i, 1] = hash_digest(functions[2], state)
    return decoded, status, digests


def batchable(entry: Entry) -> bool:
    """Whether a record's shape lets `decode_at` take it (one raw stream of whole words); others,
    and any `decode_at` fails, are decoded alone, which names what is wrong."""
    streams = entry.streams
    return (entry.dtype in CODED and entry.changes > 0 and len(streams) == 1 and streams[0].codec == RAW
            and streams[0].raw_len == len(streams[0].stored) and not len(streams[0].stored) % 4)


def decode_at(entries: list[Entry], where: np.ndarray, shared: dict, headers: list[bytes] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """`decode_target` of many `batchable` records in one compiled call (per-tensor Python costs
    more than decoding a small tensor): record i's base elements are at address where[i, 0]
    (readable in whole blocks), its target is written to where[i, 1] (entries[i].numel
    elements); the caller owns both and keeps them alive. With `headers` (each target's
    `hashing.header_bytes`; only where `hashing.KERNEL_DIGESTS`), each target is digested as it
    is built. Returns (changes decoded, status, digests as (low, high) rows or None); None if the
    payload's shared blocks fail (each record alone then says why). A record whose status is
    not 0 left its target unfinished."""
    try:
        model = _model(shared)
        four_from = _rule(shared)
    except DeltaError:
        return None
    m = len(entries)
    poff = np.zeros(m + 1, np.int64)
    np.cumsum([len(e.params) for e in entries], out=poff[1:])
    woff = np.zeros(m + 1, np.int64)
    np.cumsum([len(e.streams[0].stored) >> 2 for e in entries], out=woff[1:])
    params = np.frombuffer(b"".join(e.params for e in entries), np.uint8)
    words = np.frombuffer(b"".join(e.streams[0].stored for e in entries), "<u4")
    changes = np.array([e.changes for e in entries], np.int64)
    sizes = np.array([e.numel for e in entries], np.int64)
    cols = np.array([model.columns(e.shape) for e in entries], np.int64)
    digesting = hashing.KernelDigests(headers, m)
    mfreq, mcum, mslot = mask_tables()
    decoded, status, digests = _decode_batch(np.ascontiguousarray(where, np.uintp), sizes, params, poff, words, woff,
                                             changes, four_from, mcum, mfreq, mslot, model.cum, model.freq,
                                             model.slots, model.row_of_key, model.row_plain, cols, digesting.headers,
                                             digesting.offsets, digesting.functions, digesting.states[0])
    del digesting  # frees its states
    return decoded, status, digests if headers is not None else None


def stream_names(entry: Entry) -> list[str]:
    return ["rans"]


def _token_extra_bits(tok: np.ndarray) -> np.ndarray:
    return np.where(tok < rans.DIRECT, 0, 1 + (tok - rans.DIRECT) // (1 << rans.SUB_BITS))


def cost_split(entry: Entry, shared: dict, analysis: Analysis) -> tuple[float, float]:
    """Bits the stream spends on the mask and on the values, under the payload's own models.

    The two share one rANS stream, so the split is recomputed from the changes (which need the
    base): -log2 of each symbol's probability plus its raw bits; the mask also pays for the
    params (thresholds, levels and per-class change counts).
    """
    _, levels, _, still = _params(entry, shared)
    model = _model(shared)
    mfreq, _, _ = mask_tables()
    mask = 8.0 * len(entry.params)
    for c, lv in enumerate(levels):
        ranks = analysis.ranks[analysis.classes == c]
        gaps = np.diff(np.concatenate(([-1], ranks))) - 1
        tok = _tokens(gaps)
        mask += float(np.sum(MASK_SCALE - np.log2(mfreq[lv, tok])) + _token_extra_bits(tok).sum())
    if model.vote and not still:  # v4: each change's vote symbol names its table row and its (flipped) token
        sym = analysis.vote_symbols().astype(np.int64)
        tok = sym & (VALUE_TOKENS - 1)
        rows = model.row_of_key[(sym >> VALUE_SYMBOL_BITS) & CONTEXT_MASK]
    else:
        tok = _tokens(analysis.zig)
        rows = model.row_plain[analysis.keys.astype(np.int64)]
    value = float(np.sum(VALUE_SCALE - np.log2(model.freq[rows, tok])) + _token_extra_bits(tok).sum())
    return mask, value


def describe_bits(entry: Entry, shared: dict, analysis: Analysis | None = None) -> dict:
    """Bits per changed element for `deltarelay inspect`: in total, and split into mask and
    values when the changes are known (inspect given the base)."""
    total_bits = 8 * (len(entry.params) + sum(len(s.stored) for s in entry.streams))
    n = max(entry.changes, 1)
    out = {"bits_per_change": total_bits / n}
    if analysis is not None:
        mask, value = cost_split(entry, shared, analysis)
        out["mask_bits_per_change"] = mask / n
        out["value_bits_per_change"] = value / n
    return out


# ---------------------------------------------------------------- the method

def elements_at(t: torch.Tensor, keep: list) -> int:
    """Address of a CPU tensor's elements, readable in whole blocks of 64 elements: its own
    memory where it is contiguous and whole blocks, else a padded copy, which `keep` holds."""
    if t.is_contiguous() and t.numel() % ec.BLOCK == 0:
        keep.append(t)
        return t.data_ptr()
    copy = ec.blocks(np.ascontiguousarray(tensors.element_view(t)))
    keep.append(copy)
    return copy.ctypes.data


VALUE_TABLES = SharedBlock(SHARED_VALUE_TABLES, VERSIONS, "value tables",
                           refused_elsewhere=False)  # a v1 payload carrying it has always decoded, the block unread
INTERLEAVE = SharedBlock(SHARED_INTERLEAVE, (3, 4), "an interleave rule")
VOTE_TABLES = SharedBlock(SHARED_VOTE_TABLES, (4,), "vote tables")
VOTE_VERSIONS = VOTE_TABLES.versions  # where the encoder codes values with column votes


@dataclass
class Tables:
    """What a payload's records are coded with (`Conditional.fit`): the value tables, and from
    how many changes a record uses four states (NEVER where the payload's version has no rule)."""

    values: ValueModel
    four_from: int


class Conditional(Method):
    """BF16 in v2 to v4: analyses every BF16 tensor (CPU pairs in batches: one compiled scan, and
    one compiled coding call for the sparse ones; device pairs where they live, `device.py`),
    fits the payload's value tables from all of them, and decodes CPU records in one call."""

    id, name, versions = ID, NAME, VERSIONS
    preference = 10
    shared_kinds = (VALUE_TABLES, INTERLEAVE, VOTE_TABLES)
    analyses = True
    builds_target = True
    decodes_in_place = True

    def applicable(self, dtype: tensors.DType) -> bool:
        return dtype in CODED

    def encodes(self, dtype: tensors.DType, version: int) -> bool:
        return dtype is tensors.BF16 or (dtype is tensors.F16 and version >= F16_FROM)

    # ---- encoder

    def analyse(self, base: torch.Tensor, target: torch.Tensor, host) -> Analysis:
        if target.device.type != "cpu" and base.device == target.device:
            from ..device import analyze_on_device  # (device.py builds on this module)

            a = analyze_on_device(base, target)
            a.cols = vote_columns(tuple(target.shape))
            return a
        b, t = host()  # on the CPU, or on two devices: from host copies
        return analyze(b, t, cols=vote_columns(tuple(target.shape)))

    def batch_encodable(self, base: torch.Tensor, target: torch.Tensor) -> bool:
        return target.dtype in (torch.bfloat16, torch.float16) and target.is_cpu and base.is_cpu

    def scratch(self) -> ec.ScanBuffers:
        return ec.ScanBuffers()

    def analyse_batch(self, bases, targets, scratch: ec.ScanBuffers | None,
                      hash_base: Sequence[bool] | None = None, version: int = 0) -> Batch:
        """One compiled scan of all the pairs (digesting them too where the kernels can; a base only
        where `hash_base` says so); for a format `version` with column votes, making the changes'
        vote symbols too."""
        sizes = np.array([t.numel() for t in targets], np.int64)
        keep: list = []  # keeps the tensors' memory for the scan
        where = np.array([(elements_at(b, keep), elements_at(t, keep)) for b, t in zip(bases, targets)],
                         np.uintp).reshape(-1, 2)
        headers = ([header_bytes(tensors.BY_TORCH[t.dtype].name, tuple(t.shape)) for t in targets]
                   if hashing.KERNEL_DIGESTS else None)
        cols = (np.array([vote_columns(tuple(t.shape)) for t in targets], np.int64) if version in VOTE_VERSIONS
                else None)
        return analyze_at(where, sizes, headers, scratch, cols=cols,
                          hash_base=None if hash_base is None else np.array(hash_base, np.uint8))

    def fit(self, version: int, batches: list[Batch], analyses: list[Analysis]) -> Tables | None:
        if not any(b.pairs.size for b in batches) and not any(a.changes for a in analyses):
            return None
        if version in VOTE_VERSIONS:  # v4: values coded with column votes where that costs less
            for b in batches:  # still records where columns do not lean
                b.settle()
            for a in analyses:
                a.settle()
            model = ValueModel.fit_votes([b.vote_symbols() for b in batches]
                                         + [a.coded_symbols(True) for a in analyses])
        else:
            model = ValueModel.fit_symbols([b.value_symbols for b in batches] + [a.value_symbols for a in analyses])
        # v3: records with many changes use four interleaved rANS states (the payload states the rule)
        return Tables(model, FOUR_STATES_FROM if version in INTERLEAVE.versions else NEVER)

    def encode(self, job: Job, model: Tables | None) -> tuple[bytes, list[Stream]] | None:
        if job.analysis is None or model is None:
            return None
        a = job.analysis
        if model.values.vote and a._votes is None and a.index is None:  # a batch's tensor coded alone
            a.index = job.index if job.index is not None else ec.differences(job.base, job.target)
        return encode(a, model.values, model.four_from)

    def encode_batch(self, batch: Batch, which: np.ndarray, model: Tables | None
                     ) -> Sequence[tuple[bytes, list[Stream]] | None]:
        if model is None:
            return [None] * len(which)
        return encode_batch(batch, which, model.values, model.four_from)

    def shared_blocks(self, model: Tables | None) -> dict[int, bytes]:
        if model is None:
            return {}
        blocks = {SHARED_VOTE_TABLES if model.values.vote else SHARED_VALUE_TABLES: model.values.pack()}
        if model.four_from < NEVER:
            blocks[SHARED_INTERLEAVE] = interleave_rule(model.four_from)
        return blocks

    # ---- decoder

    def decode(self, entry: Entry, base: np.ndarray, shared: dict) -> Patch:
        return decode(entry, base, shared)

    def decode_target(self, entry: Entry, base: np.ndarray, shared: dict, digest: Running | None = None
                      ) -> tuple[int, np.ndarray]:
        return decode_target(entry, base, shared, digest)

    def decode_in_place(self, entry: Entry, elems: np.ndarray, shared: dict, digest: Running | None = None) -> Patch:
        return decode_in_place(entry, elems, shared, digest)

    def batch_decodable(self, entry: Entry) -> bool:
        return batchable(entry)

    def decode_batch(self, entries, bases, outs, shared, headers):
        keep: list = []
        where = np.array([(elements_at(b, keep), o.data_ptr()) for b, o in zip(bases, outs)], np.uintp).reshape(-1, 2)
        result = decode_at(entries, where, shared, headers)
        del keep
        if result is None:
            return None
        decoded, status, halves = result
        if halves is None:
            return decoded, status, None
        blob = digest_bytes(halves)
        return decoded, status, [blob[16 * i: 16 * i + 16] for i in range(len(entries))]

    def stream_names(self, entry: Entry) -> list[str]:
        return stream_names(entry)

    def describe(self, entry: Entry, shared: dict, base: np.ndarray | None, target: np.ndarray | None) -> dict:
        """Bits per change; split into mask and values given the elements."""
        analysis = (analyze(base, target, vote_columns(tuple(entry.shape)))
                    if base is not None and target is not None else None)
        return describe_bits(entry, shared, analysis)


METHOD = Conditional()
