"""Exponent classes: the mask's contexts, and the scans that map positions to ranks and back.

An element's class is the number of class thresholds at or below its exponent ((bits >> 7) & 0xFF),
so a tensor's classes are at most 8 intervals of the exponent axis. Intervals, because the chance
that a BF16 element changes falls monotonically with its exponent (ulp doubles per binade); at
most 8, because the scans then describe a block of 64 elements by 7 masks: bit i of mask c is set
where element i's exponent reaches class c. The block's 64 exponents are one vector of bytes,
and each mask one vector comparison (`_block_masks`: numba intrinsics emitting LLVM vector IR,
one AVX-512 instruction per mask here; LLVM lowers the same IR for AVX2, SSE or NEON). So a
block's class counts are popcounts, and class c's members are `ge[c] & ~ge[c + 1]` in element
order, ready for a rank (popcount below a bit) or a deposit (PDEP).

- `sample_stats`: exponents (and changes) of a sample of elements, to choose classes from.
- `choose_classes`: thresholds minimising the order-0 cost of the mask (an exact DP over exponents).
- `analyze` (encoder): every change with its exponent, class, rank in its class and step.
- `positions` (decoder): the inverse, from every class's changes as a bitmap over its elements.
- Column votes (v4's value context, docs/FORMAT.md): each change's vote symbol, made by the
  encoder's scan part by part from the positions it records (`_part_votes`).
"""

from __future__ import annotations

import platform
from typing import Any

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros
from codec._intrinsic import typed_intrinsic

from .. import hashing, rans
from ..hashing import hash_digest, hash_reset, hash_update

MAX_CLASSES = 8
KEY_SHIFT = 7
SAMPLE_BITS = 14  # a tensor of n elements samples 1 in max(1, n >> 14) of its elements
SAMPLE_AHEAD = 8  # runs `sample_stats` prefetches ahead of the one it counts
CLASS_OVERHEAD_BITS = 24.0  # a threshold, a level and a change count in the params

BLOCK = 64  # elements per block: one bit each in a 64-bit mask
_FAR = 1 << 62
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@nb.njit(cache=True, nogil=True)
def sample_stride(n):
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


def blocks(a: np.ndarray) -> np.ndarray:
    """A flat uint16 array in whole blocks of 64 elements: itself when its size is a multiple of
    64 (every tensor of usual models); otherwise a copy padded with +0.0, which is class 0
    (thresholds start at 1) and lies after every real element, so it changes no rank of a real one."""
    if a.size % BLOCK == 0:
        return a
    padded = np.zeros(-(-a.size // BLOCK) * BLOCK, np.uint16)
    padded[: a.size] = a
    return padded


# ---------------------------------------------------------------- vector masks, bit tricks

_LANES = ir.VectorType(ir.IntType(16), BLOCK)
_EXPONENTS = ir.VectorType(ir.IntType(8), BLOCK)
_PREFETCH = 2048  # elements (4 KiB) ahead: measured 2x on the mask scan over tensors larger than L2


def _check_u16(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.uint16 and arr.ndim == 1 and arr.layout == "C"


def _block_vector(context, builder, aryty, ary, off, prefetch=False):
    """The 64 uint16 lanes arr[off:off + 64] as one LLVM vector (an unaligned load; the caller
    guarantees off + 64 <= arr.size), optionally prefetching _PREFETCH elements ahead (a hint:
    it never faults, even past the array's end)."""
    data = context.make_array(aryty)(context, builder, value=ary).data
    if prefetch:
        _emit_prefetch(builder, data, builder.add(off, ir.Constant(off.type, _PREFETCH)))
    ptr = builder.bitcast(builder.gep(data, [off]), _LANES.as_pointer())
    return builder.load(ptr, align=2)


def _emit_prefetch(builder, data, off):
    """A read prefetch of the cache line holding data[off] (llvm.prefetch: never faults)."""
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(builder.gep(data, [off]), ir.IntType(8).as_pointer()), ir.Constant(i32, 0),
                      ir.Constant(i32, 3), ir.Constant(i32, 1)])


@typed_intrinsic
def _prefetch_block(typingctx, arr, off):
    """Prefetch arr[off:off + 64] (two cache lines) for a later `_differ` or `_block_masks`:
    for reads that hop farther than the hardware prefetcher follows."""
    if not _check_u16(arr):
        return None
    sig = types.none(arr, types.intp)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        off = args[1]
        _emit_prefetch(builder, data, off)
        _emit_prefetch(builder, data, builder.add(off, ir.Constant(off.type, 32)))
        return context.get_dummy_value()

    return sig, codegen


@typed_intrinsic
def _block_masks(typingctx, arr, off, lanes, ge):
    """ge[c] for c = 1..7: the mask of arr[off:off + 64] whose exponents reach class c's lower
    bound, i.e. exceed lanes[64 * (c - 1)] (`lane_bounds`; 255 for a class past the tensor's
    last: an empty mask). ge[0] (all ones) and ge[8] (zero) are the caller's, so class c's
    members are ge[c] & ~ge[c + 1].

    The 64 exponents are narrowed to bytes once (one vector of 64 lanes), then compared seven
    times: on AVX-512 each comparison is one instruction giving the 64-bit mask. (Seven separate
    16-bit comparisons cost 1.5x; without the prefetch, tensors larger than L2 cost 2x.)"""
    if not (_check_u16(arr) and isinstance(lanes, types.Array) and lanes.dtype == types.uint8
            and isinstance(ge, types.Array) and ge.dtype == types.uint64):
        return None
    sig = types.none(arr, types.intp, lanes, ge)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        x = _block_vector(context, builder, signature.args[0], args[0], args[1], prefetch=True)
        x = builder.lshr(builder.and_(x, ir.Constant(_LANES, [0x7FFF] * BLOCK)),
                         ir.Constant(_LANES, [KEY_SHIFT] * BLOCK))
        exponents = builder.trunc(x, _EXPONENTS)
        ld = context.make_array(signature.args[2])(context, builder, value=args[2]).data
        gd = context.make_array(signature.args[3])(context, builder, value=args[3]).data
        for c in range(1, MAX_CLASSES):
            below = builder.load(builder.bitcast(builder.gep(ld, [ir.Constant(i64, BLOCK * (c - 1))]),
                                                 _EXPONENTS.as_pointer()), align=1)
            mask = builder.bitcast(builder.icmp_unsigned(">", exponents, below), i64)
            builder.store(mask, builder.gep(gd, [ir.Constant(i64, c)]))
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(cache=True, nogil=True)
def lane_bounds(thresholds):
    """`_block_masks`' bounds: for classes 1..7, the largest exponent below the class (its
    threshold - 1; thresholds start at 1), or 255 for a class the tensor lacks, in 64 byte lanes."""
    lanes = np.full((MAX_CLASSES - 1) * BLOCK, 255, np.uint8)
    for c in range(min(thresholds.size, MAX_CLASSES - 1)):
        lanes[c * BLOCK: (c + 1) * BLOCK] = thresholds[c] - 1
    return lanes


@typed_intrinsic
def _differ(typingctx, a, b, off):
    """64-bit mask of the elements of a[off:off + 64] and b[off:off + 64] that differ."""
    if not (_check_u16(a) and _check_u16(b)):
        return None
    sig = types.uint64(a, b, types.intp)

    def codegen(context, builder, signature, args):
        va = _block_vector(context, builder, signature.args[0], args[0], args[2])
        vb = _block_vector(context, builder, signature.args[1], args[1], args[2], prefetch=True)
        return builder.bitcast(builder.icmp_unsigned("!=", va, vb), ir.IntType(64))

    return sig, codegen


@typed_intrinsic
def _copy_block(typingctx, dst, src, off):
    """dst[off:off + 64] = src[off:off + 64] as one vector load and store (an element loop
    would be scalar: LLVM cannot rule out that the arrays overlap)."""
    if not (_check_u16(dst) and _check_u16(src)):
        return None
    sig = types.none(dst, src, types.intp)

    def codegen(context, builder, signature, args):
        v = _block_vector(context, builder, signature.args[1], args[1], args[2])
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        builder.store(v, builder.bitcast(builder.gep(data, [args[2]]), _LANES.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


@typed_intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (llvm.ctpop: one POPCNT where the CPU has it)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.ctpop.i64")
        return builder.call(fn, [args[0]])

    return sig, codegen


@typed_intrinsic
def _funnel_right(typingctx, hi, lo, shift):
    """The 64 bits of hi:lo starting at bit (shift mod 64) of lo (llvm.fshr: one SHRD): a window
    of a bitmap that straddles two words."""
    sig = types.uint64(types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fshr.i64")
        return builder.call(fn, list(args))

    return sig, codegen


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


@typed_intrinsic
def _pdep(typingctx, src, mask):
    """PDEP: the low bits of src deposited, in order, at the set bits of mask (one instruction)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64")
        return builder.call(fn, list(args))

    return sig, codegen


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




@nb.njit(inline="always", cache=True)
def _deposit_pdep(bits, m):
    return _pdep(bits, m)


@nb.njit(inline="always", cache=True)
def _deposit_broadword(bits, m):
    """PDEP without BMI2: the low popcount(m) bits of `bits` placed at m's set bits, one select
    per set bit (the set bits are the changes: few)."""
    cnt = _popcount(m)
    if cnt < 64:
        bits &= (_U1 << np.uint64(cnt)) - _U1
    out = _U0
    while bits != _U0:
        out |= _U1 << np.uint64(_select_broadword(m, np.int64(trailing_zeros(bits))))
        bits &= bits - _U1
    return out


# Where the CPU has PDEP, a deposit is one instruction; elsewhere the broadword form. Both are
# tested wherever BMI2 exists.
_deposit = _deposit_pdep if HAVE_BMI2 else _deposit_broadword


# ---------------------------------------------------------------- encoder side

@nb.njit(cache=True, nogil=True)
def sample_stats(b, t, stride):
    """(elements, changes) per exponent among 1/stride of the elements: runs of 64 consecutive
    elements every 64 * stride (a run costs two cache lines per array, where lone elements cost
    one each), prefetched SAMPLE_AHEAD runs ahead: the runs lie farther apart than the hardware
    prefetcher follows, and waiting on memory was most of the sampling's time. A run's changes
    are found by one vector compare."""
    n4 = np.zeros(4 * 256, np.int64)  # four interleaved histograms: neighbours do not wait on each other
    k = np.zeros(256, np.int64)
    hop = 64 * stride
    for start in range(0, b.size, hop):
        stop = min(start + 64, b.size)
        _prefetch_block(b, start + SAMPLE_AHEAD * hop)
        _prefetch_block(t, start + SAMPLE_AHEAD * hop)
        for i in range(start, stop):  # unsigned indices: no wraparound code
            n4[np.uint64(((i & 3) << 8) | ((np.int64(b[np.uint64(i)]) >> KEY_SHIFT) & 0xFF))] += 1
        if stop - start == 64:
            changed = _differ(b, t, start)
            while changed != _U0:
                i = np.uint64(start) + np.uint64(trailing_zeros(changed))
                changed &= changed - _U1
                k[np.uint64((np.int64(b[i]) >> KEY_SHIFT) & 0xFF)] += 1
        else:
            for i in range(start, stop):
                if b[np.uint64(i)] != t[np.uint64(i)]:
                    k[np.uint64((np.int64(b[np.uint64(i)]) >> KEY_SHIFT) & 0xFF)] += 1
    n = np.zeros(256, n4.dtype)  # the four lanes summed; not .sum(axis=0), whose axis check compiles string code
    for lane in range(4):
        for key in range(256):
            n[key] += n4[lane * 256 + key]
    return n, k


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


# ---- column votes (v4's value context; docs/FORMAT.md, "Column votes")
# Each column of a tensor keeps a saturating counter of the directions of its changes so far, in
# [-VOTE_LIMIT, VOTE_LIMIT]; a change is coded with the table of (key, |counter|), its step negated
# where the counter is negative. A vote symbol is context << 6 | token | flipped << FLIP_BIT.
VOTE_LIMIT = 4
VOTE_LEVELS = VOTE_LIMIT + 1
VALUE_SYMBOL_BITS = 6  # a value symbol is key << 6 | token
FLIP_BIT = 17
leading_zeros: Any = _leading_zeros


@nb.njit(inline="always", cache=True)
def _column(p, cols, row0):
    """(column of position p, start of its row) given the start of the row of an earlier position
    (or 0): positions rise, so a row start moves on by one row, or by a division for a jump."""
    d = p - row0
    if d >= cols:
        row0 = row0 + cols if d < 2 * cols else p - p % cols
    return p - row0, row0


@nb.njit(inline="always", cache=True)
def _vote_symbol(pair, v):
    """A change's vote symbol given its column's counter v (see VOTE_LIMIT): its step zigzagged,
    the low bit flipped where v < 0 (zigzag's low bit is the step's sign), tokenized, with the
    context key * VOTE_LEVELS + |v|. Returns (symbol, counter after the change, 1 if the step
    was down else 0)."""
    bv = np.int64(pair >> np.uint32(16))
    z = _zigzag(bv, np.int64(pair & np.uint32(0xFFFF)))
    neg = np.int64(v < 0)
    u = z ^ neg
    n = 63 - np.int64(leading_zeros(np.uint64(u | 1)))
    tok = u if u < rans.DIRECT else (rans.DIRECT + (n - 3) * (1 << rans.SUB_BITS)
                                     + ((u >> max(n - rans.SUB_BITS, 0)) & ((1 << rans.SUB_BITS) - 1)))
    ctx = ((bv >> KEY_SHIFT) & 0xFF) * VOTE_LEVELS + (v ^ -neg) + neg  # |v|, branch-free
    return np.uint32((ctx << VALUE_SYMBOL_BITS) | tok | (neg << FLIP_BIT)), vote_after(v, z), z & 1


@nb.njit(inline="always", cache=True)
def vote_after(v, z):
    """A column's counter v (in [-VOTE_LIMIT, VOTE_LIMIT]) after a change of zigzagged step z (z
    even: the step was up). Branch-free: min/max compiled to branches that mispredict on every
    other change (a column's direction is a coin flip across columns), 2.4x the vote loop's time."""
    w = v + 1 - 2 * (z & 1)
    return w - np.int64(w > VOTE_LIMIT) + np.int64(w < -VOTE_LIMIT)


# The encoder stops making a tensor's vote symbols once its columns clearly do not lean: after at
# least EARLY_VOTED changes met a counter, fewer than EARLY_AGREEMENT of them moved its way (the
# final rule, `conditional._settle`, asks 0.6 of all of them). On MiniLM the dense layers sit at
# 0.46-0.52 within their first few thousand changes, the embedding at 0.86-0.94: the payloads are
# byte for byte those of deciding on every change (28 of wd's 102 other tensors stop early; with
# the tally, the scan went 16.8 -> 16.1 ms and settling 2.2 -> 0.9 ms). Encoder policy, not format.
EARLY_VOTED = 2048
EARLY_AGREEMENT = 0.55


@nb.njit(cache=True, nogil=True)
def vote_symbols_into(pairs, positions, cols, out):
    """The vote symbols (`_vote_symbol`) of one tensor's changes, in tensor order, given their
    positions and the tensor's columns, into out[:pairs.size]: `_part_votes` of one part.
    Returns its tally (`_part_votes`)."""
    tally = np.zeros(3, np.int64)
    _part_votes(0, positions, cols, np.zeros(cols, np.int8), np.int64(0), pairs, 0, pairs.size, out, tally)
    return tally


@nb.njit(cache=True, nogil=True)
def _part_votes(o0, offs, cols, votes, row0, pairs, k0, k1, out, tally):
    """The vote symbols of the changes the scan just stored as pairs[k0:k1], at positions
    o0 + offs[:k1 - k0] (`_scan_range` records them for a scan making votes), into out[k0:k1],
    in the same pass over the tensors (a second pass re-reading them made v4's encode 1.3x
    v3's time; finding the changes again in the cached part, 1.25x). `votes` (the columns'
    counters) and row0 (the current row's start) carry on across parts, and so does the tally,
    [changes that met a counter, those that moved its way, _]: what the still rule reads
    (counting here, not in a pass of its own, saves ~2 ns per change). Returns row0."""
    voted = tally[0]
    agreed = tally[1]
    for j in range(k0, k1):
        p = o0 + np.int64(offs[j - k0])
        col, row0 = _column(p, cols, row0)
        c = np.uint64(col)
        v = np.int64(votes[c])
        out[j], after, down = _vote_symbol(pairs[j], v)
        votes[c] = after
        met = np.int64(v != 0)  # branch-free: whether a change meets a counter is a coin flip
        voted += met
        agreed += met & (np.int64(v > 0) ^ down)
    tally[0] = voted
    tally[1] = agreed
    return row0


# Spare entries after the change buffers' capacity (`_scan_buffers`): a block's first two
# changes are stored whether or not it has that many (see `_scan_range`).
SCAN_SLACK = 2
_63 = np.uint64(63)


@nb.njit(inline="always", cache=True)
def _store_change(b, t, o, changed, lut, ge, seen, pairs, cls, rank, j):
    """The change at the lowest set bit of `changed` (a block's mask; 0 stores element 63, a
    harmless stand-in) stored at index j: its pair, class and rank in its class."""
    at = min(np.uint64(trailing_zeros(changed)), _63)  # element within the block
    i = np.uint64(o) + at  # indices unsigned: numba then emits no wraparound code
    bv = np.uint32(b[i])
    c = np.uint64(lut[np.uint64(bv >> np.uint32(KEY_SHIFT)) & np.uint64(0xFF)])
    pairs[j] = (bv << np.uint32(16)) | np.uint32(t[i])
    cls[j] = c
    rank[j] = seen[c] - seen[c + _U1] + _popcount(ge[c] & ~ge[c + _U1] & ((_U1 << at) - _U1))


@nb.njit(cache=True, nogil=True)
def _scan_range(b, t, origin, o0, o1, lanes, lut, ge, seen, k, pairs, cls, rank, offs):
    """Blocks [o0, o1) of b and t (whole blocks, `blocks`), of a tensor starting at `origin`:
    every change's (base, target) pair (base << 16 | target), class and rank in its class, stored
    from index k while the buffers last (`_scan_buffers`: their size less SCAN_SLACK). Returns
    the new count; beyond the buffers' capacity (whose every entry then holds a change), retry
    with larger ones. Resumable: ge (class masks, ge[0] all ones) and seen (elements at or above
    each class's bound before the block) carry on to the next range. Where `offs` is not empty
    (a scan making vote symbols), change k + i's position less o0 goes to offs[i] too: room
    for every element of the range and SCAN_SLACK.

    Only what the coder needs, 13 bytes per change: positions, exponents and steps follow from
    these (storing them too cost ~30% more time, in stores and in the buffers' page faults). A
    block's first two changes are stored unconditionally (into the slack when it has fewer):
    a loop over each block's changes mispredicts its exit about once a block (measured: the
    scan 0.94x the time at 3% changed)."""
    cap = pairs.size - SCAN_SLACK
    recording = offs.size > 0
    k0 = np.uint64(k)
    for o in range(o0, o1, BLOCK):
        seen[0] = o - origin
        _block_masks(b, o, lanes, ge)
        changed = _differ(b, t, o)
        count = _popcount(changed)
        if k + count <= cap:
            j = np.uint64(k)
            for _ in range(SCAN_SLACK):
                _store_change(b, t, o, changed, lut, ge, seen, pairs, cls, rank, j)
                if recording:
                    offs[j - k0] = np.uint64(o - o0) + min(np.uint64(trailing_zeros(changed)), _63)
                changed &= changed - _U1
                j += _U1
            while changed != _U0:
                _store_change(b, t, o, changed, lut, ge, seen, pairs, cls, rank, j)
                if recording:
                    offs[j - k0] = np.uint64(o - o0) + np.uint64(trailing_zeros(changed))
                changed &= changed - _U1
                j += _U1
        else:  # the buffers run out in this block: store what fits (callers read up to cap)
            for j in range(k, min(k + count, cap)):
                _store_change(b, t, o, changed, lut, ge, seen, pairs, cls, rank, np.uint64(j))
                changed &= changed - _U1
        k += count
        for c in range(1, MAX_CLASSES):  # a fixed count unrolls; absent classes' masks are empty
            seen[c] += _popcount(ge[c])
    return k


@nb.njit(cache=True, nogil=True)
def _scan_buffers(cap):
    """Change buffers for `cap` changes (and the scan's slack)."""
    n = cap + SCAN_SLACK
    return np.empty(n, np.uint32), np.empty(n, np.uint8), np.empty(n, np.int64)


@nb.njit(cache=True, nogil=True)
def _scan_state():
    ge = np.zeros(MAX_CLASSES + 1, np.uint64)
    ge[0] = _ALL
    return ge, np.zeros(MAX_CLASSES + 1, np.int64)


@nb.njit(cache=True, nogil=True)
def _class_totals(cls, k0, k1, seen, total):
    """(elements, changes) per class of a tensor whose changes are cls[k0:k1], once the scan has
    seen its `total` elements."""
    changes = np.zeros(MAX_CLASSES, np.int64)
    for j in range(k0, k1):
        changes[np.uint64(cls[j])] += 1
    seen[0] = total
    sizes = np.empty(MAX_CLASSES, np.int64)
    for c in range(MAX_CLASSES):
        sizes[c] = seen[c] - seen[c + 1]
    return sizes, changes


@nb.njit(cache=True, nogil=True)
def _chosen(b, t, stride):
    """Thresholds chosen from every stride-th element's (exponent, changed) statistics."""
    n_e, k_e = sample_stats(b, t, stride)
    if k_e.sum() == 0:
        return np.empty(0, np.int64)
    return choose_classes(n_e * stride, k_e * stride, MAX_CLASSES)


# Elements scanned between two feeds of the digests (`_analyze`): 32 KiB of each array, which the
# hash then reads from L1 or L2 rather than from memory.
HASH_PART = 1 << 14


@nb.njit(cache=True, nogil=True)
def _grown(a, keep, cap):
    out = np.empty(cap, a.dtype)
    for i in range(keep):  # a loop, not a slice assignment (codec/_warmup.py says why)
        out[i] = a[i]
    return out


@typed_intrinsic
def _u16_at(typingctx, address):
    """The uint16 pointer at an integer address, for `nb.carray` (`_analyze`'s tensors)."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.uint16)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(16).as_pointer())

    return sig, codegen


@nb.njit(cache=True, nogil=True)
def _analyze(where, sizes, given, ngiven, choose, headers, hoff, hash_base, functions, states, cols, pairs, cls, rank,
             votes):
    """Classes and one whole scan of every tensor of a batch, in one compiled call (a call costs
    microseconds, a Python wrapper tens, and a model has ~100 tensors). Tensor i's base and
    target elements are at addresses where[i] (sizes[i] of them, readable up to a whole block).

    Each tensor's scan runs HASH_PART elements at a time: after each part, when `functions`
    (`hashing.NATIVE.functions()`) is not empty, base and target digests (the two XXH3 states
    at `states`, reset per tensor and fed its header, headers[hoff[i]:hoff[i + 1]]) are fed
    that part while it is in cache; the base only where hash_base[i] (a caller that knows the
    base's digest saves ~13% of the scan: that row's base halves stay 0). Buffers that run out
    in a part grow, and the part is scanned again (hashed once, after). Every tensor's changes
    go to the same buffers, back to back, from the start of the change buffers pairs, cls and
    rank (`_scan_buffers`), which grow if they run out. With `cols` not empty (tensor i's
    columns, cols[i]), each part's changes also get their vote symbols (`_part_votes`) in
    `votes`, a buffer like pairs, and each tensor's tally (`_part_votes`) in its row of `tally`,
    until its columns clearly do not lean (EARLY_VOTED): then its third entry is 1, and the rest
    of its vote symbols are not made (the still rule rewrites them all). Returns (the buffers,
    grown or not, votes last; first change of each tensor and the end; thresholds (row i:
    thresholds[i, :nthr[i]]), nthr, class sizes, class changes, digests (row i: low and high
    halves of the base's, then of the target's), tally)."""
    hashing = functions.size > 0
    voting = cols.size > 0
    offs = np.empty(HASH_PART + SCAN_SLACK if voting else 0, np.uint16)  # a part's change positions
    m = sizes.size
    first = np.zeros(m + 1, np.int64)
    thr = np.zeros((m, MAX_CLASSES - 1), np.int64)
    nthr = np.zeros(m, np.int64)
    class_sizes = np.zeros((m, MAX_CLASSES), np.int64)
    class_changes = np.zeros((m, MAX_CLASSES), np.int64)
    digests = np.zeros((m, 4), np.uint64)
    tally = np.zeros((m, 3), np.int64)  # per tensor: `_part_votes`'s, and 1 where its votes stopped early
    quiet = offs[:0]
    saved = np.empty(MAX_CLASSES + 1, np.int64)
    k = 0
    for i in range(m):
        n = sizes[i]
        padded = -(-n // BLOCK) * BLOCK
        bb = nb.carray(_u16_at(where[i, 0]), padded)
        tb = nb.carray(_u16_at(where[i, 1]), padded)
        if choose:
            thresholds = _chosen(bb[:n], tb[:n], sample_stride(n))
        else:
            thresholds = given[i, :ngiven[i]].copy()
        nthr[i] = thresholds.size
        for j in range(thresholds.size):  # loops, not slice assignments (codec/_warmup.py says why)
            thr[i, j] = thresholds[j]
        lanes, lut = lane_bounds(thresholds), class_lut(thresholds)
        ge, seen = _scan_state()
        first[i] = k
        counters = np.zeros(cols[i] if voting else 0, np.int8)
        row0 = np.int64(0)
        base_too = hashing and hash_base[i] != 0
        if hashing:
            for h in range(0 if base_too else 1, 2):
                hash_reset(functions[0], states[h])
                hash_update(functions[1], states[h], headers, hoff[i], hoff[i + 1])
        for o in range(0, padded, HASH_PART):
            stop = min(o + HASH_PART, padded)
            before = k
            for j in range(saved.size):
                saved[j] = seen[j]
            voting_here = voting and tally[i, 2] == 0
            record = offs if voting_here else quiet
            k = _scan_range(bb, tb, 0, o, stop, lanes, lut, ge, seen, before, pairs, cls, rank, record)
            if k > pairs.size - SCAN_SLACK:
                cap = max(2 * pairs.size, k) + SCAN_SLACK
                pairs, cls, rank = _grown(pairs, before, cap), _grown(cls, before, cap), _grown(rank, before, cap)
                if voting:
                    votes = _grown(votes, before, cap)
                for j in range(saved.size):
                    seen[j] = saved[j]
                k = _scan_range(bb, tb, 0, o, stop, lanes, lut, ge, seen, before, pairs, cls, rank, record)
            if voting_here:
                row0 = _part_votes(o, offs, cols[i], counters, row0, pairs, before, k, votes, tally[i])
                if tally[i, 0] >= EARLY_VOTED and tally[i, 1] < EARLY_AGREEMENT * tally[i, 0]:
                    tally[i, 2] = 1  # still for sure: the rest of its vote symbols are not made
            if hashing and o < n:
                if base_too:
                    hash_update(functions[1], states[0], bb, o, min(stop, n))
                hash_update(functions[1], states[1], tb, o, min(stop, n))
        if hashing:
            if base_too:
                digests[i, 0], digests[i, 1] = hash_digest(functions[2], states[0])
            digests[i, 2], digests[i, 3] = hash_digest(functions[2], states[1])
        tensor_sizes, tensor_changes = _class_totals(cls, first[i], k, seen, padded)
        tensor_sizes[0] -= padded - n  # the padding is class 0
        for c in range(tensor_sizes.size):  # loops, not row assignments (codec/_warmup.py says why)
            class_sizes[i, c] = tensor_sizes[c]
            class_changes[i, c] = tensor_changes[c]
    first[m] = k
    return pairs, cls, rank, votes, first, thr, nthr, class_sizes, class_changes, digests, tally



class ScanBuffers:
    """Change buffers for `analyze_at` to fill, kept from one scan to the next: fresh buffers
    cost a page fault per 4 KiB the scan writes (measured: ~3800 faults, 5 ms of system time
    per encode of MiniLM at 3% changed, a sixth of the encode). `symbols` is room for the
    changes' value symbols (`conditional.Batch`), `votes` for their vote symbols (a scan with
    columns). They grow to the largest scan and stay."""

    def __init__(self) -> None:
        self.pairs, self.classes, self.ranks = _scan_buffers(0)
        self.symbols = np.empty(0, np.uint16)
        self.votes = np.empty(0, np.uint32)

    @property
    def nbytes(self) -> int:
        return (self.pairs.nbytes + self.classes.nbytes + self.ranks.nbytes + self.symbols.nbytes
                + self.votes.nbytes)


def analyze_at(where: np.ndarray, sizes: np.ndarray, thresholds: list[np.ndarray] | None = None,
               headers: list[bytes] | None = None, buffers: ScanBuffers | None = None,
               hash_base: np.ndarray | None = None, cols: np.ndarray | None = None) -> tuple:
    """`analyze` of many tensors in one compiled call, each given by the addresses of its base and
    target elements (where[i] = (base, target), uintp): sizes[i] uint16 elements each, in
    memory readable up to the next multiple of 64 elements (`blocks`), which the caller keeps
    alive during the call. Classes are chosen per tensor from a sample, or given (`thresholds`,
    one array per tensor). With `headers` (each tensor's `hashing.header_bytes`; only where
    `hashing.KERNEL_DIGESTS`), the scan also digests every base and target, reading each part
    while in cache. Returns (pairs, classes, ranks, first, thresholds, nthr, class sizes,
    class changes, digests) as `_analyze` does, the changes as views of its buffers (those of
    `buffers` if given, which then hold any grown ones); digests is None without headers.
    `hash_base` (one flag per tensor; default all set): where 0, the base is not digested (its
    digest halves are 0), for a caller that already knows it. With `cols` (each tensor's columns),
    the changes' vote symbols too (`_part_votes`), returned after the ranks, and each tensor's
    vote tally last (`_analyze`); else None in both places."""
    sizes = np.asarray(sizes, np.int64)
    m = sizes.size
    given = np.zeros((m, MAX_CLASSES - 1), np.int64)
    ngiven = np.zeros(m, np.int64)
    if thresholds is not None:
        for i, th in enumerate(thresholds):
            ngiven[i] = len(th)
            given[i, : len(th)] = th
    digesting = hashing.KernelDigests(headers, m)
    padded = -(-sizes // BLOCK) * BLOCK
    cap = max(1024, int(padded.sum()) // 16)
    if buffers is not None and buffers.pairs.size >= cap + SCAN_SLACK:
        room = buffers.pairs, buffers.classes, buffers.ranks
    else:
        room = _scan_buffers(cap)
    flags = np.ones(m, np.uint8) if hash_base is None else np.ascontiguousarray(hash_base, np.uint8)
    if flags.size != m:
        raise ValueError(f"hash_base has {flags.size} flags for {m} tensors")
    columns = np.zeros(0, np.int64) if cols is None else np.ascontiguousarray(cols, np.int64)
    if cols is not None and columns.size != m:
        raise ValueError(f"cols has {columns.size} entries for {m} tensors")
    if cols is None:
        votes = np.empty(0, np.uint32)
    elif buffers is not None and buffers.votes.size >= room[0].size:
        votes = buffers.votes
    else:
        votes = np.empty(room[0].size, np.uint32)
    out = _analyze(np.ascontiguousarray(where, np.uintp), sizes, given, ngiven, thresholds is None, digesting.headers,
                   digesting.offsets, flags, digesting.functions, digesting.states, columns, room[0], room[1],
                   room[2], votes)
    del digesting  # frees its states
    if buffers is not None:
        buffers.pairs, buffers.classes, buffers.ranks = out[:3]
        if cols is not None:
            buffers.votes = out[3]
    k = int(out[4][-1])
    return ((out[0][:k], out[1][:k], out[2][:k], out[3][:k] if cols is not None else None) + out[4:-2]
            + ((out[-2] if headers is not None else None), (out[-1] if cols is not None else None)))


def analyze_many(bs: list[np.ndarray], ts: list[np.ndarray], thresholds: list[np.ndarray] | None = None,
                 headers: list[bytes] | None = None, cols: np.ndarray | None = None) -> tuple:
    """`analyze_at` of flat uint16 arrays (padded copies where a size is not whole blocks)."""
    keep = [blocks(np.ascontiguousarray(a).reshape(-1)) for pair in zip(bs, ts) for a in pair]
    where = np.array([a.ctypes.data for a in keep], np.uintp).reshape(-1, 2)
    return analyze_at(where, np.array([a.size for a in bs], np.int64), thresholds, headers, cols=cols)


def analyze(b: np.ndarray, t: np.ndarray, thresholds: np.ndarray | None = None):
    """(thresholds, pairs, classes, ranks, elements per class, changes per class) of two flat
    uint16 arrays, in tensor order of the changes: pair = base << 16 | target (uint32). Classes
    are chosen from a sample (or the given thresholds), then one scan."""
    pairs, cls, ranks, _, _, thr, nthr, sizes, changes, _, _ = analyze_many(
        [b], [t], None if thresholds is None else [np.asarray(thresholds, np.int64)])
    return thr[0, : nthr[0]], pairs, cls, ranks, sizes[0], changes[0]


@nb.njit(cache=True, nogil=True)
def pair_steps(pairs):
    """(exponent of the base, zigzagged ULP step) of each (base << 16 | target) pair."""
    keys = np.empty(pairs.size, np.uint8)
    zig = np.empty(pairs.size, np.int64)
    for j in range(pairs.size):
        bv = np.int64(pairs[j] >> np.uint32(16))
        keys[j] = (bv >> KEY_SHIFT) & 0xFF
        zig[j] = _zigzag(bv, np.int64(pairs[j] & np.uint32(0xFFFF)))
    return keys, zig


@nb.njit(cache=True, nogil=True)
def _differences(b, t, cap):
    out = np.empty(cap, np.int64)
    k = 0
    for o in range(0, b.size, BLOCK):
        changed = _differ(b, t, o)
        while changed != _U0:
            if k < cap:
                out[np.uint64(k)] = o + np.int64(trailing_zeros(changed))
            k += 1
            changed &= changed - _U1
    return out, k


def differences(b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Positions where two flat uint16 arrays differ (np.flatnonzero(b != t) without its
    temporary mask: one compiled pass, 64 elements per vector comparison)."""
    bb, tb = blocks(b.reshape(-1)), blocks(t.reshape(-1))
    cap = max(1024, bb.size // 16)
    out, k = _differences(bb, tb, cap)
    if k > cap:
        out, k = _differences(bb, tb, k)
    return out[:k]


# ---------------------------------------------------------------- decoder side

@nb.njit(inline="always", cache=True)
def bitmap_words(padded):
    """Capacity, in words, of the class bitmaps of a tensor of `padded` elements (whole blocks):
    every honest tensor's fit, since a class's region spans at most its elements plus 3 words."""
    return padded // BLOCK + 3 * MAX_CLASSES


@nb.njit(cache=True, nogil=True)
def rank_bitmaps(ranks_, first, padded):
    """The decoder's form of every class's changes: bit r of class c's region set where element r
    of class c changed (class c's ranks are ranks_[first[c]:first[c + 1]], increasing).

    Regions follow each other in class order; class c's holds `lim[c]` words (up to its last
    rank) and then two zero guard words, so a scan may read any window of it without a bound
    check. Returns (bits, start, lim, status); status 2 when the ranks cannot belong to a tensor
    of `padded` elements (then they overflow the capacity that every honest tensor fits in)."""
    bits = np.zeros(bitmap_words(padded), np.uint64)
    start = np.zeros(MAX_CLASSES, np.int64)
    lim = np.zeros(MAX_CLASSES, np.int64)
    at = 0
    for c in range(MAX_CLASSES):
        start[c] = at
        for j in range(first[c], first[c + 1]):
            w = at + (ranks_[j] >> 6)
            if w + 2 >= bits.size:
                return bits, start, lim, 2
            bits[w] |= _U1 << np.uint64(ranks_[j] & 63)
        if first[c] < first[c + 1]:
            lim[c] = (ranks_[first[c + 1] - 1] >> 6) + 1
        at += lim[c] + 2
        if at > bits.size:
            return bits, start, lim, 2
    return bits, start, lim, 0


@nb.njit(cache=True, nogil=True)
def scan_state(thresholds, start, lim):
    """The position scan's state, for `positions_between`: (byte lanes of the class bounds, number
    of classes, class masks of the current block, each class's next unread bit as an index into
    the bitmaps, each class's first guard word). Unsigned, so indexing needs no wraparound code."""
    lanes = lane_bounds(thresholds)
    nclass = min(thresholds.size + 1, MAX_CLASSES)
    ge = np.zeros(MAX_CLASSES + 1, np.uint64)
    ge[0] = _ALL
    at = np.empty(MAX_CLASSES, np.uint64)
    guard = np.empty(MAX_CLASSES, np.uint64)
    for c in range(MAX_CLASSES):
        at[c] = np.uint64(start[c] * 64)
        guard[c] = np.uint64(start[c] + lim[c])
    return lanes, nclass, ge, at, guard


# Spare entries past the last position `positions_between` may store: a block's first four
# positions are stored whether or not it has that many changes (see there).
POSITION_SLACK = 4


@nb.njit(cache=True, nogil=True)
def positions_between(n, b, o0, o1, lanes, nclass, ge, bits, at, guard, out, k, copy_to):
    """The changes among elements [o0, o1) (whole blocks) of the base b of n elements (in whole
    blocks, `blocks`), from the class bitmaps (`rank_bitmaps` layout), appended to out from
    out[k]; out holds POSITION_SLACK spare entries after the positions it may receive, which the
    scan may overwrite. Resumable: the scan's state (`scan_state`) carries on to the next range.

    Block by block, branch-free per class: the block's class masks (`_block_masks`) give each
    class's members m; the class's next popcount(m) bitmap bits, deposited at m's set bits (PDEP),
    are its changes in this block. The block's first four changes are stored unconditionally
    (into the slack when there are fewer) and only the rest in a loop: a loop over each block's
    changes mispredicts its exit about once a block (measured: the scan 1.25x slower at 3%
    changed). Returns (k, status): status 2 when a change falls in the padding or past out's
    end. When copy_to (as long as b) is not empty, the base is copied into it on the way, while
    the block is in L1: the decoder's output without a second pass."""
    copying = copy_to.size > 0
    expected = out.size - POSITION_SLACK
    for o in range(o0, o1, BLOCK):
        _block_masks(b, o, lanes, ge)
        if copying:
            _copy_block(copy_to, b, o)
        found = _U0
        for c in range(nclass):
            m = ge[c] & ~ge[c + 1]
            p = at[c]
            w = min(p >> np.uint64(6), guard[c])  # past the class's last change: its zero guards
            found |= _deposit(_funnel_right(bits[w + _U1], bits[w], p), m)
            at[c] = p + np.uint64(_popcount(m))
        count = _popcount(found)
        if k + count > expected:
            return k, 2
        if o + BLOCK > n and found >> np.uint64(n - o) != _U0:  # a rank in the padding
            return k, 2
        j = np.uint64(k)  # unsigned: no wraparound code
        q = np.uint64(o)
        for _ in range(POSITION_SLACK):  # unrolled; past the last change, trailing_zeros(0) = 64
            out[j] = q + np.uint64(trailing_zeros(found))
            found &= found - _U1
            j += _U1
        while found != _U0:
            out[j] = q + np.uint64(trailing_zeros(found))
            found &= found - _U1
            j += _U1
        k += count
    return k, 0


@nb.njit(cache=True, nogil=True)
def positions(n, b, thresholds, bits, start, lim, expected, copy_to):
    """Positions of the changes, in tensor order, from the class bitmaps (`rank_bitmaps` layout),
    in one scan over the base b of n elements (whole blocks, `blocks`). Returns (positions,
    status): status 0, or 2 when a class's changes lie beyond its elements (bits never
    deposited, or deposited in the padding)."""
    lanes, nclass, ge, at, guard = scan_state(thresholds, start, lim)
    out = np.empty(expected + POSITION_SLACK, np.int64)
    k, status = positions_between(n, b, 0, b.size, lanes, nclass, ge, bits, at, guard, out, 0, copy_to)
    if status == 0 and k != expected:
        status = 2
    return out[:expected], status
