"""Method 3, `conditional` (codec v2): BF16 changes entropy-coded with models conditioned on the base.

The receiver holds the base, and the base predicts the delta: an AdamW step shows up in BF16
when it crosses a rounding boundary, i.e. with probability ~|dw| / ulp(w), and ulp(w) depends
only on the exponent. So every element gets a context: its base exponent (the key).

- Mask: for each key k, the changed elements among the elements with that key form a Bernoulli
  sequence. We code the gaps (runs of unchanged elements of the same key) with a geometric model
  whose parameter is sent as one of 256 quantised levels per (tensor, key). Cost ~ the order-0
  entropy of the mask given (tensor, exponent), paid per change, not per element.
- Values: the change as a signed step in ordered-integer space (ord(x) = ~x for negatives,
  x ^ 0x8000 for positives), zigzagged and tokenized, coded with one table per key shared by all
  tensors of the payload (small weights move more ULPs). Exponent/sign changes, zero crossings,
  NaN and Inf are just large steps: no escape needed, every bit pattern round-trips.
- One rANS stream per tensor: every context's gaps first, then the values in tensor order, so
  the decoder runs three tight compiled phases (ranks, one counter-only pass over the base that
  turns ranks into positions, values) instead of stopping its scan at every change.

Measured on MiniLM corpora (see the closing notes): the base's top mantissa bit adds nothing to
the mask (ulp is constant within a binade); per-tensor mask levels win ~2-9%; the key cuts the
value stream from ~1.8 to ~1.35 bits per change; the base's sign adds < 0.01 bit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numba as nb
import numpy as np

from .. import rans
from ..container import Entry, Stream
from ..compressors import RAW
from ..errors import DeltaError
from ..wire import Reader, Writer
from .base import Patch

ID = 3
NAME = "conditional"
MIN_VERSION = 2
SHARED_VALUE_TABLES = 1  # key in Payload.shared

KEY_SHIFT = 7  # key = (bits >> 7) & 0xFF: the exponent
N_KEYS = 256
N_LEVELS = 256
LEVELS_PER_OCTAVE = 6
GAP_BITS = 48
GAP_TOKENS = rans.token_count(GAP_BITS)
VALUE_BITS = 17
VALUE_TOKENS = rans.token_count(VALUE_BITS)
MASK_SCALE = 15
VALUE_SCALE = 14


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


# ---------------------------------------------------------------- compiled kernels

@nb.njit(inline="always", cache=True)
def _ord(v):
    return (v ^ 0xFFFF) if v & 0x8000 else (v ^ 0x8000)


@nb.njit(inline="always", cache=True)
def _unord(o):
    return (o ^ 0x8000) if o & 0x8000 else (o ^ 0xFFFF)


@nb.njit(inline="always", cache=True)
def _zigzag(b, t):
    s = _ord(np.int64(t)) - _ord(np.int64(b))
    return 2 * s - 2 if s > 0 else -2 * s - 1


@nb.njit(cache=True, nogil=True)
def _analyze(b, t, cap, lanes):
    """One pass: element counts per (lane, key) and the changes (position, key, rank within
    (lane, key), zigzag step). Counts are kept per sign-and-exponent (bits >> 7) so the scan needs
    no masking; a key adds both signs. Returns k > cap when the buffers were too small.

    With 4 lanes, four consecutive elements update four different counter arrays, so the
    counters never wait on each other (store-to-load forwarding) in the hot loop.
    """
    n = b.size
    W = 2 * N_KEYS
    cnt = np.zeros(lanes * W, np.int64)
    pos = np.empty(cap, np.int64)
    keys = np.empty(cap, np.uint8)
    ranks = np.empty(cap, np.int64)
    zig = np.empty(cap, np.int64)
    k = 0
    start = 0
    if lanes == 4:
        n4 = n - n % 4
        for i in range(0, n4, 4):
            b0 = b[i]
            b1 = b[i + 1]
            b2 = b[i + 2]
            b3 = b[i + 3]
            cnt[b0 >> KEY_SHIFT] += 1
            cnt[W + (b1 >> KEY_SHIFT)] += 1
            cnt[2 * W + (b2 >> KEY_SHIFT)] += 1
            cnt[3 * W + (b3 >> KEY_SHIFT)] += 1
            if (t[i] != b0) | (t[i + 1] != b1) | (t[i + 2] != b2) | (t[i + 3] != b3):
                for j in range(4):
                    if t[i + j] != b[i + j]:
                        if k < cap:
                            key = (np.int64(b[i + j]) >> KEY_SHIFT) & 0xFF
                            pos[k] = i + j
                            keys[k] = key
                            ranks[k] = cnt[j * W + key] + cnt[j * W + key + N_KEYS] - 1
                            zig[k] = _zigzag(b[i + j], t[i + j])
                        k += 1
        start = n4
    for i in range(start, n):
        lane = i % lanes
        cnt[lane * W + (b[i] >> KEY_SHIFT)] += 1
        if t[i] != b[i]:
            if k < cap:
                key = (np.int64(b[i]) >> KEY_SHIFT) & 0xFF
                pos[k] = i
                keys[k] = key
                ranks[k] = cnt[lane * W + key] + cnt[lane * W + key + N_KEYS] - 1
                zig[k] = _zigzag(b[i], t[i])
            k += 1
    counts = np.empty((lanes, N_KEYS), np.int64)
    for lane in range(lanes):
        for key in range(N_KEYS):
            counts[lane, key] = cnt[lane * W + key] + cnt[lane * W + key + N_KEYS]
    return counts, pos, keys, ranks, zig, k


@nb.njit(cache=True, nogil=True)
def _encode(pos, keys, ranks, zig, lanes, ctx_of_key, level_of_ctx, mcum, mfreq, vcum, vfreq, vrow_of_key):
    """rANS-code the changes in reverse of the order `_decode` consumes them (docs/FORMAT.md):
    first every context's gaps (context by context), then every value in tensor order."""
    nctx = level_of_ctx.size
    k = keys.size
    words = np.empty(8 * k + 16, np.int64)
    nw = 0
    x = np.int64(rans.RANS_L)
    for j in range(k - 1, -1, -1):  # values, last change first
        row = vrow_of_key[keys[j]]
        tok, nbits, extra = rans.tokenize(zig[j])
        x, nw = rans.enc_bits(x, words, nw, extra, nbits)
        x, nw = rans.enc_put(x, words, nw, vcum[row, tok], vfreq[row, tok], VALUE_SCALE)
    # gaps, grouped by context: order changes by (slot, rank), a stable counting sort by slot
    nslots = lanes * nctx
    slots = np.empty(k, np.int64)
    start = np.zeros(nslots + 1, np.int64)
    for j in range(k):
        q = (pos[j] % lanes) * nctx + ctx_of_key[keys[j]]
        slots[j] = q
        start[q + 1] += 1
    for q in range(nslots):
        start[q + 1] += start[q]
    order = np.empty(k, np.int64)
    for j in range(k):
        q = slots[j]
        order[start[q]] = j
        start[q] += 1
    for jj in range(k - 1, -1, -1):
        j = order[jj]
        prev = -1
        if jj > 0 and slots[order[jj - 1]] == slots[j]:
            prev = ranks[order[jj - 1]]
        gap = ranks[j] - prev - 1
        lv = level_of_ctx[slots[j] % nctx]
        tok, nbits, extra = rans.tokenize(gap)
        x, nw = rans.enc_bits(x, words, nw, extra, nbits)
        x, nw = rans.enc_put(x, words, nw, mcum[lv, tok], mfreq[lv, tok], MASK_SCALE)
    return words, nw, x


@nb.njit(cache=True, nogil=True)
def _decode(b, words, x, lut, level_of_ctx, slot_counts, mcum, mfreq, mslot, vcum, vfreq, vslot, vrow_of_key):
    """Decode in three tight phases, none waiting on another's memory traffic:
    1. every context's change ranks from the gap symbols (rANS, tables hot in cache);
    2. one scan over the base turning ranks into positions (counters only, no entropy decoding);
    3. the values, in tensor order (rANS again).
    `slot_counts[lane * nctx + c]` = changes of (lane, context c); `lut` maps bits >> 7 to c, keys
    without changes to nctx. Returns (positions, values, status)."""
    nctx = level_of_ctx.size
    nslots = slot_counts.size
    lanes = nslots // nctx if nctx else 1
    S = nctx + 1
    expected = 0
    for q in range(nslots):
        expected += slot_counts[q]
    out_pos = np.empty(expected, np.int64)
    out_val = np.empty(expected, np.uint16)
    ranks = np.empty(expected, np.int64)
    first = np.zeros(nslots + 1, np.int64)
    pos = words.size - 1
    j = 0
    L = rans.RANS_L
    mmask = (1 << MASK_SCALE) - 1
    for q in range(nslots):
        first[q] = j
        lv = level_of_ctx[q % nctx]
        r = -1
        for _ in range(slot_counts[q]):
            # one gap token, then its raw bits; written out here (not via rans helpers) because
            # the inlined helpers' tuple returns cost 2-3x in this loop
            slot = x & mmask
            tok = np.int64(mslot[lv, slot])
            x = mfreq[lv, tok] * (x >> MASK_SCALE) + slot - mcum[lv, tok]
            if x < L:
                if pos < 0:
                    return out_pos, out_val, 1
                x = (x << 32) | words[pos]
                pos -= 1
            gap = tok
            if tok >= rans.DIRECT:
                gap, nbits = rans.token_base(tok)
                if nbits > 16:
                    extra, x, pos = rans.dec_bits(x, words, pos, nbits)
                    if pos == -2:
                        return out_pos, out_val, 1
                    gap += extra
                else:
                    gap += x & ((1 << nbits) - 1)
                    x >>= nbits
                    if x < L:
                        if pos < 0:
                            return out_pos, out_val, 1
                        x = (x << 32) | words[pos]
                        pos -= 1
            r += gap + 1
            if r >= b.size:  # a rank beyond the tensor (also keeps r from overflowing)
                return out_pos, out_val, 6
            ranks[j] = r
            j += 1
    first[nslots] = j
    # rem[lane * S + c]: elements of the context left to scan up to and including its next change
    rem = np.full(lanes * S, 1 << 62, np.int64)
    nxt = np.zeros(lanes * S, np.int64)  # index into ranks of that next change
    end = np.zeros(lanes * S, np.int64)
    for lane in range(lanes):
        for c in range(nctx):
            q = lane * nctx + c
            w = lane * S + c
            nxt[w] = first[q]
            end[w] = first[q + 1]
            if first[q] < first[q + 1]:
                rem[w] = ranks[first[q]] + 1
    k = 0
    n = b.size
    start = 0
    if lanes == 4:
        n4 = n - n % 4
        for i in range(0, n4, 4):
            s0 = np.int64(lut[b[i] >> KEY_SHIFT])
            s1 = S + lut[b[i + 1] >> KEY_SHIFT]
            s2 = 2 * S + lut[b[i + 2] >> KEY_SHIFT]
            s3 = 3 * S + lut[b[i + 3] >> KEY_SHIFT]
            v0 = rem[s0] - 1
            v1 = rem[s1] - 1
            v2 = rem[s2] - 1
            v3 = rem[s3] - 1
            rem[s0] = v0
            rem[s1] = v1
            rem[s2] = v2
            rem[s3] = v3
            if (v0 == 0) | (v1 == 0) | (v2 == 0) | (v3 == 0):
                for lane in range(4):
                    w = lane * S + lut[b[i + lane] >> KEY_SHIFT]
                    if rem[w] == 0:
                        if k >= expected:
                            return out_pos, out_val, 2
                        out_pos[k] = i + lane
                        k += 1
                        m = nxt[w]
                        nxt[w] = m + 1
                        rem[w] = ranks[m + 1] - ranks[m] if m + 1 < end[w] else 1 << 62
        start = n4
    for i in range(start, n):
        w = (i % lanes) * S + lut[b[i] >> KEY_SHIFT]
        v = rem[w] - 1
        rem[w] = v
        if v == 0:
            if k >= expected:
                return out_pos, out_val, 2
            out_pos[k] = i
            k += 1
            m = nxt[w]
            nxt[w] = m + 1
            rem[w] = ranks[m + 1] - ranks[m] if m + 1 < end[w] else 1 << 62
    if k != expected:
        return out_pos, out_val, 6
    vmask = (1 << VALUE_SCALE) - 1
    for j in range(expected):
        bv = np.int64(b[out_pos[j]])
        row = vrow_of_key[(bv >> KEY_SHIFT) & 0xFF]
        if row < 0:
            return out_pos, out_val, 3
        slot = x & vmask
        tok = np.int64(vslot[row, slot])
        x = vfreq[row, tok] * (x >> VALUE_SCALE) + slot - vcum[row, tok]
        if x < L:
            if pos < 0:
                return out_pos, out_val, 1
            x = (x << 32) | words[pos]
            pos -= 1
        u = tok
        if tok >= rans.DIRECT:  # value tokens carry at most 15 raw bits: one chunk
            u, nbits = rans.token_base(tok)
            u += x & ((1 << nbits) - 1)
            x >>= nbits
            if x < L:
                if pos < 0:
                    return out_pos, out_val, 1
                x = (x << 32) | words[pos]
                pos -= 1
        s = (u + 2) >> 1 if (u & 1) == 0 else -((u + 1) >> 1)
        o = _ord(bv) + s
        if o < 0 or o > 0xFFFF:
            return out_pos, out_val, 4
        out_val[j] = _unord(o)
    if x != rans.RANS_L or pos != -1:
        return out_pos, out_val, 7
    return out_pos, out_val, 0


_STATUS = {
    1: "entropy stream ends early", 2: "more changes than the index declares",
    3: "a change falls under an exponent with no value table", 4: "a decoded step leaves the BF16 range",
    5: "fewer changes than the index declares", 6: "a context's changes lie beyond its elements",
    7: "entropy stream has leftover state (corrupt or forged)",
}


# ---------------------------------------------------------------- encoder side

@dataclass
class Analysis:
    """What one pass over (base, target) learned: enough to pick a method and to code it."""

    counts: np.ndarray  # elements per (lane, key): shape (lanes, 256)
    index: np.ndarray  # changed positions
    keys: np.ndarray  # base exponent of each change
    ranks: np.ndarray  # rank of each change among the elements of its (lane, key)
    zig: np.ndarray  # zigzagged ULP step of each change

    @property
    def changes(self) -> int:
        return int(self.index.size)

    @property
    def lanes(self) -> int:
        return int(self.counts.shape[0])


LANES = (1, 2, 4, 8)
LANE_MIN_ELEMENTS = 1 << 16  # smaller tensors use one lane: 4 lanes cost a few more gap symbols


def lanes_for(n: int) -> int:
    """Element i belongs to lane i % lanes; each (lane, key) is its own context sequence, so the
    decoder's counters for neighbouring elements are independent (4x fewer pipeline stalls)."""
    return 4 if n >= LANE_MIN_ELEMENTS else 1


def analyze(base: np.ndarray, target: np.ndarray) -> Analysis:
    lanes = lanes_for(base.size)
    cap = max(1024, base.size // 16)
    counts, pos, keys, ranks, zig, k = _analyze(base, target, cap, lanes)
    if k > cap:
        counts, pos, keys, ranks, zig, k = _analyze(base, target, k, lanes)
    return Analysis(counts, pos[:k], keys[:k], ranks[:k], zig[:k])


class ValueModel:
    """One value-token table per key, shared by every conditional tensor of a payload."""

    def __init__(self, freq: np.ndarray, keys: np.ndarray) -> None:
        self.freq = np.asarray(freq, np.int32)  # (rows, VALUE_TOKENS); int32 keeps tables in cache
        self.cum = rans.cumulative(freq)
        self.slots = rans.slot_table(self.freq, VALUE_SCALE) if freq.shape[0] else np.zeros((0, 1 << VALUE_SCALE), np.uint8)
        self.row_of_key = np.full(N_KEYS, -1, np.int64)
        self.row_of_key[keys] = np.arange(keys.size)
        self.keys = keys

    @classmethod
    def fit(cls, analyses: list[Analysis]) -> "ValueModel":
        hist = np.zeros((N_KEYS, VALUE_TOKENS), np.int64)
        for a in analyses:
            if a.changes:
                cell = a.keys.astype(np.int64) * VALUE_TOKENS + _tokens(a.zig)
                hist += np.bincount(cell, minlength=N_KEYS * VALUE_TOKENS).reshape(N_KEYS, VALUE_TOKENS)
        keys = np.flatnonzero(hist.sum(axis=1))
        freq = np.stack([rans.normalize(hist[k], VALUE_SCALE, floor_all=False) for k in keys]) if keys.size else np.zeros((0, VALUE_TOKENS), np.int64)
        return cls(freq, keys)

    def pack(self) -> bytes:
        w = Writer()
        w.uvarint(self.keys.size)
        prev = -1
        for key, row in zip(self.keys, self.freq):
            w.uvarint(int(key) - prev - 1)
            prev = int(key)
            nz = np.flatnonzero(row)
            w.uvarint(nz.size)
            last = -1
            for tok in nz:
                w.uvarint(int(tok) - last - 1)
                last = int(tok)
                w.uvarint(int(row[tok]))
        return w.getvalue()

    @classmethod
    def unpack(cls, data: bytes) -> "ValueModel":
        r = Reader(data, "value tables")
        n = r.uvarint(N_KEYS)
        keys = np.zeros(n, np.int64)
        freq = np.zeros((n, VALUE_TOKENS), np.int64)
        key = -1
        for i in range(n):
            key += r.uvarint(N_KEYS) + 1
            if key >= N_KEYS:
                raise DeltaError("value tables: key out of range")
            keys[i] = key
            tok = -1
            for _ in range(r.uvarint(VALUE_TOKENS)):
                tok += r.uvarint(VALUE_TOKENS) + 1
                if tok >= VALUE_TOKENS:
                    raise DeltaError("value tables: token out of range")
                freq[i, tok] = r.uvarint(1 << VALUE_SCALE)
            total = int(freq[i].sum())
            if total != 1 << VALUE_SCALE or freq[i].max() >= 1 << VALUE_SCALE:
                raise DeltaError(f"value tables: key {key} frequencies sum to {total}, expected {1 << VALUE_SCALE}")
        r.expect_end()
        return cls(freq, keys)


def _tokens(zig: np.ndarray) -> np.ndarray:
    """Vectorised rans.tokenize(...)[0]."""
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


def _choose_levels(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Mask level minimising the ideal Bernoulli cost of k changes among n elements, per context."""
    p = level_probability()
    cost = -(k[:, None] * np.log2(p)[None, :] + (n - k)[:, None] * np.log2(1.0 - p)[None, :])
    return np.argmin(cost, axis=1).astype(np.int64)


def encode(a: Analysis, model: ValueModel) -> tuple[bytes, list[Stream]]:
    key_changes = np.bincount(a.keys, minlength=N_KEYS)
    active = np.flatnonzero(key_changes)
    ctx_of_key = np.full(N_KEYS, -1, np.int64)
    ctx_of_key[active] = np.arange(active.size)
    levels = _choose_levels(a.counts.sum(axis=0)[active].astype(np.float64), key_changes[active].astype(np.float64))
    mfreq, mcum, _ = mask_tables()
    words, nw, x = _encode(a.index, a.keys, a.ranks, a.zig, a.lanes, ctx_of_key, levels, mcum, mfreq,
                           model.cum, model.freq, model.row_of_key)
    data = rans.words_to_bytes(words, nw, int(x))
    lane_of = a.index % a.lanes
    slot_counts = np.bincount(lane_of * active.size + ctx_of_key[a.keys], minlength=a.lanes * active.size)
    w = Writer()
    for count in slot_counts:
        w.uvarint(int(count))
    params = struct.pack("<BBH", KEY_SHIFT, a.lanes, active.size) + active.astype(np.uint8).tobytes() \
        + levels.astype(np.uint8).tobytes() + w.getvalue()
    return params, [Stream(RAW, len(data), data)]


# ---------------------------------------------------------------- decoder side

def _params(entry: Entry) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(lanes, active keys, their mask levels, changes per (lane, key)), checked against the index."""
    p = bytes(entry.params)
    if len(p) < 4:
        raise DeltaError("conditional params are truncated", tensor=entry.name)
    shift, lanes, n = struct.unpack_from("<BBH", p)
    if shift != KEY_SHIFT:
        raise DeltaError("unsupported context key", tensor=entry.name)
    if lanes not in LANES:
        raise DeltaError(f"unsupported lane count {lanes}", tensor=entry.name)
    if n > N_KEYS or len(p) < 4 + 2 * n:
        raise DeltaError(f"conditional params declare {n} keys in {len(p)} bytes", tensor=entry.name)
    keys = np.frombuffer(p, np.uint8, n, 4).astype(np.int64)
    levels = np.frombuffer(p, np.uint8, n, 4 + n).astype(np.int64)
    if n > 1 and np.any(np.diff(keys) <= 0):
        raise DeltaError("context keys are not strictly increasing", tensor=entry.name)
    r = Reader(p[4 + 2 * n:], f"params of {entry.name!r}")
    counts = np.array([r.uvarint(entry.changes) for _ in range(lanes * n)], dtype=np.int64)
    r.expect_end()
    if int(counts.sum()) != entry.changes:
        raise DeltaError(f"context counts add up to {int(counts.sum())} changes, index says {entry.changes}",
                         tensor=entry.name)
    return lanes, keys, levels, counts


_MODEL_CACHE: dict[int, tuple[bytes, ValueModel]] = {}


def _model(shared: dict) -> ValueModel:
    data = shared.get(SHARED_VALUE_TABLES)
    if data is None:
        raise DeltaError("payload has conditional tensors but no value tables")
    cached = _MODEL_CACHE.get(id(shared))
    if cached is not None and cached[0] is data:
        return cached[1]
    model = ValueModel.unpack(data)
    _MODEL_CACHE.clear()
    _MODEL_CACHE[id(shared)] = (data, model)
    return model


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    if base.dtype != np.uint16:
        raise DeltaError("`conditional` applies to BF16 tensors only", tensor=entry.name)
    if len(entry.streams) != 1:
        raise DeltaError(f"method expects 1 stream, index has {len(entry.streams)}", tensor=entry.name)
    lanes, keys, levels, counts = _params(entry)
    model = _model(shared)
    s = entry.streams[0]
    if s.codec != RAW or s.raw_len != len(s.stored):
        raise DeltaError("entropy stream must be stored raw", tensor=entry.name)
    parsed = rans.bytes_to_words(bytes(s.stored))
    if parsed is None:
        raise DeltaError("entropy stream is malformed", tensor=entry.name)
    words, x = parsed
    lut = np.full(2 * N_KEYS, keys.size, np.uint16)  # sign bit ignored: both halves map alike
    lut[keys] = np.arange(keys.size)
    lut[keys + N_KEYS] = np.arange(keys.size)
    mfreq, mcum, mslot = mask_tables()
    if levels.size and levels.max() >= N_LEVELS:
        raise DeltaError("mask level out of range", tensor=entry.name)
    pos, val, status = _decode(base, words, np.int64(x), lut, levels, counts, mcum, mfreq, mslot,
                               model.cum, model.freq, model.slots, model.row_of_key)
    if status:
        raise DeltaError(_STATUS[status], tensor=entry.name)
    return Patch(pos, val)


def stream_names(entry: Entry) -> list[str]:
    return ["rans"]


def _token_extra_bits(tok: np.ndarray) -> np.ndarray:
    return np.where(tok < rans.DIRECT, 0, 1 + (tok - rans.DIRECT) // (1 << rans.SUB_BITS))


def cost_split(entry: Entry, shared: dict, analysis: Analysis) -> tuple[float, float]:
    """Bits the stream spends on the mask and on the values, under the payload's own models.

    The two share one rANS stream, so the split is recomputed from the changes (which need the
    base): -log2 of each symbol's probability plus its raw bits; the mask also pays for the
    per-context change counts in the params.
    """
    lanes, keys, levels, _ = _params(entry)
    model = _model(shared)
    mfreq, _, _ = mask_tables()
    mask = 8.0 * (len(entry.params) - 4 - 2 * keys.size)
    lane_of = analysis.index % lanes
    for key, lv in zip(keys, levels):
        for lane in range(lanes):
            ranks = analysis.ranks[(analysis.keys == key) & (lane_of == lane)]
            gaps = np.diff(np.concatenate(([-1], ranks))) - 1
            tok = _tokens(gaps)
            mask += float(np.sum(MASK_SCALE - np.log2(mfreq[lv, tok])) + _token_extra_bits(tok).sum())
    tok = _tokens(analysis.zig)
    rows = model.row_of_key[analysis.keys.astype(np.int64)]
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
