"""What decoding rANS symbols in SIMD-style lanes would save (docs/design/temporal-contexts.md).

Profiling wd put ~10 ms of decode in per-change work, ~6-7 ns per rANS symbol: scalar code
bound by its instruction count. Would a format with more interleaved states, decoded as vector
lanes, be much faster? This measures that before any format work, on the gap symbols' real
tables (`conditional.mask_tables`, one level), tokens only (neither form reads the raw bits a
gap token carries):
- `scalar-4`: the production form. Four 64-bit states over one stream of 32-bit words, rotating
  per symbol, renormalised branch-free (as `_decode_gaps`);
- `grouped-4`: the production stream itself, decoded four symbols at a time (four decode steps,
  then the four pulls in order): the same words in the same order, so no format change;
- `lanes-N`: N 32-bit states (N = 8, 16), symbol i in lane i mod N, 16-bit words, each lane
  renormalising at most once per symbol (ryg_rans's SIMD layout). The decode step is one loop
  over the lanes, which LLVM may vectorise (gathers for the tables); the renormalisation is a
  prefix count over the lanes needing a word.

Each form's stream is encoded here, and each decode is checked to give back exactly the symbols
drawn. It reports ns per symbol, min and median of `--repeat` runs on one core, interleaved,
and each lane form against `scalar-4`.

    python scripts/rans_lanes_cost.py --symbols 1000000 --level 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numba as nb
import numpy as np

from codec import rans
from codec.methods import conditional

SCALE = conditional.MASK_SCALE
L64 = rans.RANS_L  # the production states: [2**31, 2**63), 32-bit words
L32 = 1 << 16  # the lane states: [2**16, 2**32), 16-bit words


@nb.njit(cache=False)
def _encode_scalar4(syms, freq, cum):
    """The production layout: symbol i on state i mod 4, encoded last symbol first."""
    words = np.empty(syms.size + 16, np.uint32)
    nw = 0
    xs = np.full(4, L64, np.int64)
    for i in range(syms.size - 1, -1, -1):
        s = syms[i]
        f = np.int64(freq[s])
        x = xs[i & 3]
        bound = ((L64 >> SCALE) << 32) * f
        if x >= bound:
            words[nw] = np.uint32(x & 0xFFFFFFFF)
            nw += 1
            x >>= 32
        xs[i & 3] = ((x // f) << SCALE) + (x % f) + cum[s]
    return words[:nw][::-1].copy(), xs


@nb.njit(cache=False)
def _decode_scalar4(n, words, xs, freq, cum, slot_sym, out):
    """`_decode_gaps`' hot loop without raw bits: rotating states, branch-free pulls."""
    x, o1, o2, o3 = xs[0], xs[1], xs[2], xs[3]
    pos = 0
    mmask = (1 << SCALE) - 1
    last = words.size - 1
    for i in range(n):
        slot = x & mmask
        t = np.uint64(slot_sym[np.uint64(slot)])
        x = np.int64(freq[t]) * (x >> SCALE) + slot - cum[t]
        e = np.int64(x < L64)
        w = np.int64(words[np.uint64(min(pos, last))])
        x = (x << (32 * e)) | (w & -e)
        pos += e
        out[i] = t
        x, o1, o2, o3 = o1, o2, o3, x
    return pos


@nb.njit(cache=False)
def _decode_grouped4(n, words, xs0, freq, cum, slot_sym, out):
    """The production stream (`_encode_scalar4`'s words, the same ones in the same order), decoded
    four symbols at a time: the four decode steps, then the four pulls in order. A state's pull
    never feeds another state's step, so the words are taken exactly as the rotation takes them."""
    xs = xs0.copy()
    need = np.empty(4, np.int64)
    pos = 0
    mmask = (1 << SCALE) - 1
    last = words.size - 1
    for g in range(0, n, 4):
        for lane in range(4):
            x = xs[lane]
            slot = x & mmask
            t = np.uint64(slot_sym[np.uint64(slot)])
            x = np.int64(freq[t]) * (x >> SCALE) + slot - cum[t]
            xs[lane] = x
            need[lane] = np.int64(x < L64)
            out[g + lane] = t
        for lane in range(4):
            e = need[lane]
            w = np.int64(words[np.uint64(min(pos, last))])
            xs[lane] = (xs[lane] << (32 * e)) | (w & -e)
            pos += e
    return pos


@nb.njit(cache=False)
def _encode_lanes(syms, freq, cum, lanes):
    """Symbol i on lane i mod `lanes`; encoded in reverse, lanes in reverse within a group, so
    that the decoder reads words forward, lanes in order."""
    words = np.empty(syms.size + 4 * lanes, np.uint16)
    nw = 0
    xs = np.full(lanes, L32, np.int64)
    for i in range(syms.size - 1, -1, -1):
        s = syms[i]
        f = np.int64(freq[s])
        lane = i % lanes
        x = xs[lane]
        bound = ((L32 >> SCALE) << 16) * f
        if x >= bound:
            words[nw] = np.uint16(x & 0xFFFF)
            nw += 1
            x >>= 16
        xs[lane] = ((x // f) << SCALE) + (x % f) + cum[s]
    return words[:nw][::-1].copy(), xs.astype(np.uint32)


def _lane_decoder(lanes: int):
    """A decoder for `lanes` lanes: its lane loops have constant trip counts, for LLVM to vectorise."""

    @nb.njit(cache=False)
    def decode(n, words, xs0, freq, cum, slot_sym, out):
        xs = xs0.copy()
        need = np.empty(lanes, np.uint32)
        pos = 0
        last = words.size - 1
        mmask = np.uint32((1 << SCALE) - 1)
        for g in range(0, n, lanes):
            for lane in range(lanes):  # the decode step: independent lanes
                x = xs[lane]
                slot = x & mmask
                t = slot_sym[slot]
                x = np.uint32(freq[t]) * (x >> np.uint32(SCALE)) + slot - np.uint32(cum[t])
                xs[lane] = x
                need[lane] = np.uint32(x < np.uint32(L32))
                out[g + lane] = t
            for lane in range(lanes):  # the pulls: a lane needing a word takes the next one
                e = need[lane]
                w = np.uint32(words[min(pos, last)])
                xs[lane] = (xs[lane] << (np.uint32(16) * e)) | (w & (np.uint32(0) - e))
                pos += np.int64(e)
        return pos

    return decode


def _timed(fn, *args) -> float:
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--symbols", type=int, default=1 << 20, help="symbols per run (a multiple of 16)")
    ap.add_argument("--level", type=int, default=40, help="the mask level whose table is used")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    n = args.symbols // 16 * 16
    mfreq, mcum, mslot = conditional.mask_tables()
    freq, cum, slot_sym = mfreq[args.level], mcum[args.level], mslot[args.level]
    p = freq / freq.sum()
    syms = np.random.default_rng(0).choice(len(freq), size=n, p=p).astype(np.int64)
    bits = float(-(np.log2(p[syms])).mean())
    forms = {}
    words, xs = _encode_scalar4(syms, freq, cum)
    forms["scalar-4"] = (_decode_scalar4, words, xs, words.nbytes)
    forms["grouped-4"] = (_decode_grouped4, words, xs, words.nbytes)
    for lanes in (8, 16):
        words16, xs16 = _encode_lanes(syms, freq, cum, lanes)
        forms[f"lanes-{lanes}"] = (_lane_decoder(lanes), words16, xs16, words16.nbytes)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for name, (fn, w, x, _) in forms.items():  # compile, and check every form gives the symbols back
        out = np.empty(n, np.uint8)
        used = fn(n, w, x, freq, cum, slot_sym, out)
        if not np.array_equal(out, syms) or used != w.size:
            raise SystemExit(f"{name}: decode did not give the symbols back")
    out = np.empty(n, np.uint8)
    for _ in range(args.repeat):
        for name, (fn, w, x, _) in forms.items():
            times[name].append(_timed(fn, n, w, x, freq, cum, slot_sym, out))
    print(f"mask level {args.level}: {n} symbols, {bits:.2f} bits each (tokens only)")
    ref = statistics.median(times["scalar-4"])
    for name, (_, _, _, nbytes) in forms.items():
        med = statistics.median(times[name])
        print(f"  {name:9s} min {min(times[name]) / n * 1e9:5.2f} ns/symbol, median {med / n * 1e9:5.2f}; "
              f"{ref / med:4.2f}x scalar-4; stream {8 * nbytes / n:.2f} bits/symbol")


if __name__ == "__main__":
    main()
