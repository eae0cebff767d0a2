"""What v5's history classes would cost the decoder's position scan (docs/design/temporal-contexts.md).

The design's speed risk, measured before any format work. v4's decoder finds a tensor's changes
in one scan of the base. Per 64-element block, each exponent class's members come from vector
comparisons, and the class's next bits of its rank bitmap are deposited there (PDEP). v5 adds
history classes:
- elements that one of the last 3 deltas changed, split by recency (1, 2, 3) and a coarse
  exponent half;
- the exponent classes keep only the elements without history.

The receiver holds the history either sparsely (the sorted positions of such elements and their
recency, merged per block into its recency masks) or densely (bit planes).

For one pair of a corpus (base step `--step`, history the three deltas before it), this builds
every form's rank bitmaps from the true changes and times the production v4 scan
(`exponent_classes.positions`) against prototypes of the v5 scan. Every form is checked to find
exactly the changed positions, on every tensor. It reports the time of
each over the whole checkpoint, min and median of `--repeat` runs on one core, interleaved. The
forms:
- `v4`: production;
- `v4-proto`: this prototype without history, its own baseline (its change stores are a plain
  loop, not production's unrolled one);
- `v5-sparse`: the recency masks merged per block from the sorted list;
- `v5-planes`: the recency held densely as two bit planes, three ANDs per block;
- `v5-planes-3`: the same with one history class per recency, no exponent split.

    python scripts/v5_scan_cost.py corpus/minilm-fp32-lr5e-6-wd
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numba as nb
import numpy as np
import torch
from safetensors.torch import load_file

from codec import tensors
from codec.methods import exponent_classes as ec
from codec.methods.exponent_classes import (BLOCK, MAX_CLASSES, _block_masks, _deposit, _funnel_right, _popcount,
                                            lane_bounds, trailing_zeros)

# The kernels are compiled each run, not cached: numba's on-disk cache cannot reload a module a
# test loads from its path (it records the module as '<dynamic>').
HISTORY = 3
FORMS = ("v4", "v4-proto", "v5-sparse", "v5-planes", "v5-planes-3")
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@nb.njit(nogil=True)
def _take(bits, at, guard, c, m):
    """Class c's next popcount(m) bits deposited at m's set bits; its cursor moves on."""
    p = at[c]
    w = min(p >> np.uint64(6), guard[c])
    at[c] = p + np.uint64(_popcount(m))
    return _deposit(_funnel_right(bits[w + _U1], bits[w], p), m)


@nb.njit(nogil=True)
def _scan_state(thresholds, start, lim):
    """`exponent_classes.scan_state` with cursors for the history classes too (nclass + 2 * HISTORY
    of them, past its MAX_CLASSES): (lanes, nclass, ge, at, guard)."""
    lanes = lane_bounds(thresholds)
    nclass = min(thresholds.size + 1, MAX_CLASSES)
    nall = nclass + 2 * HISTORY
    ge = np.zeros(MAX_CLASSES + 1, np.uint64)
    ge[0] = _ALL
    at = np.empty(nall, np.uint64)
    guard = np.empty(nall, np.uint64)
    for c in range(nall):
        at[c] = np.uint64(start[c] * 64)
        guard[c] = np.uint64(start[c] + lim[c])
    return lanes, nclass, ge, at, guard


@nb.njit(nogil=True)
def _split_history(bits, at, guard, nclass, r1, r2, r3, hi):
    """The six history classes' changes in a block: recency r's members below (h = 0) and at or
    above (h = 1) the coarse exponent bound whose mask is `hi`, class nclass + 2 * (r - 1) + h."""
    found = _take(bits, at, guard, nclass, r1 & ~hi)
    found |= _take(bits, at, guard, nclass + 1, r1 & hi)
    found |= _take(bits, at, guard, nclass + 2, r2 & ~hi)
    found |= _take(bits, at, guard, nclass + 3, r2 & hi)
    found |= _take(bits, at, guard, nclass + 4, r3 & ~hi)
    found |= _take(bits, at, guard, nclass + 5, r3 & hi)
    return found


@nb.njit(nogil=True)
def _store(found, o, out, k):
    """The positions of the block at o whose bits `found` has, appended to out from out[k]."""
    q = np.uint64(o)
    while found != _U0:
        out[k] = q + np.uint64(trailing_zeros(found))
        found &= found - _U1
        k += 1
    return k


@nb.njit(nogil=True)
def scan_v5(n, b, thresholds, coarse, hpos, hrec, bits, start, lim, out):
    """Positions of the changes of a tensor of n elements (b: its base in whole blocks) from the
    v5 classes' bitmaps: classes 0..nclass-1 are the exponent classes less every element with
    history, class nclass + 2 * (r - 1) + h the elements of recency r whose exponent class is
    >= coarse (h = 1) or below (h = 0). hpos / hrec: the sorted positions of the elements with
    history and their recency. Returns the count found."""
    lanes, nclass, ge, at, guard = _scan_state(thresholds, start, lim)
    hp = 0
    nh = hpos.size
    k = 0
    for o in range(0, b.size, BLOCK):
        _block_masks(b, o, lanes, ge)
        r1 = _U0
        r2 = _U0
        r3 = _U0
        end = o + BLOCK
        while hp < nh and hpos[hp] < end:  # the block's recency masks, branch-free per element
            bit = _U1 << np.uint64(hpos[hp] - o)
            r = hrec[hp]
            r1 |= bit & (_U0 - np.uint64(r == 1))
            r2 |= bit & (_U0 - np.uint64(r == 2))
            r3 |= bit & (_U0 - np.uint64(r == 3))
            hp += 1
        hist = r1 | r2 | r3
        found = _U0
        for c in range(nclass):
            found |= _take(bits, at, guard, c, ge[c] & ~ge[c + 1] & ~hist)
        if hist != _U0:  # a third of wd's blocks have none
            found |= _split_history(bits, at, guard, nclass, r1, r2, r3, ge[coarse])
        k = _store(found, o, out, k)
    return k


@nb.njit(nogil=True)
def scan_v5_planes(n, b, thresholds, coarse, lo, hi_, bits, start, lim, out):
    """`scan_v5` with the recency held densely instead: two bit planes, a word of each per block
    (recency = lo + 2 * hi), so a block's recency masks are three ANDs, no merge."""
    lanes, nclass, ge, at, guard = _scan_state(thresholds, start, lim)
    k = 0
    for o in range(0, b.size, BLOCK):
        _block_masks(b, o, lanes, ge)
        w = np.uint64(o >> 6)
        pl = lo[w]
        ph = hi_[w]
        r1 = pl & ~ph
        r2 = ph & ~pl
        r3 = pl & ph
        hist = pl | ph
        found = _U0
        for c in range(nclass):
            found |= _take(bits, at, guard, c, ge[c] & ~ge[c + 1] & ~hist)
        if coarse > 0:
            found |= _split_history(bits, at, guard, nclass, r1, r2, r3, ge[coarse])
        elif coarse == 0:  # one history class per recency (no exponent split)
            found |= _take(bits, at, guard, nclass, r1)
            found |= _take(bits, at, guard, nclass + 1, r2)
            found |= _take(bits, at, guard, nclass + 2, r3)
        k = _store(found, o, out, k)
    return k


def planes(rec: np.ndarray, padded: int) -> tuple[np.ndarray, np.ndarray]:
    """Recency as two bit planes of `padded` bits (a uint64 word per block each)."""
    full = np.zeros(padded, np.int64)
    full[: rec.size] = rec
    lo = np.packbits((full & 1).astype(np.uint8), bitorder="little").view(np.uint64)
    hi = np.packbits((full >> 1).astype(np.uint8), bitorder="little").view(np.uint64)
    return lo, hi


def bitmaps(classes: np.ndarray, changed: np.ndarray, nall: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank bitmaps of every class (the `rank_bitmaps` layout: regions in class order, each with
    two zero guard words): bit r of class c's region is set where class c's r-th element changed."""
    order = np.argsort(classes, kind="stable")
    counts = np.bincount(classes, minlength=nall)
    first = np.concatenate([[0], np.cumsum(counts)])
    rank = np.empty(classes.size, np.int64)
    rank[order] = np.arange(classes.size) - first[classes[order]]
    start = np.zeros(nall, np.int64)
    lim = np.zeros(nall, np.int64)
    words = 0
    per = []
    for c in range(nall):
        r = rank[changed & (classes == c)]
        lim[c] = (int(r.max()) >> 6) + 1 if r.size else 0
        start[c] = words
        words += lim[c] + 2
        per.append(r)
    bits = np.zeros(words, np.uint64)
    for c in range(nall):
        r = per[c]
        np.bitwise_or.at(bits, start[c] + (r >> 6), np.left_shift(np.uint64(1), (r & 63).astype(np.uint64)))
    return bits, start, lim


def load_bits(path: Path) -> dict[str, np.ndarray]:
    """A snapshot's BF16 tensors as flat uint16 arrays."""
    return {name: tensors.element_view(t).reshape(-1) for name, t in load_file(str(path)).items()
            if t.dtype == torch.bfloat16}


def prepare(corpus: Path, step: int) -> list[dict]:
    """Per tensor of the pair step -> step + 1: both forms' inputs, and the true changes."""
    files = sorted(corpus.glob("step_*.safetensors"))
    if not HISTORY <= step < len(files) - 1:
        raise SystemExit(f"{corpus}: --step must be in {HISTORY}..{len(files) - 2} (3 deltas before it, one after)")
    snaps = [load_bits(files[step - h]) for h in range(HISTORY, -1, -1)] + [load_bits(files[step + 1])]
    jobs = []
    for name, t in snaps[-1].items():
        b = snaps[-2][name].reshape(-1)
        t = t.reshape(-1)
        changed = b != t
        if not changed.any():
            continue
        thr, *_ = ec.analyze(b, t)
        nclass = thr.size + 1
        cls = ec.class_lut(thr)[(b >> 7) & 0xFF].astype(np.int64)
        rec = np.zeros(b.size, np.int64)
        for h in range(HISTORY):  # the delta h + 1 steps before the base
            moved = snaps[-2 - h][name].reshape(-1) != snaps[-3 - h][name].reshape(-1)
            rec[moved & (rec == 0)] = h + 1
        coarse = max(1, nclass // 2)
        v5cls = np.where(rec == 0, cls, nclass + 2 * (rec - 1) + (cls >= coarse))
        bb = ec.blocks(b)
        v4 = bitmaps(cls, changed, MAX_CLASSES)
        v4p = bitmaps(cls, changed, nclass + 2 * HISTORY)  # the prototype's region count
        v5 = bitmaps(v5cls, changed, nclass + 2 * HISTORY)
        v5r = bitmaps(np.where(rec == 0, cls, nclass + rec - 1), changed, nclass + 2 * HISTORY)
        hpos = np.flatnonzero(rec).astype(np.int64)
        jobs.append({"name": name, "n": b.size, "b": bb, "thr": thr, "coarse": coarse, "hpos": hpos,
                     "planes": planes(rec, bb.size), "empty": planes(np.zeros(0, np.int64), bb.size),
                     "hrec": rec[hpos].astype(np.uint8), "v4": v4, "v4p": v4p, "v5": v5, "v5r": v5r,
                     "true": np.flatnonzero(changed)})
    return jobs


def run(jobs: list[dict], form: str) -> float:
    start = time.process_time()
    for j in jobs:
        k = j["true"].size
        if form == "v4":
            bits, st, lim = j["v4"]
            found, status = ec.positions(j["n"], j["b"], j["thr"], bits, st, lim, k, np.zeros(0, np.uint16))
            if status:
                raise RuntimeError(f"{j['name']}: v4 scan status {status}")
        else:
            bits, st, lim = j["v5"]
            out = np.empty(k + BLOCK, np.int64)
            if form == "v5-sparse":
                got = scan_v5(j["n"], j["b"], j["thr"], j["coarse"], j["hpos"], j["hrec"], bits, st, lim, out)
            elif form == "v5-planes":
                lo, hi = j["planes"]
                got = scan_v5_planes(j["n"], j["b"], j["thr"], j["coarse"], lo, hi, bits, st, lim, out)
            elif form == "v4-proto":  # this prototype without history (empty planes): its own baseline
                lo, hi = j["empty"]
                bits, st, lim = j["v4p"]
                got = scan_v5_planes(j["n"], j["b"], j["thr"], -1, lo, hi, bits, st, lim, out)
            else:  # three history classes, by recency alone
                lo, hi = j["planes"]
                bits, st, lim = j["v5r"]
                got = scan_v5_planes(j["n"], j["b"], j["thr"], 0, lo, hi, bits, st, lim, out)
            found = out[:got]
        j["found_" + form] = found
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus", type=Path)
    p.add_argument("--step", type=int, default=3, help="the base step (the history is the 3 deltas before it)")
    p.add_argument("--repeat", type=int, default=9)
    a = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    jobs = prepare(a.corpus, a.step)
    for form in FORMS:  # compile, then check every tensor's positions
        run(jobs, form)
        for j in jobs:
            if not np.array_equal(j["found_" + form], j["true"]):
                raise RuntimeError(f"{j['name']}: the {form} scan found other positions")
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for _ in range(a.repeat):  # interleaved, so both see the same machine
        for form in times:
            times[form].append(run(jobs, form))
    n = sum(j["n"] for j in jobs)
    k = sum(j["true"].size for j in jobs)
    h = sum(j["hpos"].size for j in jobs)
    print(f"{a.corpus.name}, step {a.step} -> {a.step + 1}: {len(jobs)} changed tensors, {n} elements, "
          f"{k} changes ({100 * k / n:.2f}%), {h} with history ({100 * h / n:.2f}%); positions found exactly by both")
    for form, ts in times.items():
        print(f"  {form} scan: min {1e3 * min(ts):.1f} ms, median {1e3 * statistics.median(ts):.1f} ms")
    for form in FORMS[1:]:
        ratio = statistics.median(b / a_ for a_, b in zip(times["v4"], times[form]))
        print(f"  {form} / v4, median of paired runs: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
