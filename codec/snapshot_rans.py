"""The compressed snapshot's BF16 kernels: the exponent byte rANS-coded, sign and mantissa kept as bytes.

What was measured on all-MiniLM-L6-v2 in BF16 (`scripts/snapshot_entropy.py`): order-0
exponent entropy is 2.614 bits per element; conditioning on the previous element's exponent
gives 2.610, the sign is 1.000 bits whatever its context, and the mantissa conditioned on the
exponent 6.924 of 7 bits. So a block codes its exponents with one static order-0 table
(per block of 2**18 elements: local statistics bring 2.614 down to ~2.59) and stores
`sign << 7 | mantissa` as a plain byte plane, which a decoder copies at memory speed.

Coder: the codec's rANS conventions (`rans.py`: 64-bit state in [2**31, 2**63), 32-bit words
read from the end) with precision 2**12. Two layouts (docs/FORMAT.md, block kinds 2 and 3), and
kind 4, kind 3's layout over pairs of exponents (its own section below):

- kind 2 (snapshot v1): four interleaved states, a renormalisation check after every symbol.
- kind 3 (snapshot v2): eight states over groups of 16 elements (element j of a group uses
  state j mod 8), renormalised once per group, after both of a state's symbols. Decoding is
  bound by instruction count and by the dependency chains: each renormalisation pulls its word
  at a position the previous state's pull moved, which ties the states together, so fewer
  pulls per symbol (half) and more independent chains (eight) are what made it fast (measured
  on a 2-core EPYC: 3.4-4.2 ns per element for the kind-2 kernel as it was, 1.4-1.5 for kind 3).
  Two symbols between pulls stay exact because L / 2**24 is an integer (`encode_groups`).

The decoders look up one packed uint32 per slot (`slot - cum | symbol << 12 | freq << 20`):
a symbol costs one load, a multiply and an add, and `e >> 5` is the exponent already in its
place in the BF16 word (the bits below and above are masked off when sign and mantissa merge
in). Pulls are branch-free (a select), and all arithmetic is on uint64 so that numba emits no
negative-index wraparound code. Block headers are parsed here too (`block_head`): a Python
loop over ~40 table entries per block cost ~20% of the decode. A reader calls one kernel per
tensor (`decode_record`, at the end), which runs all of its blocks and comes back to Python
only for zstd; stream words are read from the block's bytes at any alignment (`_word`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import rans
from .hashing import DIGEST_SIZE, hash_digest, hash_reset, hash_update

SCALE = 12
STATES = 4  # kind 2
STATES_V2 = 8  # kind 3
GROUP = 2 * STATES_V2  # kind 3: elements per renormalisation
CHUNK = 1 << 12  # elements decoded before their sign and mantissa are merged (L1-sized)
MAX_FREQ = (1 << SCALE) - 1
_U = np.uint64

# block kinds and residual codecs (FORMAT.md)
KIND_RAW, KIND_ZSTD, KIND_BF16, KIND_BF16_GROUPS, KIND_BF16_PAIRS = 0, 1, 2, 3, 4
RESIDUAL_RAW, RESIDUAL_ZSTD = 0, 1

# block_head's error codes (snapshot.py words them), and the decoders' OK, BAD_STATES, CORRUPT
OK, E_TRUNCATED, E_VARINT, E_LIMIT, E_N_SYM, E_ORDER, E_FREQ_0, E_SUM, E_WORDS = range(9)
BAD_STATES, CORRUPT = 1, 2


@nb.njit(cache=True, nogil=True)
def slot_table(freq, table):
    """Fills `table` (2**SCALE uint32), the decoders' slot table for 256 frequencies summing to
    2**SCALE (each < 2**SCALE): slot `cum[s] + j` of symbol s holds `j | s << 12 | freq[s] << 20`.
    (The caller's scratch arrays, not new ones: numba rebuilds the dtype of every array it returns
    to Python by unpickling it, ~5-20 us, twice per block when block_head and this returned theirs.)"""
    at = 0
    for s in range(256):
        f = freq[s]
        for j in range(f):
            table[at + j] = np.uint32(j | (s << 12) | (f << 20))
        at += f


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


@nb.njit(inline="always", cache=True, nogil=True)
def _uvarint(body, at, limit):
    """(value, next offset, error code) of the LEB128 varint at body[at] (FORMAT.md **Varints**:
    up to 10 bytes, values above `limit` refused)."""
    value = _U(0)
    shift = 0
    while True:
        if at >= body.size:
            return value, at, E_TRUNCATED
        b = _U(body[at])
        at += 1
        if shift == 63 and (b & _U(0x7F)) > _U(0):  # a value of 2**63 or more
            return value, at, E_LIMIT
        value |= (b & _U(0x7F)) << _U(shift)
        if not b & _U(0x80):
            break
        shift += 7
        if shift > 63:
            return value, at, E_VARINT
    if value > _U(limit):
        return value, at, E_LIMIT
    return value, at, OK


HEAD_SHAPE = 8  # where record_head puts the shape in `ints` (HEAD_SIZES: the block sizes)
MAX_NAME, MAX_NDIM, MAX_NUMEL = 1 << 16, 32, 1 << 48  # a snapshot's limits (snapshot.py takes them from here)
HEAD_SIZES = HEAD_SHAPE + MAX_NDIM


@nb.njit(inline="always", cache=True, nogil=True)
def _name_dtype_shape(buf, at, itemsizes, dims, dims_at, store):
    """A name (length and bytes), a dtype code and a shape, as record heads and index entries
    both begin, from buf[at]; the shape's dims go to dims[dims_at:] if `store`. (ok, name
    offset, name length, dtype code, ndim, numel, next offset); not ok on a malformed varint,
    a limit, bytes past the end, an unknown dtype or over MAX_NUMEL elements."""
    zero = np.int64(0)
    n, at, err = _uvarint(buf, at, MAX_NAME)
    if err or at + np.int64(n) > buf.size:
        return False, zero, zero, zero, zero, zero, at
    name_at = at
    at += np.int64(n)
    if at >= buf.size:
        return False, zero, zero, zero, zero, zero, at
    code = np.int64(buf[at])
    at += 1
    if code >= itemsizes.size or itemsizes[code] == 0:
        return False, zero, zero, zero, zero, zero, at
    ndim, at, err = _uvarint(buf, at, MAX_NDIM)
    if err:
        return False, zero, zero, zero, zero, zero, at
    numel = np.int64(1)
    spanned = np.int64(1)  # the product of the non-zero dims: bounded too (an empty tensor's strides)
    for k in range(np.int64(ndim)):
        d, at, err = _uvarint(buf, at, MAX_NUMEL)
        if err:
            return False, zero, zero, zero, zero, zero, at
        dim = np.int64(d)
        if store:
            dims[dims_at + k] = dim
        if dim != 0:
            if spanned > MAX_NUMEL // dim:
                return False, zero, zero, zero, zero, zero, at
            spanned *= dim
        numel *= dim
    return True, name_at, np.int64(n), code, np.int64(ndim), numel, at


@nb.njit(cache=True, nogil=True)
def record_head(fields, itemsizes, max_block_bytes, ints):
    """A record head's fields (its checksum already checked), parsed and checked as
    `snapshot._record_head` does, into `ints` (int64, at least HEAD_SIZES + fields.size long):
    name offset and length, dtype code, ndim, block elements, block count, digest offset, the
    blocks' bytes in all, then the shape at HEAD_SHAPE and the block sizes at HEAD_SIZES.
    `itemsizes` maps a dtype code to its item size (0: unknown). True if they hold; False for
    anything the Python parser refuses, which then words the refusal (it is the reference: a
    test holds the two to the same verdicts)."""
    ok, name_at, name_len, code, ndim, numel, at = _name_dtype_shape(fields, np.int64(0), itemsizes, ints,
                                                                     HEAD_SHAPE, True)
    if not ok:
        return False
    ints[0], ints[1] = name_at, name_len
    isz = np.int64(itemsizes[code])
    be, at, err = _uvarint(fields, at, max_block_bytes)
    if err:
        return False
    block_elems = np.int64(be)
    if block_elems < 1 or block_elems * isz > max_block_bytes:
        return False
    nb_, at, err = _uvarint(fields, at, fields.size - at)
    if err:
        return False
    n_blocks = np.int64(nb_)
    if n_blocks != (numel + block_elems - 1) // block_elems:
        return False
    total = np.int64(0)
    for i in range(n_blocks):
        elems = min(block_elems, numel - i * block_elems)
        size, at, err = _uvarint(fields, at, 1 + elems * isz)
        if err:
            return False
        ints[HEAD_SIZES + i] = np.int64(size)
        total += np.int64(size)
    if at + DIGEST_SIZE != fields.size:
        return False
    ints[2], ints[3], ints[4], ints[5], ints[6], ints[7] = code, ndim, block_elems, n_blocks, at, total
    return True


INDEX_ROW = 7  # index_entries' columns: name offset and length, dtype code, ndim, offset, length, digest offset


@nb.njit(cache=True, nogil=True)
def index_entries(body, itemsizes, max_tensors, first_offset, index_offset, rows, dims):
    """The index body parsed and checked as `snapshot._parse_index` does, but for the names'
    UTF-8 and their uniqueness: (True, entries, dims in all) if it holds, else (False, 0, 0).
    With `rows` empty it only counts; then with `rows` (entries x INDEX_ROW int64) and `dims`
    (int64, every entry's shape back to back) of those sizes it fills them. Records must follow
    one another from `first_offset` and end at `index_offset`."""
    fill = rows.size > 0
    n, at, err = _uvarint(body, 0, min(max_tensors, body.size))
    if err:
        return False, 0, 0
    expect = np.int64(first_offset)
    total_dims = np.int64(0)
    for e in range(np.int64(n)):
        ok, name_at, k, code, ndim, numel, at = _name_dtype_shape(body, at, itemsizes, dims, total_dims, fill)
        if not ok:
            return False, 0, 0
        offset, at, err = _uvarint(body, at, (1 << 63) - 1)
        if err:
            return False, 0, 0
        length, at, err = _uvarint(body, at, (1 << 63) - 1)
        if err:
            return False, 0, 0
        if np.int64(offset) != expect or np.int64(length) < 5 or np.int64(length) > index_offset:
            return False, 0, 0
        expect += np.int64(length)
        if at + DIGEST_SIZE > body.size:
            return False, 0, 0
        if fill:
            rows[e, 0], rows[e, 1], rows[e, 2], rows[e, 3] = name_at, k, code, ndim
            rows[e, 4], rows[e, 5], rows[e, 6] = np.int64(offset), np.int64(length), at
        at += DIGEST_SIZE
        total_dims += ndim
    if at != body.size or expect != index_offset:
        return False, 0, 0
    return True, np.int64(n), total_dims


@nb.njit(cache=True, nogil=True)
def block_head(body, states, freq):
    """A kind 2 or 3 block's header (after its kind byte), its table into `freq` (256 int64):
    (error code, the value at fault, n_words, residual codec, offset of the stream). The checks
    of FORMAT.md: 2-256 symbols, strictly increasing, frequencies 1-4095 summing to 2**12, at
    least two words per state and the stream inside the block."""
    for j in range(256):
        freq[j] = 0
    n_sym, at, err = _uvarint(body, 0, 256)
    if err:
        return err, np.int64(n_sym), 0, 0, at
    if n_sym < 2:
        return E_N_SYM, np.int64(n_sym), 0, 0, at
    prev = np.int64(-1)
    total = np.int64(0)
    for _ in range(np.int64(n_sym)):
        if at >= body.size:
            return E_TRUNCATED, 0, 0, 0, at
        s = np.int64(body[at])
        at += 1
        if s <= prev:
            return E_ORDER, s, 0, 0, at
        prev = s
        f, at, err = _uvarint(body, at, MAX_FREQ)
        if err:
            return err, np.int64(f) if err == E_LIMIT else 0, 0, 0, at
        if f == 0:
            return E_FREQ_0, s, 0, 0, at
        freq[s] = np.int64(f)
        total += np.int64(f)
    if total != 1 << SCALE:
        return E_SUM, total, 0, 0, at
    nw, at, err = _uvarint(body, at, body.size)
    if err:
        return err, np.int64(nw) if err == E_LIMIT else 0, 0, 0, at
    n_words = np.int64(nw)
    if at >= body.size:
        return E_TRUNCATED, 0, 0, 0, at
    res_codec = np.int64(body[at])
    at += 1
    if n_words < 2 * states or at + 4 * n_words > body.size:
        return E_WORDS, n_words, 0, 0, at
    return OK, 0, n_words, res_codec, at


@nb.njit(inline="always", cache=True, nogil=True)
def _initial_states(body, w0, n_words, states):
    """The final encoder states, from the last 2 * states words (low, high); None-like (an empty
    array) if any lies outside [L, 2**63)."""
    xs = np.empty(states, np.uint64)
    base = n_words - 2 * states
    for k in range(states):
        x = _word(body, w0, base + 2 * k) | (_word(body, w0, base + 2 * k + 1) << _U(32))
        if x < _U(rans.RANS_L) or x >> _U(63):
            return xs[:0]
        xs[k] = x
    return xs


@nb.njit(inline="always", cache=True, nogil=True)
def _merge(residual, out, start, stop):
    """Sign and mantissa into elements [start, stop) of `out`, whose bits 7-14 hold their
    exponents (other bits are masked off): a loop of its own, which the compiler vectorises."""
    for j in range(start, stop):
        r = np.uint16(residual[_U(j)])
        out[_U(j)] = ((r & np.uint16(0x80)) << np.uint16(8)) | (out[_U(j)] & np.uint16(0x7F80)) | (r & np.uint16(0x7F))


@nb.njit(inline="always", cache=True, nogil=True)
def _sym(table, x, out, i):
    """Decode one symbol from state x into out[i] (its exponent bits only); the new state."""
    e = _U(table[x & _U(MAX_FREQ)])
    out[_U(i)] = np.uint16(e >> _U(5))
    return (e >> _U(20)) * (x >> _U(SCALE)) + (e & _U(0xFFF))


@nb.njit(inline="always", cache=True, nogil=True)
def _word(body, w0, k):
    """Word k of a stream that starts at body[w0]: the little-endian uint32 at body[w0 + 4k], at
    any alignment (a uint32 view of a block's bytes would not always be aligned; LLVM makes the
    four byte loads one)."""
    a = _U(w0) + _U(4) * _U(k)
    return (_U(body[a]) | (_U(body[a + _U(1)]) << _U(8)) | (_U(body[a + _U(2)]) << _U(16))
            | (_U(body[a + _U(3)]) << _U(24)))


@nb.njit(inline="always", cache=True, nogil=True)
def _pull(x, body, w0, pos):
    """The renormalisation: x pulls word `pos` if it fell below L (the word is read either way:
    the caller guarantees pos >= 0). (new x, new pos)."""
    w = _word(body, w0, pos)
    c = x < _U(rans.RANS_L)
    return ((x << _U(32)) | w) if c else x, pos - c


@nb.njit(cache=True, nogil=True)
def encode_block(elems, freq, cum, rcp, rsh, residual):
    """Kind 2: rANS-code the exponents of `elems` backwards (element i with state i % 4) and write
    each element's `sign << 7 | mantissa` into `residual`. Returns (words, n_words, x0, x1, x2, x3)."""
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


@nb.njit(inline="always", cache=True, nogil=True)
def _put(x, s, freq, cum, rcp, rsh, scale):
    """The rANS encode step of symbol s at precision 2**scale (no renormalisation):
    ((x // f) << scale) + x % f + cum, with selects rather than branches (a mispredicted branch
    per symbol made the encoder 3x slower)."""
    f = _U(freq[s])
    q = rans.umulhi(x, rcp[s]) >> _U(rsh[s] & 63)  # rsh is -1 for f == 1, where q = x
    q = x if f == _U(1) else q
    return (q << _U(scale)) + (x - q * f) + _U(cum[s])


@nb.njit(inline="always", cache=True, nogil=True)
def _emit(x, bound, words, nw):
    """The encoder's renormalisation: emit x's low word if x >= bound (written either way, counted
    only then). (new x, new nw)."""
    c = x >= bound
    words[_U(nw)] = x & _U(rans.WORD_MASK)
    return ((x >> _U(32)) if c else x), nw + c


@nb.njit(inline="always", cache=True, nogil=True)
def _encode_groups_of(syms, freq, cum, rcp, rsh, scale):
    """Kinds 3 and 4's layout: rANS-code the symbols `syms` (indices into freq, cum, rcp, rsh) at
    precision 2**scale in groups of 16 (symbol j of a group with state j % 8), from the last
    group to the first. Returns (words, n_words, states[8]).

    A state codes its (one or two) symbols of a group, a then b in decoding order, after one
    renormalisation: it emits a word if x >= ((L >> scale * c) << 32) * (product of the c symbols'
    frequencies). With c = 2 that is exact, as with c = 1: a state of [L, 2**32 L) decodes both
    symbols into [L fa fb / 2**(2 scale), ...), an interval whose bound is an integer (L = 2**31,
    scale 12 or 13), so the decoder pulls a word exactly when the encoder emitted one."""
    n = syms.size
    words = np.empty(scale * n // 32 + 64, np.uint64)  # at most `scale` bits per symbol
    nw = 0
    L = _U(rans.RANS_L)
    one = ((L >> _U(scale)) << _U(32))  # emit bounds per unit of frequency (product)
    two = ((L >> _U(2 * scale)) << _U(32))
    xs = np.full(STATES_V2, L, np.uint64)
    full = n - n % GROUP
    g = full
    if g < n:  # the short last group: a state holds 0, 1 or 2 of its symbols
        for k in range(STATES_V2 - 1, -1, -1):
            a = g + k
            if a >= n:
                continue
            x = xs[_U(k)]
            sa = _U(syms[_U(a)])
            if a + STATES_V2 < n:
                sb = _U(syms[_U(a + STATES_V2)])
                bound = two * _U(freq[sa]) * _U(freq[sb])
            else:
                sb = _U(0)
                bound = one * _U(freq[sa])
            x, nw = _emit(x, bound, words, nw)
            if a + STATES_V2 < n:
                x = _put(x, sb, freq, cum, rcp, rsh, scale)
            xs[_U(k)] = _put(x, sa, freq, cum, rcp, rsh, scale)
    while g > 0:
        g -= GROUP
        if nw + STATES_V2 > words.size:  # cannot happen with valid tables; a guard, not a path
            return words, -1, xs
        for k in range(STATES_V2 - 1, -1, -1):
            sa = _U(syms[_U(g + k)])
            sb = _U(syms[_U(g + k + STATES_V2)])
            x, nw = _emit(xs[_U(k)], two * _U(freq[sa]) * _U(freq[sb]), words, nw)
            x = _put(x, sb, freq, cum, rcp, rsh, scale)
            xs[_U(k)] = _put(x, sa, freq, cum, rcp, rsh, scale)
    return words, nw, xs


@nb.njit(cache=True, nogil=True)
def encode_groups(elems, freq, cum, rcp, rsh, residual):
    """Kind 3: rANS-code the exponents of `elems` in groups of 16 elements (`_encode_groups_of`,
    precision 2**12) and write each element's `sign << 7 | mantissa` into `residual`.
    Returns (words, n_words, states[8])."""
    n = elems.size
    syms = np.empty(n, np.uint8)
    for i in range(n):
        b = elems[_U(i)]
        residual[_U(i)] = ((b >> 8) & 0x80) | (b & 0x7F)
        syms[_U(i)] = (b >> 7) & 0xFF
    return _encode_groups_of(syms, freq, cum, rcp, rsh, SCALE)


@nb.njit(inline="always", cache=True, nogil=True)
def _pull_all(xs, body, w0, pos):
    """The checked renormalisation of all eight states (a decoder's tail): each below L pulls the
    word at pos. The new pos, or -2 if a state found no word left."""
    L = _U(rans.RANS_L)
    for k in range(STATES_V2):
        if xs[k] < L:
            if pos < 0:
                return np.int64(-2)
            xs[k] = (xs[k] << _U(32)) | _word(body, w0, pos)
            pos -= 1
    return pos


@nb.njit(inline="always", cache=True, nogil=True)
def _at_rest(xs, pos):
    """The end checks of an eight-state stream: every word consumed, every state back at L."""
    if pos != -1:
        return False
    for k in range(STATES_V2):
        if xs[k] != _U(rans.RANS_L):
            return False
    return True


@nb.njit(cache=True, nogil=True)
def decode_block(table, body, w0, n_words, residual, out, function, state):
    """The inverse of `encode_block` (kind 2) into `out` (uint16, residual.size elements); the
    stream is the `n_words` words at body[w0] (`_word`), its four states last. OK only if the states are in range (else
    BAD_STATES), every word was consumed and all four states ended at exactly 2**31 (else CORRUPT).
    Each finished chunk of `out` is fed, while in L1, to the running digest (`hashing.Running`'s
    `function` and `state`; `function` 0: none); a block that is refused has fed part of its own."""
    n = out.size
    xs = _initial_states(body, w0, n_words, STATES)
    if xs.size == 0:
        return BAD_STATES
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    pos = np.int64(n_words - 2 * STATES) - 1
    i = 0
    n4 = n - (n & 3)
    while i < n4:  # while a group of four cannot run out of words: no bounds checks
        start = i
        stop = min(i + CHUNK, n4)
        while i < stop and pos >= 3:
            x0 = _sym(table, x0, out, i)
            x0, pos = _pull(x0, body, w0, pos)
            x1 = _sym(table, x1, out, i + 1)
            x1, pos = _pull(x1, body, w0, pos)
            x2 = _sym(table, x2, out, i + 2)
            x2, pos = _pull(x2, body, w0, pos)
            x3 = _sym(table, x3, out, i + 3)
            x3, pos = _pull(x3, body, w0, pos)
            i += 4
        _merge(residual, out, start, i)
        if function:
            hash_update(function, state, out, start, i)
        if i < stop:
            break
    xs[0], xs[1], xs[2], xs[3] = x0, x1, x2, x3
    L = _U(rans.RANS_L)
    tail = i
    while i < n:  # the last few words, checked one by one
        k = i & 3
        xs[k] = _sym(table, xs[k], out, i)
        if xs[k] < L:
            if pos < 0:
                return CORRUPT
            xs[k] = (xs[k] << _U(32)) | _word(body, w0, pos)
            pos -= 1
        i += 1
    _merge(residual, out, tail, n)
    if function:
        hash_update(function, state, out, tail, n)
    return OK if pos == -1 and xs[0] == L and xs[1] == L and xs[2] == L and xs[3] == L else CORRUPT


@nb.njit(cache=True, nogil=True)
def decode_groups(table, body, w0, n_words, residual, out, function, state):
    """The inverse of `encode_groups` (kind 3) into `out` (uint16, residual.size elements); the
    stream is the `n_words` words at body[w0], its eight states last. OK only if the states are in range (else
    BAD_STATES), every word was consumed and all eight states ended at exactly 2**31 (else CORRUPT).
    The digest is fed as `decode_block` feeds it."""
    n = out.size
    xs = _initial_states(body, w0, n_words, STATES_V2)
    if xs.size == 0:
        return BAD_STATES
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    pos = np.int64(n_words - 2 * STATES_V2) - 1
    i = 0
    full = n - n % GROUP
    while i < full:  # while a group cannot run out of words (it pulls at most 8): no bounds checks
        start = i
        stop = min(i + CHUNK, full)
        while i < stop and pos >= STATES_V2 - 1:
            x0 = _sym(table, x0, out, i)
            x1 = _sym(table, x1, out, i + 1)
            x2 = _sym(table, x2, out, i + 2)
            x3 = _sym(table, x3, out, i + 3)
            x4 = _sym(table, x4, out, i + 4)
            x5 = _sym(table, x5, out, i + 5)
            x6 = _sym(table, x6, out, i + 6)
            x7 = _sym(table, x7, out, i + 7)
            x0 = _sym(table, x0, out, i + 8)
            x1 = _sym(table, x1, out, i + 9)
            x2 = _sym(table, x2, out, i + 10)
            x3 = _sym(table, x3, out, i + 11)
            x4 = _sym(table, x4, out, i + 12)
            x5 = _sym(table, x5, out, i + 13)
            x6 = _sym(table, x6, out, i + 14)
            x7 = _sym(table, x7, out, i + 15)
            x0, pos = _pull(x0, body, w0, pos)
            x1, pos = _pull(x1, body, w0, pos)
            x2, pos = _pull(x2, body, w0, pos)
            x3, pos = _pull(x3, body, w0, pos)
            x4, pos = _pull(x4, body, w0, pos)
            x5, pos = _pull(x5, body, w0, pos)
            x6, pos = _pull(x6, body, w0, pos)
            x7, pos = _pull(x7, body, w0, pos)
            i += GROUP
        _merge(residual, out, start, i)
        if function:
            hash_update(function, state, out, start, i)
        if i < stop:
            break
    xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
    tail = i
    while i < n:  # the last few words (and a short last group), checked one by one
        m = min(GROUP, n - i)
        for j in range(m):
            k = j & (STATES_V2 - 1)
            xs[k] = _sym(table, xs[k], out, i + j)
        pos = _pull_all(xs, body, w0, pos)
        if pos == -2:
            return CORRUPT
        i += m
    _merge(residual, out, tail, n)
    if function:
        hash_update(function, state, out, tail, n)
    return OK if _at_rest(xs, pos) else CORRUPT


# ---------------------------------------------------------------- kind 4: exponent pairs
#
# Kind 3's layout with one change: a symbol is the *pair* of exponents of elements 2p and 2p+1,
# coded at precision 2**13 (SCALE_PAIRS). Half the symbols, so half the state updates, and a
# slot's one uint64 carries both exponents already in their places in the two BF16 words (a
# pair of 16-bit stores), its bias and its frequency. Measured on all-MiniLM-L6-v2 (2**18-element
# blocks, sign and mantissa merged, the digest fed): 0.66-0.8 ns per element for this kernel
# against kind 3's 1.4-1.8 on the same blocks; the pair table costs ~0.1% of the raw size over
# kind 3's (a 2**18-element block lists ~220 pairs). (A table of 2**13 uint16 slot -> symbol
# plus one uint64 per symbol fits in L1 but measured 10% slower: one more dependent load.)
# Two pair symbols between pulls stay exact because L / 2**26 is an integer.

SCALE_PAIRS = 13
PAIR_SLOTS = 1 << SCALE_PAIRS
MAX_PAIR_FREQ = PAIR_SLOTS - 1
MAX_PAIR_SYMBOLS = 4096  # what the encoder lists at most (else kind 3); a decoder takes up to 2**13
E_CODE = 9  # a pair code past 0xFFFF


@nb.njit(cache=True, nogil=True)
def pair_codes(elems, codes, residual):
    """Each element's `sign << 7 | mantissa` into `residual`; each pair's code `e[2p] | e[2p+1] << 8`
    into `codes` (ceil(n / 2) uint16; an odd block's last pair has 0 for its missing second).
    Returns the residual bytes' histogram."""
    n = elems.size
    hr = np.zeros(256, np.int64)
    for i in range(n):
        b = elems[_U(i)]
        r = ((b >> 8) & 0x80) | (b & 0x7F)
        residual[_U(i)] = r
        hr[r] += 1
    for p in range(n // 2):
        codes[_U(p)] = ((elems[_U(2 * p)] >> 7) & 0xFF) | (((elems[_U(2 * p + 1)] >> 7) & 0xFF) << 8)
    if n & 1:
        codes[_U(n // 2)] = (elems[_U(n - 1)] >> 7) & 0xFF
    return hr


@nb.njit(cache=True, nogil=True)
def pair_histogram(codes, index):
    """(the distinct pair codes of `codes`, increasing, and their counts); `index` (2**16 int64
    scratch, left holding each listed code's position) maps codes to symbols for the encoder."""
    counts = np.zeros(1 << 16, np.int64)
    for p in range(codes.size):
        counts[codes[_U(p)]] += 1
    n = 0
    for c in range(1 << 16):
        n += counts[c] > 0
    present = np.empty(n, np.int64)
    out = np.empty(n, np.int64)
    k = 0
    for c in range(1 << 16):
        if counts[c]:
            present[k] = c
            out[k] = counts[c]
            index[c] = k
            k += 1
    return present, out


@nb.njit(cache=True, nogil=True)
def encode_pair_groups(codes, index, freq, cum, rcp, rsh):
    """Kind 4: rANS-code the pair codes (`index` maps a code to its symbol) in groups of 16 pairs
    (`_encode_groups_of`, precision 2**13). Returns (words, n_words, states[8])."""
    syms = np.empty(codes.size, np.int64)
    for p in range(codes.size):
        syms[_U(p)] = index[codes[_U(p)]]
    return _encode_groups_of(syms, freq, cum, rcp, rsh, SCALE_PAIRS)


@nb.njit(cache=True, nogil=True)
def pair_block_head(body, codes, freq):
    """A kind 4 block's header (after its kind byte): its pair codes and frequencies into `codes`
    and `freq` (PAIR_SLOTS entries each). (error code, the value at fault, n_sym, n_words,
    residual codec, offset of the stream). FORMAT.md's checks: 2 to 2**13 pairs, codes strictly
    increasing (gaps) and below 2**16, frequencies 1 to 2**13 - 1 summing to 2**13, at least two
    words per state and the stream inside the block."""
    n_sym, at, err = _uvarint(body, 0, PAIR_SLOTS)
    if err:
        return err, np.int64(n_sym), 0, 0, 0, at
    if n_sym < 2:
        return E_N_SYM, np.int64(n_sym), 0, 0, 0, at
    code = np.int64(-1)
    total = np.int64(0)
    for k in range(np.int64(n_sym)):
        gap, at, err = _uvarint(body, at, 0xFFFF)
        if err:
            return err, np.int64(gap) if err == E_LIMIT else 0, 0, 0, 0, at
        code += np.int64(gap) + 1
        if code > 0xFFFF:
            return E_CODE, code, 0, 0, 0, at
        f, at, err = _uvarint(body, at, MAX_PAIR_FREQ)
        if err:
            return err, np.int64(f) if err == E_LIMIT else 0, 0, 0, 0, at
        if f == 0:
            return E_FREQ_0, code, 0, 0, 0, at
        codes[k] = code
        freq[k] = np.int64(f)
        total += np.int64(f)
    if total != PAIR_SLOTS:
        return E_SUM, total, 0, 0, 0, at
    nw, at, err = _uvarint(body, at, body.size)
    if err:
        return err, np.int64(nw) if err == E_LIMIT else 0, 0, 0, 0, at
    n_words = np.int64(nw)
    if at >= body.size:
        return E_TRUNCATED, 0, 0, 0, 0, at
    res_codec = np.int64(body[at])
    at += 1
    if n_words < 2 * STATES_V2 or at + 4 * n_words > body.size:
        return E_WORDS, n_words, 0, 0, 0, at
    return OK, 0, np.int64(n_sym), n_words, res_codec, at


@nb.njit(cache=True, nogil=True)
def pair_slot_table(codes, freq, n_sym, table):
    """Fills `table` (PAIR_SLOTS uint64), kind 4's slot table: slot `cum[s] + j` of pair s holds
    `(a << 7 | b << 23) | j << 32 | freq[s] << 48` for its exponents a (first) and b (second)."""
    at = np.int64(0)
    for s in range(n_sym):
        c = _U(codes[s])
        bits = ((c & _U(0xFF)) << _U(7)) | ((c >> _U(8)) << _U(23))
        f = _U(freq[s])
        for j in range(np.int64(f)):
            table[at + j] = bits | (_U(j) << _U(32)) | (f << _U(48))
        at += np.int64(f)


@nb.njit(inline="always", cache=True, nogil=True)
def _pair(table, x, out, i):
    """Decode one pair symbol from state x into out[2i] and out[2i + 1] (their exponent bits only);
    the new state."""
    e = table[x & _U(MAX_PAIR_FREQ)]
    out[_U(2 * i)] = np.uint16(e & _U(0xFFFF))
    out[_U(2 * i + 1)] = np.uint16((e >> _U(16)) & _U(0xFFFF))
    return (e >> _U(48)) * (x >> _U(SCALE_PAIRS)) + ((e >> _U(32)) & _U(0xFFFF))


@nb.njit(cache=True, nogil=True)
def decode_pair_groups(table, body, w0, n_words, residual, out, function, state):
    """The inverse of `encode_pair_groups` (kind 4) into `out` (uint16, residual.size elements);
    the stream is the `n_words` words at body[w0], its eight states last. OK only if the states are in range (else
    BAD_STATES), every word was consumed, all eight states ended at exactly 2**31 and an odd
    block's last pair has 0 for its missing second exponent (else CORRUPT). The digest is fed
    as `decode_block` feeds it."""
    n = out.size
    m = (n + 1) // 2
    xs = _initial_states(body, w0, n_words, STATES_V2)
    if xs.size == 0:
        return BAD_STATES
    x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
    pos = np.int64(n_words - 2 * STATES_V2) - 1
    p = 0
    full = (n // 2) - (n // 2) % GROUP  # whole groups of whole pairs
    while p < full:  # a group pulls at most 8 words: no bounds checks while 8 are left
        start = p
        stop = min(p + CHUNK // 2, full)
        while p < stop and pos >= STATES_V2 - 1:
            x0 = _pair(table, x0, out, p)
            x1 = _pair(table, x1, out, p + 1)
            x2 = _pair(table, x2, out, p + 2)
            x3 = _pair(table, x3, out, p + 3)
            x4 = _pair(table, x4, out, p + 4)
            x5 = _pair(table, x5, out, p + 5)
            x6 = _pair(table, x6, out, p + 6)
            x7 = _pair(table, x7, out, p + 7)
            x0 = _pair(table, x0, out, p + 8)
            x1 = _pair(table, x1, out, p + 9)
            x2 = _pair(table, x2, out, p + 10)
            x3 = _pair(table, x3, out, p + 11)
            x4 = _pair(table, x4, out, p + 12)
            x5 = _pair(table, x5, out, p + 13)
            x6 = _pair(table, x6, out, p + 14)
            x7 = _pair(table, x7, out, p + 15)
            x0, pos = _pull(x0, body, w0, pos)
            x1, pos = _pull(x1, body, w0, pos)
            x2, pos = _pull(x2, body, w0, pos)
            x3, pos = _pull(x3, body, w0, pos)
            x4, pos = _pull(x4, body, w0, pos)
            x5, pos = _pull(x5, body, w0, pos)
            x6, pos = _pull(x6, body, w0, pos)
            x7, pos = _pull(x7, body, w0, pos)
            p += GROUP
        _merge(residual, out, 2 * start, 2 * p)
        if function:
            hash_update(function, state, out, 2 * start, 2 * p)
        if p < stop:
            break
    xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7] = x0, x1, x2, x3, x4, x5, x6, x7
    tail = 2 * p
    while p < m:  # the last few words, the short last group and an odd block's half pair
        g = min(GROUP, m - p)
        for j in range(g):
            k = j & (STATES_V2 - 1)
            x = xs[k]
            e = table[x & _U(MAX_PAIR_FREQ)]
            xs[k] = (e >> _U(48)) * (x >> _U(SCALE_PAIRS)) + ((e >> _U(32)) & _U(0xFFFF))
            q = 2 * (p + j)
            out[_U(q)] = np.uint16(e & _U(0xFFFF))
            if q + 1 < n:
                out[_U(q + 1)] = np.uint16((e >> _U(16)) & _U(0xFFFF))
            elif (e >> _U(16)) & _U(0xFFFF):
                return CORRUPT
        pos = _pull_all(xs, body, w0, pos)
        if pos == -2:
            return CORRUPT
        p += g
    _merge(residual, out, tail, n)
    if function:
        hash_update(function, state, out, tail, n)
    return OK if _at_rest(xs, pos) else CORRUPT


# ---------------------------------------------------------------- a record's blocks in one call
#
# Python's glue around each block (slicing, header and table calls, checks) cost ~15 us a block
# and ~20 us a record, ~25% of decoding all-MiniLM-L6-v2: one kernel call now runs a record's
# blocks, and returns to Python only for what needs zstd.

DONE, NEED_ZSTD, NEED_RESIDUAL, FAULT = 0, 1, 2, 3  # decode_record's outcomes
# a fault's codes besides block_head's and pair_block_head's (snapshot.py words them all)
F_EMPTY, F_STORED, F_KIND, F_RESIDUAL_SIZE, F_RESIDUAL_CODEC, F_BAD_STATES, F_CORRUPT, F_DIGEST = range(20, 28)


@nb.njit(cache=True, nogil=True)
def _bf16_block(kind, body, w0, n_words, residual, out, table, ptable, function, state):
    """A kind 2, 3 or 4 block whose header is parsed and slot table built (`table` for kinds 2
    and 3, `ptable` for kind 4) through its decoder: the decoder's status. (A function of its own
    so that both residual planes, the block's bytes and a decompressed one, can reach it.)"""
    if kind == KIND_BF16_PAIRS:
        return decode_pair_groups(ptable, body, w0, n_words, residual, out, function, state)
    if kind == KIND_BF16_GROUPS:
        return decode_groups(table, body, w0, n_words, residual, out, function, state)
    return decode_block(table, body, w0, n_words, residual, out, function, state)


@nb.njit(cache=True, nogil=True)
def decode_record(buf, sizes, first, first_at, residual, block_elems, itemsize, kinds, raw, out,
                  freq, table, codes, pfreq, ptable, functions, state, header, expected):
    """A record's blocks from block `first` on, which begins at `first_at` in buf (the offset a call
    that stopped there returned: never summed again, so a record of many blocks costs linear time;
    their bytes back to back in `buf`, block i of
    `sizes[i]` bytes, `block_elems` elements of `itemsize` bytes each but the last) into `raw`,
    the tensor's bytes; BF16 kinds (those set in the bit mask `kinds`: the object's version and
    the tensor's dtype allow them) into `out`, the same memory as uint16. Stored blocks are fed
    to the digest here, the BF16 decoders feed theirs. Stops at a block that needs Python's
    zstd: a zstd block (NEED_ZSTD), or a BF16 block whose residual plane is zstd-coded
    (NEED_RESIDUAL, `value` the plane's offset in buf: called again from that block, with the
    plane decompressed as `residual`, it decodes on), and at the first fault (FAULT: `code`, one
    of block_head's or an F_ code, and `value`). (outcome, block, code, value, the block's offset
    in buf). `freq`, `table`, `codes`, `pfreq` and `ptable` are the caller's scratch.

    The digest: with `functions` (`hashing.NATIVE.functions()`; empty, nothing is hashed here)
    the XXH3 `state` is reset and fed the tensor's `header` when `first` is 0, then every block
    in order (a caller feeds what it decompresses itself before calling again); with `expected`
    too (16 bytes, the record's digest; only where `hashing.KERNEL_DIGESTS`) the kernel finishes
    it and a mismatch is a FAULT with F_DIGEST. Python then makes no call per tensor for it."""
    function = functions[1] if functions.size else np.uintp(0)
    if function and first == 0:
        hash_reset(functions[0], state)
        hash_update(function, state, header, 0, header.size)
    at = np.int64(first_at)
    numel = np.int64(raw.size // itemsize)
    zero = np.int64(0)
    for i in range(first, sizes.size):
        size = np.int64(sizes[i])
        start = np.int64(i) * block_elems
        stop = min(start + block_elems, numel)
        if size == 0:
            return FAULT, i, F_EMPTY, zero, at
        kind = np.int64(buf[at])
        body = buf[at + 1:at + size]
        if kind == KIND_RAW:
            lo, hi = start * itemsize, stop * itemsize
            if size - 1 != hi - lo:
                return FAULT, i, F_STORED, size - 1, at
            raw[lo:hi] = body
            if function:
                hash_update(function, state, raw, lo, hi)
        elif kind == KIND_ZSTD:
            return NEED_ZSTD, i, 0, zero, at
        elif kind <= KIND_BF16_PAIRS and (kinds >> kind) & 1:
            if kind == KIND_BF16_PAIRS:
                err, value, n_sym, n_words, res_codec, w0 = pair_block_head(body, codes, pfreq)
                if not err:
                    pair_slot_table(codes, pfreq, n_sym, ptable)
            else:
                err, value, n_words, res_codec, w0 = block_head(
                    body, STATES_V2 if kind == KIND_BF16_GROUPS else STATES, freq)
                if not err:
                    slot_table(freq, table)
            if err:
                return FAULT, i, err, np.int64(value), at
            r0 = w0 + 4 * n_words
            o = out[start:stop]
            if res_codec == RESIDUAL_RAW:
                if body.size - r0 != stop - start:
                    return FAULT, i, F_RESIDUAL_SIZE, np.int64(body.size - r0), at
                status = _bf16_block(kind, body, w0, n_words, body[r0:], o, table, ptable, function, state)
            elif res_codec == RESIDUAL_ZSTD:
                if i != first or residual.size != stop - start:
                    return NEED_RESIDUAL, i, 0, at + 1 + r0, at
                status = _bf16_block(kind, body, w0, n_words, residual, o, table, ptable, function, state)
            else:
                return FAULT, i, F_RESIDUAL_CODEC, np.int64(res_codec), at
            if status == BAD_STATES:
                return FAULT, i, F_BAD_STATES, zero, at
            if status != OK:
                return FAULT, i, F_CORRUPT, zero, at
        else:
            return FAULT, i, F_KIND, kind, at
        at += size
    if function and expected.size:
        lo, hi = hash_digest(functions[2], state)
        want_hi, want_lo = _U(0), _U(0)
        for k in range(8):
            want_hi = (want_hi << _U(8)) | _U(expected[k])
            want_lo = (want_lo << _U(8)) | _U(expected[8 + k])
        if hi != want_hi or lo != want_lo:
            return FAULT, sizes.size, F_DIGEST, zero, at
    return DONE, sizes.size, 0, zero, at
