"""Exponent classes: the vector masks and bit tricks, the class DP and the position <-> rank scans."""

from __future__ import annotations

import itertools

import numba as nb
import numpy as np
import pytest

from codec import hashing
from codec.methods import exponent_classes as ec

_NO_COPY = np.empty(0, np.uint16)


@nb.njit
def _selects(xs, rs):
    out = np.empty(xs.size, np.int64)
    for i in range(xs.size):
        out[i] = ec._select_broadword(xs[i], rs[i])
    return out


@nb.njit
def _popcounts(xs):
    out = np.empty(xs.size, np.int64)
    for i in range(xs.size):
        out[i] = ec._popcount(xs[i])
    return out


def _random_words(n: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    dense = rng.integers(0, 1 << 63, n, dtype=np.uint64) | rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63)
    sparse = dense & rng.integers(0, 1 << 63, n, dtype=np.uint64) & rng.integers(0, 1 << 63, n, dtype=np.uint64)
    edge = np.array([1, 1 << 63, (1 << 64) - 1, 0x8000000000000001, 0x00FF00FF00FF00FF], np.uint64)
    words = np.concatenate([dense, sparse, edge])
    return words[words != 0]


def test_select_finds_the_bit_with_r_set_bits_below():
    words = _random_words(3000)
    rng = np.random.default_rng(2)
    counts = np.array([bin(int(w)).count("1") for w in words])
    rs = (rng.random(words.size) * counts).astype(np.int64)
    got = _selects(words, rs)
    for w, r, g in zip(words, rs, got):
        bits = [i for i in range(64) if int(w) >> i & 1]
        assert g == bits[r]


@nb.njit
def _deposits(xs, ms, use_pdep):
    out = np.empty(xs.size, np.uint64)
    for i in range(xs.size):
        out[i] = ec._deposit_pdep(xs[i], ms[i]) if use_pdep else ec._deposit_broadword(xs[i], ms[i])
    return out


@pytest.mark.parametrize("use_pdep", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ec.HAVE_BMI2, reason="this CPU has no BMI2"))])
def test_deposit_places_the_low_bits_at_the_mask_bits(use_pdep):
    masks = np.concatenate([_random_words(2000), np.array([(1 << 64) - 1], np.uint64)])
    # bits above the mask's count too
    xs = np.random.default_rng(5).integers(0, 1 << 63, masks.size, dtype=np.uint64) * np.uint64(3)
    got = _deposits(xs, masks, use_pdep)
    for x, m, g in zip(xs, masks, got):
        want, i = 0, 0
        for bit in range(64):
            if int(m) >> bit & 1:
                want |= (int(x) >> i & 1) << bit
                i += 1
        assert int(g) == want


def test_popcount():
    words = _random_words(3000)
    assert np.array_equal(_popcounts(words), [bin(int(w)).count("1") for w in words])


@nb.njit
def _block_masks_of(a, b, lanes):
    ge = np.zeros((a.size // ec.BLOCK, ec.MAX_CLASSES + 1), np.uint64)
    ne = np.empty(a.size // ec.BLOCK, np.uint64)
    for blk in range(a.size // ec.BLOCK):
        ec._block_masks(a, blk * ec.BLOCK, lanes, ge[blk])
        ne[blk] = ec._differ(a, b, blk * ec.BLOCK)
    return ge, ne


def _mask_of(bits: np.ndarray) -> int:
    return sum(1 << int(i) for i in np.flatnonzero(bits))


@pytest.mark.parametrize("thresholds", [[], [1], [100, 118, 120, 121, 122, 124, 127], [1, 2, 127, 128, 200, 254, 255]])
def test_vector_masks_match_elementwise_comparisons(thresholds):
    """Bit i of each block's masks is element i's comparison, for thresholds from 1 to 255, both
    signs and every special exponent, at unaligned offsets too; classes a tensor lacks are empty."""
    rng = np.random.default_rng(4)
    a = _bits(rng, 64 * 40 + 1)
    a[100:164] |= 0x8000  # a block of negatives
    a[200:264] = 0x7FFF  # the largest magnitude
    a[300:364] = rng.integers(0, 1 << 16, 64, dtype=np.uint16)  # every exponent
    b = a.copy()
    b[rng.random(a.size) < 0.1] ^= 1
    thresholds = np.array(thresholds, np.int64)
    lanes = ec.lane_bounds(thresholds)
    for shift in (0, 1):  # a view starting one element in: loads not aligned to 4 bytes
        x, y = a[shift: shift + 64 * 40], b[shift: shift + 64 * 40]
        ge, ne = _block_masks_of(x, y, lanes)
        for blk in range(x.size // ec.BLOCK):
            xs, ys = x[blk * 64: blk * 64 + 64], y[blk * 64: blk * 64 + 64]
            assert int(ne[blk]) == _mask_of(xs != ys)
            for c in range(1, ec.MAX_CLASSES):
                want = _mask_of(((xs >> 7) & 0xFF) >= thresholds[c - 1]) if c <= thresholds.size else 0
                assert int(ge[blk, c]) == want, (shift, blk, c)


def test_vector_masks_refuse_other_arrays():
    with pytest.raises(nb.core.errors.TypingError):
        _block_masks_of(np.zeros(64, np.int32), np.zeros(64, np.int32), np.zeros(1, np.uint8))


def _interval_cost(n: float, k: float) -> float:
    c = ec.CLASS_OVERHEAD_BITS
    if 0 < k < n:
        p = k / n
        c += -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return c


def test_class_choice_is_the_cheapest_partition():
    """The DP against brute force over every partition of the occurring exponents."""
    rng = np.random.default_rng(3)
    for _trial in range(40):
        exps = np.sort(rng.choice(256, size=int(rng.integers(2, 7)), replace=False))
        n_e = np.zeros(256, np.int64)
        k_e = np.zeros(256, np.int64)
        n_e[exps] = rng.integers(1, 5000, exps.size)
        k_e[exps] = (n_e[exps] * rng.random(exps.size) ** 3).astype(np.int64)
        max_classes = int(rng.integers(1, 5))
        got = ec.choose_classes(n_e, k_e, max_classes)
        assert got.size < max_classes and np.all(np.diff(got) > 0) and set(got) <= set(exps[1:])

        def cost(cuts, exps=exps, n_e=n_e, k_e=k_e) -> float:  # this trial's arrays
            bounds = [0, *[int(np.searchsorted(exps, c)) for c in cuts], exps.size]
            return sum(_interval_cost(n_e[exps[a:b]].sum(), k_e[exps[a:b]].sum()) for a, b in zip(bounds, bounds[1:]))

        best = min(cost(c) for m in range(max_classes) for c in itertools.combinations(exps[1:], m))
        assert cost(got) == pytest.approx(best)


def _bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """BF16 patterns of Gaussian weights plus every special exponent."""
    w = (rng.normal(0, 0.05, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    special = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80], np.uint16)
    w[: min(n, special.size)] = special[: min(n, special.size)]
    return w


@pytest.mark.parametrize("n", [1, 7, 64, 65, 8192 + 64 * 3 + 5])
def test_positions_invert_the_encoder_scan(n):
    rng = np.random.default_rng(n)
    b = _bits(rng, n)
    t = b.copy()
    flip = rng.random(n) < 0.2
    t[flip] ^= rng.integers(1, 1 << 16, int(flip.sum()), dtype=np.uint16)
    thresholds = np.array([100, 118, 120, 121, 122, 124, 127])
    _, pairs, cls, ranks, sizes, _ = ec.analyze(b, t, thresholds)
    pos = np.flatnonzero(b != t)
    assert np.array_equal(pairs, (b[pos].astype(np.uint32) << 16) | t[pos])
    assert sizes.sum() == n
    order = np.lexsort((ranks, cls))
    first = np.searchsorted(cls[order], np.arange(ec.MAX_CLASSES + 1)).astype(np.int64)
    bb = ec.blocks(b)
    bits, start, lim, status = ec.rank_bitmaps(ranks[order], first, bb.size)
    assert status == 0
    at, status = ec.positions(n, bb, np.asarray(thresholds, np.int64), bits, start, lim, pos.size, _NO_COPY)
    assert status == 0 and np.array_equal(at, pos)


def test_positions_refuse_ranks_beyond_a_class():
    """A forged rank past a class's last element, including one that would land in the padding
    of a partial block, is refused rather than placed."""
    n = 100  # one full block and a padded one
    b = np.full(n, 0x3F80, np.uint16)  # every element in the top class
    T = np.array([0x7F], np.int64)
    words = ec.blocks(b)
    ok = np.array([0, 99], np.int64)
    first = np.array([0, 0] + [2] * 7, np.int64)

    def run(ranks, first, expected):
        bits, start, lim, status = ec.rank_bitmaps(np.array(ranks, np.int64), np.array(first, np.int64), words.size)
        return status if status else ec.positions(n, words, T, bits, start, lim, expected, _NO_COPY)[1]

    at, status = ec.positions(n, words, T, *ec.rank_bitmaps(ok, first, words.size)[:3], 2, _NO_COPY)
    assert status == 0 and list(at) == [0, 99]
    for bad in ([0, 100], [5, 127], [5, 1000], [5, 1 << 40]):
        assert run(bad, first, 2) == 2, bad
    padding_is_class_0 = [0, 1] + [1] * 7
    assert run([0], padding_is_class_0, 1) == 2  # class 0 is empty here: its only elements are padding
    assert run([27], padding_is_class_0, 1) == 2  # ... whatever the rank


def _changed_pairs(rng: np.random.Generator, specs: list[tuple[int, float]]) -> tuple[list, list]:
    """(bases, targets): per (n, fraction), n `_bits` of which about that fraction changed."""
    bs, ts = [], []
    for n, changed in specs:
        b = _bits(rng, n) if n else np.zeros(0, np.uint16)
        t = b.copy()
        flip = rng.random(n) < changed
        t[flip] ^= rng.integers(1, 1 << 16, int(flip.sum()), dtype=np.uint16)
        bs.append(b)
        ts.append(t)
    return bs, ts


@pytest.mark.parametrize("changed", [0.001, 0.3])  # 30%: the change buffers must grow mid-scan
@pytest.mark.skipif(not hashing.KERNEL_DIGESTS, reason="this xxhash build or platform does not let kernels hash")
def test_scan_digests_base_and_target_part_by_part(changed):
    """With headers, the scan digests base and target part by part (HASH_PART elements): the
    result is that of a scan without them, and the digests those of the whole tensors, also
    where the change buffers grow mid-scan (that part is scanned twice, hashed once) and for
    several tensors in one call (the states are reset per tensor)."""
    rng = np.random.default_rng(7)
    bs, ts = _changed_pairs(rng, [(2 * ec.HASH_PART + 64 * 5 + 37, changed), (0, changed), (100, changed)])
    headers = [hashing.header_bytes("BF16", (b.size,)) for b in bs]
    got = ec.analyze_many(bs, ts, headers=headers)
    want = ec.analyze_many(bs, ts)
    assert got[-1] is None and want[-1] is None  # no columns: no vote tally
    got, want = got[:-1], want[:-1]
    for g, w in zip(got[:-1], want[:-1]):
        assert np.array_equal(g, w)
    assert want[-1] is None
    digests = hashing.digest_bytes(got[-1])
    for i, (b, t) in enumerate(zip(bs, ts)):
        assert digests[32 * i: 32 * i + 16] == hashing.digest_elements("BF16", (b.size,), b)
        assert digests[32 * i + 16: 32 * i + 32] == hashing.digest_elements("BF16", (t.size,), t)


def test_scan_refuses_headers_where_kernels_cannot_hash(monkeypatch):
    monkeypatch.setattr(hashing, "KERNEL_DIGESTS", False)
    b = np.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="KERNEL_DIGESTS"):
        ec.analyze_many([b], [b], headers=[b"x"])


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 64 * 50 + 7])
@pytest.mark.parametrize("changed", [0.0, 0.05, 1.0])  # 100%: the positions buffer must grow
def test_differences_are_flatnonzero(n, changed):
    rng = np.random.default_rng(n)
    b = _bits(rng, n) if n else np.zeros(0, np.uint16)
    t = b.copy()
    flip = rng.random(n) < changed
    t[flip] ^= rng.integers(1, 1 << 16, int(flip.sum()), dtype=np.uint16)
    assert np.array_equal(ec.differences(b, t), np.flatnonzero(b != t))


def test_batched_analysis_matches_one_tensor_at_a_time():
    """analyze_many (one compiled call for many tensors, their changes back to back) gives every
    tensor exactly what analyze gives it alone: sizes that are and are not whole blocks, no
    change, every element changed (the shared buffers must grow), given thresholds."""
    rng = np.random.default_rng(9)
    bs, ts = _changed_pairs(rng, [(1, 1.0), (63, 0.1), (64, 0.0), (0, 0.0), (65, 0.2), (384, 0.05), (1536, 1.0),
                                  (4000, 0.03), (70000, 0.02)])
    for given in (None, [np.array([100 + i, 120], np.int64) for i in range(len(bs))]):
        pairs, cls, ranks, votes, first, thr, nthr, sizes, changes, digests, tally = ec.analyze_many(bs, ts, given)
        assert digests is None and votes is None and tally is None and first[0] == 0 and first[-1] == pairs.size
        for i, (b, t) in enumerate(zip(bs, ts)):
            want = ec.analyze(b, t, None if given is None else given[i])
            lo, hi = first[i], first[i + 1]
            got = (thr[i, :nthr[i]], pairs[lo:hi], cls[lo:hi], ranks[lo:hi], sizes[i], changes[i])
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert np.array_equal(g, w)


@pytest.mark.parametrize("cap", [0, 1, 2, 3, 50, 700, 5000])  # 5000: room for all
def test_scan_that_runs_out_of_buffer_fills_it_with_the_first_changes(cap):
    """A scan whose change buffers are too small counts every change and fills the buffers (up
    to their capacity, every entry) with the first changes, as a large enough scan stores them:
    callers read the buffers up to the capacity before they retry."""
    rng = np.random.default_rng(cap)
    n = 64 * 40
    b = _bits(rng, n)
    t = b.copy()
    flip = rng.random(n) < 0.3
    t[flip] ^= rng.integers(1, 1 << 16, int(flip.sum()), dtype=np.uint16)
    thr = np.array([100, 120, 127], np.int64)
    lanes, lut = ec.lane_bounds(thr), ec.class_lut(thr)

    def scan(capacity):
        pairs, cls, rank = ec._scan_buffers(capacity)
        ge, seen = ec._scan_state()
        k = ec._scan_range(b, t, 0, 0, n, lanes, lut, ge, seen, 0, pairs, cls, rank, np.empty(0, np.uint16))
        return k, pairs, cls, rank

    k, *small = scan(cap)
    full_k, *full = scan(n)
    assert k == full_k == int(flip.sum())
    for got, want in zip(small, full):
        assert np.array_equal(got[:min(k, cap)], want[:min(k, cap)])


@pytest.mark.parametrize("changed", [0.02, 1.0])
def test_scan_makes_vote_symbols_as_positions_give_them(changed):
    """With columns, the scan makes each change's vote symbol part by part (HASH_PART elements,
    from the positions it records; the column counters carried across parts and reset per
    tensor): exactly what the changes' positions give (`vote_symbols_into`), up to where it stops
    voting a tensor whose columns do not lean (`_assert_stopped_early`), also where the
    change buffers grow mid-scan (every element changed: that part is scanned twice, its votes
    made once), for shapes whose rows straddle parts, one column, and no change; the scan's
    other outputs are those of a scan without columns."""
    rng = np.random.default_rng(11)
    sizes = [3 * ec.HASH_PART + 64 * 7 + 5, 384 * 97, 1, 0, 1000]
    cols = np.array([3 * 383, 384, 1, 7, 1], np.int64)  # rows of 1149 do not divide a part
    bs, ts = _changed_pairs(rng, [(n, changed) for n in sizes])
    ts[1][::2] = bs[1][::2]  # a lean: in tensor 1 only the odd columns change
    got = ec.analyze_many(bs, ts, cols=cols)
    want = ec.analyze_many(bs, ts)
    votes, first, tally = got[3], got[4], got[-1]
    assert votes.size == got[0].size and want[3] is None and tally.shape == (len(sizes), 3)
    for g, w in zip(got[:3] + got[4:-2], want[:3] + want[4:-2]):
        assert np.array_equal(g, w)
    for i, (b, t) in enumerate(zip(bs, ts)):
        pairs = got[0][first[i]:first[i + 1]]
        expected = np.empty(pairs.size, np.uint32)
        whole = ec.vote_symbols_into(pairs, np.flatnonzero(b != t).astype(np.int64), int(cols[i]), expected)
        if not tally[i, 2]:  # voted to the end: the same symbols and tally as from the positions
            assert np.array_equal(votes[first[i]:first[i + 1]], expected), i
            assert np.array_equal(tally[i], whole), i
        else:
            _assert_stopped_early(votes[first[i]:first[i + 1]], tally[i], pairs, b != t, int(cols[i]))
    assert tally[0, 2] == (changed == 1.0) and tally[2, 2] == tally[3, 2] == tally[4, 2] == 0


def _assert_stopped_early(votes, tally, pairs, changed, cols):
    """A tensor whose scan stopped voting (random steps: its columns agree half the time) stopped
    at the end of the first part where EARLY_VOTED of its changes met a counter and fewer than
    EARLY_AGREEMENT of those agreed: its symbols up to there, and its tally, are the positions'."""
    positions = np.flatnonzero(changed).astype(np.int64)
    for end in range(ec.HASH_PART, positions[-1] + ec.HASH_PART + 1, ec.HASH_PART):
        k = int(np.searchsorted(positions, end))
        made = np.empty(k, np.uint32)
        prefix = ec.vote_symbols_into(pairs[:k], positions[:k], cols, made)
        if prefix[0] >= ec.EARLY_VOTED and prefix[1] < ec.EARLY_AGREEMENT * prefix[0]:
            break
    else:
        raise AssertionError("the scan stopped voting where the rule says it should not")
    assert k < positions.size and np.array_equal(votes[:k], made)
    assert tally[0] == prefix[0] and tally[1] == prefix[1] and tally[2] == 1


def test_scan_votes_a_leaning_tensor_to_the_end():
    """Columns whose changes all move one way (each its own) are voted to the end, however many
    changes: the tally counts every change that met a counter as agreeing."""
    rng = np.random.default_rng(5)
    rows, cols = 96, 512
    b = (rng.integers(0x3C00, 0x3D00, rows * cols)).astype(np.uint16)
    up = rng.random(cols) < 0.5  # each column's way
    step = np.where(np.tile(up, rows), 1, -1)
    t = (b.astype(np.int64) + step).astype(np.uint16)  # positive values: +1 in the bits is one ULP up
    got = ec.analyze_many([b], [t], cols=np.array([cols], np.int64))
    votes, tally = got[3], got[-1]
    expected = np.empty(votes.size, np.uint32)
    whole = ec.vote_symbols_into(got[0], np.arange(b.size, dtype=np.int64), cols, expected)
    assert np.array_equal(votes, expected) and np.array_equal(tally[0], whole)
    assert tally[0, 2] == 0 and tally[0, 0] == tally[0, 1] == b.size - cols  # every change after a column's first


def test_scan_with_columns_checks_their_count():
    b = np.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="cols has 2 entries for 1 tensors"):
        ec.analyze_many([b], [b], cols=np.array([1, 2], np.int64))

