"""Exponent classes: the mask's contexts, and the scans that map positions to ranks and back.

An element's class is the number of class thresholds at or below its exponent ((bits >> 7) & 0xFF),
so a tensor's classes are at most 8 intervals of the exponent axis. Intervals, because the chance
that a BF16 element changes falls monotonically with its exponent (ulp doubles per binade); at
most 8, because the scans then count every class of 4 elements at once with SWAR arithmetic on
64-bit words (4 BF16 lanes per word), which LLVM vectorises: ~1 cycle per element instead of a
histogram update per element. Blocks of 64 elements are counted whole; only blocks holding a
change look inside, with a 64-bit class-membership mask and a broadword popcount / select.

- `sample_stats`: exponents (and changes) of a sample of elements, to choose classes from.
- `choose_classes`: thresholds minimising the order-0 cost of the mask (an exact DP over exponents).
- `analyze` (encoder): every change with its exponent, class, rank in its class and step.
- `positions` (decoder): the inverse, from every class's ranks.
"""

from __future__ import annotations

import platform

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

MAX_CLASSES = 8
KEY_SHIFT = 7
SAMPLE_BITS = 14  # a tensor of n elements samples 1 in max(1, n >> 14) of its elements
CLASS_OVERHEAD_BITS = 24.0  # a threshold, a level and a change count in the params

_H = np.uint64(0x8000800080008000)  # the top bit of each 16-bit lane
_LOW = np.uint64(0x7FFF7FFF7FFF7FFF)
_ONE = np.uint64(0x0001000100010001)
_LANES4 = np.uint64((1 << 48) | (1 << 33) | (1 << 18) | (1 << 3))  # gathers 4 lane flags into bits 48..51
_U15 = np.uint64(15)
_U48 = np.uint64(48)
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_LANE = np.uint64(0xFFFF)
BLOCK_WORDS = 16
BLOCK = 4 * BLOCK_WORDS  # 64 elements: one bit each in a membership mask
_FAR = 1 << 62


def sample_stride(n: int) -> int:
    return max(1, n >> SAMPLE_BITS)


@nb.njit(cache=True, nogil=True)
def class_lut(thresholds):
    """Class of each exponent 0..255 (uint8)."""
    lut = np.empty(256, np.uint8)
    c = 0
    for e in range(256):
        while c < thresholds.size and thresholds[c] <= e:
            c += 1
        lut[e] = c
    return lut


@nb.njit(cache=True, nogil=True)
def swar_thresholds(thresholds):
    """9 words: T[c] is class c's lower bound (exponent << 7) in every lane; T[0] = 0 (every element
    is at or above it), unused and T[8] = 0x8000 (no element reaches it)."""
    t = np.empty(MAX_CLASSES + 1, np.uint64)
    t[0] = _U0
    for c in range(1, MAX_CLASSES + 1):
        bound = np.uint64(thresholds[c - 1]) << np.uint64(KEY_SHIFT) if c - 1 < thresholds.size else np.uint64(0x8000)
        t[c] = bound * _ONE
    return t


def block_words(a: np.ndarray) -> np.ndarray:
    """A flat uint16 array as 64-bit words (4 elements each) in whole blocks of 64 elements.

    A view when the size is a multiple of 64 and the data 8-byte aligned (every tensor of usual
    models); otherwise a copy padded with +0.0, which is class 0 (thresholds start at 1) and lies
    after every real element, so it changes no rank of a real one."""
    if a.size % BLOCK == 0 and a.ctypes.data % 8 == 0:
        return a.view(np.uint64)
    padded = np.zeros(-(-a.size // BLOCK) * BLOCK, np.uint16)
    padded[: a.size] = a
    return padded.view(np.uint64)


# ---------------------------------------------------------------- SWAR primitives

@nb.njit(inline="always", cache=True)
def _ge(v, t):
    """Top bit of each lane set where the lane's |bits| >= the lane's threshold; v = (w & LOW) | H."""
    return (v - t) & _H


@nb.njit(inline="always", cache=True)
def _hsum(acc):
    """Sum of the four 16-bit lane counters."""
    return np.int64((acc * _ONE) >> _U48)


@nb.njit(inline="always", cache=True)
def _lane_bits(m):
    """The four lane flags (top bits) of m as bits 0..3."""
    return ((m >> _U15) * _LANES4) >> _U48


@nb.njit(inline="always", cache=True)
def _nonzero_lanes(x):
    """Top bit of each lane set where the lane of x is not zero."""
    return (((x & _LOW) + _LOW) | x) & _H


@nb.njit(inline="always", cache=True)
def _block_counts(w, o, T, cnt):
    """Elements of each class in the block of BLOCK_WORDS words at word o, into cnt[0..7]."""
    t1 = T[1]
    t2 = T[2]
    t3 = T[3]
    t4 = T[4]
    t5 = T[5]
    t6 = T[6]
    t7 = T[7]
    a1 = _U0
    a2 = _U0
    a3 = _U0
    a4 = _U0
    a5 = _U0
    a6 = _U0
    a7 = _U0
    for j in range(BLOCK_WORDS):
        v = (w[o + j] & _LOW) | _H
        a1 += _ge(v, t1) >> _U15
        a2 += _ge(v, t2) >> _U15
        a3 += _ge(v, t3) >> _U15
        a4 += _ge(v, t4) >> _U15
        a5 += _ge(v, t5) >> _U15
        a6 += _ge(v, t6) >> _U15
        a7 += _ge(v, t7) >> _U15
    g1 = _hsum(a1)
    g2 = _hsum(a2)
    g3 = _hsum(a3)
    g4 = _hsum(a4)
    g5 = _hsum(a5)
    g6 = _hsum(a6)
    g7 = _hsum(a7)
    cnt[0] = BLOCK - g1
    cnt[1] = g1 - g2
    cnt[2] = g2 - g3
    cnt[3] = g3 - g4
    cnt[4] = g4 - g5
    cnt[5] = g5 - g6
    cnt[6] = g6 - g7
    cnt[7] = g7


@nb.njit(inline="always", cache=True)
def _members(w, o, T, c):
    """Bit i set where element i of the block at word o belongs to class c (32 bits)."""
    lo = T[c]
    hi = T[c + 1]
    m = _U0
    for j in range(BLOCK_WORDS):
        v = (w[o + j] & _LOW) | _H
        m |= _lane_bits(_ge(v, lo) & ~_ge(v, hi)) << np.uint64(4 * j)
    return m


_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_BYTES = np.uint64(0x0101010101010101)
_H8 = np.uint64(0x8080808080808080)
_U2 = np.uint64(2)
_U4 = np.uint64(4)
_U7 = np.uint64(7)
_U56 = np.uint64(56)


@nb.njit(inline="always", cache=True)
def _byte_counts(x):
    """Set bits of each byte of x, per byte."""
    s = x - ((x >> _U1) & _M1)
    s = (s & _M2) + ((s >> _U2) & _M2)
    return (s + (s >> _U4)) & _M4


@nb.njit(inline="always", cache=True)
def _members_lanes(w, o, T, c):
    """Class-c membership of the block at word o in lane-major order: bit 16*l + j is element
    4*j + l. Two operations per word fewer than element order (no lane gathering), which is all
    a count needs; `_element_order` converts for a select."""
    lo = T[c]
    hi = T[c + 1]
    m = _U0
    for j in range(BLOCK_WORDS):
        v = (w[o + j] & _LOW) | _H
        m |= (_ge(v, lo) & ~_ge(v, hi)) >> np.uint64(15 - j)
    return m


@nb.njit(inline="always", cache=True)
def _before_lanes(at):
    """Lane-major mask of the block's elements before element `at`."""
    j = np.uint64(at >> 2)
    lane = np.uint64(at & 3)
    return (((_U1 << j) - _U1) * _ONE) | (((_U1 << (np.uint64(16) * lane)) - _U1) & (_ONE << j))


_EVERY4 = np.uint64(0x1111111111111111)


@nb.njit(inline="always", cache=True)
def _element_order(m):
    """Lane-major mask (bit 16*l + j) to element order (bit 4*j + l): four PDEPs."""
    out = _U0
    for lane in range(4):
        out |= _pdep((m >> np.uint64(16 * lane)) & _LANE, _EVERY4 << np.uint64(lane))
    return out


@nb.njit(inline="always", cache=True)
def _members_pdep(w, o, T, c):
    return _element_order(_members_lanes(w, o, T, c))




@nb.njit(inline="always", cache=True)
def _popcount(x):
    return np.int64((_byte_counts(x) * _BYTES) >> _U56)


def _select_in_byte_table() -> np.ndarray:
    t = np.zeros((8, 256), np.uint8)
    for v in range(256):
        bits = [i for i in range(8) if v >> i & 1]
        for r, i in enumerate(bits):
            t[r, v] = i
    return t


_SELECT_IN_BYTE = _select_in_byte_table()


def _has_bmi2() -> bool:
    """Whether this machine's compiled code may use PDEP (x86-64 BMI2, every x86 CPU since 2013)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get("bmi2", False))
    except Exception:  # noqa: BLE001 - no feature list: take the portable path
        return False


HAVE_BMI2 = _has_bmi2()


@intrinsic
def _pdep(typingctx, src, mask):
    """PDEP: the low bits of src deposited, in order, at the set bits of mask (one instruction)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64")
        return builder.call(fn, list(args))

    return sig, codegen


@nb.njit(inline="always", cache=True)
def _select_pdep(x, r):
    return np.int64(trailing_zeros(_pdep(_U1 << np.uint64(r), x)))


@nb.njit(inline="always", cache=True)
def _select_broadword(x, r):
    """Index of the set bit of x with r set bits below it (0 <= r < popcount(x)), without a loop:
    byte prefix counts locate the byte, a table the bit (broadword select)."""
    prefix = _byte_counts(x) * _BYTES  # byte i: set bits in bytes 0..i
    below = (((np.uint64(r) * _BYTES) | _H8) - prefix) & _H8  # bytes whose prefix <= r
    byte = np.int64(((below >> _U7) * _BYTES) >> _U56)
    before = np.int64(((prefix << np.uint64(8)) >> np.uint64(8 * byte)) & np.uint64(0xFF))
    in_byte = np.int64((x >> np.uint64(8 * byte)) & np.uint64(0xFF))
    return 8 * byte + np.int64(_SELECT_IN_BYTE[r - before, in_byte])




# Where the CPU has PDEP: the set bit of x with r set bits below it in one instruction, and the
# membership mask built lane-major then reordered (~1/3 cheaper than gathering lanes per word).
# Elsewhere the portable forms. Both are tested wherever BMI2 exists.
_select = _select_pdep if HAVE_BMI2 else _select_broadword
_members_ordered = _members_pdep if HAVE_BMI2 else _members


# ---------------------------------------------------------------- encoder side

@nb.njit(cache=True, nogil=True)
def sample_stats(b, t, stride):
    """(elements, changes) per exponent among 1/stride of the elements: runs of 64 consecutive
    elements every 64 * stride (a run costs two cache lines, where lone elements cost one each).
    Four interleaved histograms, so neighbours of one exponent do not wait on each other's stores."""
    n4 = np.zeros(4 * 256, np.int64)
    k4 = np.zeros(4 * 256, np.int64)
    for start in range(0, b.size, 64 * stride):
        stop = min(start + 64, b.size)
        for i in range(start, stop):
            cell = ((i & 3) << 8) | ((np.int64(b[i]) >> KEY_SHIFT) & 0xFF)
            n4[cell] += 1
            k4[cell] += np.int64(b[i] != t[i])
    return n4.reshape(4, 256).sum(axis=0), k4.reshape(4, 256).sum(axis=0)


@nb.njit(cache=True, nogil=True)
def choose_classes(n_e, k_e, max_classes):
    """Thresholds (exponents where a class starts, class 0 excluded) of the partition of the
    exponent axis into at most max_classes intervals with the least estimated mask cost.

    Cost of an interval holding N elements and K changes: N * h(K / N) bits (order-0 entropy)
    plus CLASS_OVERHEAD_BITS. Only exponents that occur are boundaries."""
    present = np.empty(256, np.int64)
    m = 0
    for e in range(256):
        if n_e[e] > 0 or k_e[e] > 0:
            present[m] = e
            m += 1
    if m <= 1:
        return np.empty(0, np.int64)
    cn = np.zeros(m + 1)
    ck = np.zeros(m + 1)
    for i in range(m):
        e = present[i]
        cn[i + 1] = cn[i] + max(n_e[e], k_e[e])
        ck[i + 1] = ck[i] + k_e[e]
    # cost[i, j]: interval of present exponents i..j-1
    cost = np.zeros((m + 1, m + 1))
    for i in range(m):
        for j in range(i + 1, m + 1):
            nn = cn[j] - cn[i]
            kk = ck[j] - ck[i]
            c = CLASS_OVERHEAD_BITS
            if 0 < kk < nn:
                p = kk / nn
                c += -nn * (p * np.log2(p) + (1 - p) * np.log2(1 - p))
            cost[i, j] = c
    kmax = min(max_classes, m)
    best = np.full((kmax + 1, m + 1), np.inf)
    arg = np.zeros((kmax + 1, m + 1), np.int64)
    best[0, 0] = 0.0
    for c in range(1, kmax + 1):
        for j in range(1, m + 1):
            for i in range(c - 1, j):
                v = best[c - 1, i] + cost[i, j]
                if v < best[c, j]:
                    best[c, j] = v
                    arg[c, j] = i
    bc = 1
    for c in range(2, kmax + 1):
        if best[c, m] < best[bc, m]:
            bc = c
    cuts = np.empty(bc - 1, np.int64)
    j = m
    for c in range(bc, 1, -1):
        i = arg[c, j]
        cuts[c - 2] = present[i]
        j = i
    return cuts


@nb.njit(inline="always", cache=True)
def ordered(v):
    """BF16 bits to an integer whose order is the values' order (ord(x) = ~x for negatives,
    x ^ 0x8000 otherwise). Branch-free: the sign is a coin flip, a branch would mispredict."""
    return v ^ (0x8000 | ((v >> 15) * 0x7FFF))


@nb.njit(inline="always", cache=True)
def unordered(o):
    return o ^ (0xFFFF - ((o >> 15) * 0x7FFF))


@nb.njit(inline="always", cache=True)
def _zigzag(bv, tv):
    """Signed ULP step s != 0 from bv to tv, zigzagged: 2s - 2 for s > 0, -2s - 1 for s < 0."""
    s = ordered(tv) - ordered(bv)
    return ((s << 1) ^ (s >> 63)) - 2 + ((s >> 62) & 2)


@nb.njit(inline="always", cache=True)
def unzigzag(u):
    """The step s of a zigzagged u (the inverse of _zigzag), branch-free."""
    neg = -(u & 1)
    return (((u >> 1) + 1) ^ neg) - neg


@nb.njit(cache=True, nogil=True)
def _scan_changes(bw, tw, T, lut, cap):
    """One pass: class sizes, and every change's position, exponent, class, rank, zigzag step.
    Buffers hold `cap` changes (growing them in the loop costs 5x); a count k > cap means retry."""
    pos = np.empty(cap, np.int64)
    keys = np.empty(cap, np.uint8)
    cls = np.empty(cap, np.uint8)
    rank = np.empty(cap, np.int64)
    zig = np.empty(cap, np.int64)
    pre = np.zeros(MAX_CLASSES, np.int64)
    cnt = np.zeros(MAX_CLASSES, np.int64)
    changes = np.zeros(MAX_CLASSES, np.int64)
    k = 0
    for blk in range(bw.size // BLOCK_WORDS):
        o = blk * BLOCK_WORDS
        d = _U0
        for j in range(BLOCK_WORDS):
            d |= bw[o + j] ^ tw[o + j]
        if d != _U0:
            # the block's changed elements as one 64-bit mask: one loop over changes, not a
            # data-dependent branch per word
            changed = _U0
            for j in range(BLOCK_WORDS):
                changed |= _lane_bits(_nonzero_lanes(bw[o + j] ^ tw[o + j])) << np.uint64(4 * j)
            while changed != _U0:
                at = np.int64(trailing_zeros(changed))  # element within the block
                changed &= changed - _U1
                if k < cap:
                    sh = np.uint64(16 * (at & 3))
                    bv = np.int64((bw[o + (at >> 2)] >> sh) & _LANE)
                    tv = np.int64((tw[o + (at >> 2)] >> sh) & _LANE)
                    e = (bv >> KEY_SHIFT) & 0xFF
                    c = np.int64(lut[e])
                    pos[k] = 4 * o + at
                    keys[k] = e
                    cls[k] = c
                    changes[c] += 1
                    rank[k] = pre[c] + _popcount(_members_lanes(bw, o, T, c) & _before_lanes(at))
                    zig[k] = _zigzag(bv, tv)
                k += 1
        _block_counts(bw, o, T, cnt)
        for c in range(MAX_CLASSES):
            pre[c] += cnt[c]
    return pos, keys, cls, rank, zig, pre, changes, k


@nb.njit(cache=True, nogil=True)
def _analyze(b, t, bw, tw, stride, cap, thresholds, choose):
    if choose:
        n_e, k_e = sample_stats(b, t, stride)
        thresholds = np.empty(0, np.int64)
        if k_e.sum() > 0:
            thresholds = choose_classes(n_e * stride, k_e * stride, MAX_CLASSES)
    out = _scan_changes(bw, tw, swar_thresholds(thresholds), class_lut(thresholds), cap)
    return (thresholds,) + out


def analyze(b: np.ndarray, t: np.ndarray, thresholds: np.ndarray | None = None):
    """(thresholds, positions, exponents, classes, ranks, zigzag steps, elements per class, changes
    per class) of two flat uint16 arrays: classes chosen from a sample (or the given thresholds),
    then one scan. One compiled call (a call costs microseconds, and a model has ~100 small tensors)."""
    bw, tw = block_words(b), block_words(t)
    choose = thresholds is None
    given = np.empty(0, np.int64) if choose else np.asarray(thresholds, np.int64)
    cap = max(1024, b.size // 16)
    out = _analyze(b, t, bw, tw, sample_stride(b.size), cap, given, choose)
    if out[-1] > cap:
        out = _analyze(b, t, bw, tw, sample_stride(b.size), out[-1], given, choose)
    thresholds, pos, keys, cls, rank, zig, sizes, changes, k = out
    sizes[0] -= 4 * bw.size - b.size  # the padding is class 0
    return thresholds, pos[:k], keys[:k], cls[:k], rank[:k], zig[:k], sizes, changes


# ---------------------------------------------------------------- decoder side

@nb.njit(cache=True, nogil=True)
def positions(n, bw, T, ranks_, first, expected, copy_to):
    """Positions of the changes, in tensor order, from each class's ranks
    (class c's ranks are ranks_[first[c]:first[c + 1]], strictly increasing).

    Block by block: count the block's classes (SWAR); one comparison per class of its next rank
    with its running count gives a bit mask of the classes with a change in this block (no
    branch per class: a per-class walk mispredicted about once per change); for those, select
    each change's bit in the class's membership mask. Returns (positions, status): status 0, or
    2 when a rank lies beyond its class's elements. When copy_to (words, like bw) is not empty,
    the base is copied into it on the way, while the block is in L1: the decoder's output
    without a second pass over the base."""
    nblocks = bw.size // BLOCK_WORDS
    copying = copy_to.size > 0
    cnt = np.zeros(MAX_CLASSES, np.int64)
    nxt = first[:MAX_CLASSES].copy()  # index of each class's next change
    seen = np.zeros(MAX_CLASSES, np.int64)  # class elements before the current block
    target = np.full(MAX_CLASSES, _FAR, np.int64)  # rank of each class's next change
    for c in range(MAX_CLASSES):
        if first[c] < first[c + 1]:
            target[c] = ranks_[first[c]]
    out = np.empty(expected, np.int64)
    k = 0
    for blk in range(nblocks):
        o = blk * BLOCK_WORDS
        _block_counts(bw, o, T, cnt)
        if copying:
            for j in range(BLOCK_WORDS):
                copy_to[o + j] = bw[o + j]
        hit = 0
        for c in range(MAX_CLASSES):
            hit |= np.int64(target[c] < seen[c] + cnt[c]) << c
        if hit != 0:
            found = _U0
            while hit != 0:
                c = np.int64(trailing_zeros(np.uint64(hit)))
                hit &= hit - 1
                m = _members_ordered(bw, o, T, c)
                s = seen[c]
                t = target[c]
                j = nxt[c]
                end = first[c + 1]
                while t < s + cnt[c]:
                    found |= _U1 << np.uint64(_select(m, t - s))
                    j += 1
                    t = ranks_[j] if j < end else _FAR
                nxt[c] = j
                target[c] = t
            while found != _U0:
                q = blk * BLOCK + np.int64(trailing_zeros(found))
                if q >= n or k >= expected:  # a rank in the padding
                    return out, 2
                out[k] = q
                k += 1
                found &= found - _U1
        for c in range(MAX_CLASSES):
            seen[c] += cnt[c]
    for c in range(MAX_CLASSES):
        if nxt[c] != first[c + 1]:
            return out, 2
    return out, 0
