"""How many bits each candidate context saves on a BF16 delta (issue #18): measure before coding.

For every pair of snapshots of the corpora given, the change mask and the values are costed under
several context models as *adaptive* code lengths: a Krichevsky-Trofimov (Dirichlet 1/2) estimator
per context, whose sequential code length depends only on the context's counts, so the learning
cost of every extra context is paid (no free two-pass tables). The mask is costed per (tensor,
context), as the codec sends per-tensor mask levels; the values per context over the whole
payload, as its value tables are payload-wide. A context that needs side information (the
row-activity bitmap) pays for it with its own adaptive code.

    python scripts/context_study.py corpus/minilm-fp32-lr1e-6 corpus/minilm-fp32-lr5e-6-wd ...
    python scripts/context_study.py --span 4 corpus/...     # pairs t -> t+4 (a host behind)

Prints bits per change of the mask and of the values under each model, and the saving against
the baseline (mask | base exponent, values | base exponent), which is what codec v3 codes.
Temporal contexts (the previous step's mask and direction at the same element) need a third
snapshot, so pairs start at the second step. With `--history H` they also look H steps back (a
receiver that kept the last H deltas' changes): how many of those steps changed the element,
how many steps ago it last changed, and the net direction, so pairs start at step H.

    python scripts/context_study.py --history 3 corpus/...
    python scripts/context_study.py --span 4 --history 3 --history-span 1 corpus/...  # one-step history
                                                                                       # before a 4-step jump
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from scipy.special import gammaln  # type: ignore[import-untyped]

LN2 = np.log(2.0)
VALUE_TOKENS = 64


def kt_binary_bits(n: np.ndarray, k: np.ndarray) -> float:
    """Adaptive (KT) code length of k ones among n binary symbols, summed over contexts."""
    n = n.astype(np.float64)
    k = k.astype(np.float64)
    z = n - k
    bits = (gammaln(n + 1.0) + 2 * gammaln(0.5) - gammaln(k + 0.5) - gammaln(z + 0.5)) / LN2
    return float(bits[n > 0].sum())


def kt_multi_bits(counts: np.ndarray) -> float:
    """Adaptive (KT, Dirichlet 1/2 over the symbols seen anywhere) code length, per context row."""
    counts = counts[:, counts.sum(axis=0) > 0].astype(np.float64)
    alphabet = counts.shape[1]
    n = counts.sum(axis=1)
    rows = (gammaln(n + alphabet / 2) - gammaln(alphabet / 2)
            + (alphabet * gammaln(0.5) - gammaln(counts + 0.5).sum(axis=1))) / LN2
    return float(rows[n > 0].sum())


def static_table_bits(counts: np.ndarray) -> float:
    """Bits of the codec's own kind of value model: two-pass tables normalised to 2**12 per
    context row (`rans.normalize_rows`), each symbol coded at -log2(freq / 2**12), plus the
    tables' bytes in the value-tables block layout (a key delta and a count per row, a token
    delta and a frequency varint per listed token)."""
    from codec import rans

    counts = counts[counts.sum(axis=1) > 0]
    freq = rans.normalize_rows(counts, 12)
    used = counts > 0
    code = float((counts[used] * (12 - np.log2(freq[used]))).sum())
    listed = freq > 0
    table = 2 * counts.shape[0] + listed.sum() + np.where(freq[listed] >= 128, 2, 1).sum()
    return code + 8.0 * float(table)


def ordered(bits: np.ndarray) -> np.ndarray:
    b = bits.astype(np.int64)
    return np.where(b & 0x8000, b ^ 0xFFFF, b ^ 0x8000)


def tokens(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The codec's value tokens (docs/FORMAT.md, Tokens) of zigzagged steps, and their raw bits."""
    u = u.astype(np.int64)
    n = np.floor(np.log2(np.maximum(u, 1))).astype(np.int64)
    n -= (np.left_shift(1, n) > u) & (u > 0)
    n += np.left_shift(1, n + 1) <= u
    big = u >= 8
    tok = np.where(big, 8 + 4 * (n - 3) + ((u >> np.maximum(n - 2, 0)) & 3), u)
    raw = np.where(big, n - 2, 0)
    return tok, raw


def zigzag(step: np.ndarray) -> np.ndarray:
    return np.where(step > 0, 2 * step - 2, -2 * step - 1)


Elem = dict[str, np.ndarray]


def element_contexts(b: np.ndarray, shape: tuple[int, ...], prev: np.ndarray | None) -> Elem:
    """Per element of one tensor: the fields contexts are built from."""
    exp = (b.astype(np.int64) >> 7) & 0xFF
    f: Elem = {"exp": exp, "sign": (b.astype(np.int64) >> 15) & 1, "m1": (b.astype(np.int64) >> 6) & 1,
               "m2": (b.astype(np.int64) >> 5) & 3, "m3": (b.astype(np.int64) >> 4) & 7}
    cols = shape[-1] if len(shape) >= 2 else b.size
    f["row"] = np.arange(b.size) // max(cols, 1)
    f["col"] = np.arange(b.size) % max(cols, 1)
    if prev is not None:  # previous step's direction: 0 unchanged, 1 up, 2 down (in value order)
        f["pdir"] = prev
    return f


def rate_buckets(exp: np.ndarray, ch: np.ndarray, group: np.ndarray, groups: int,
                 mcost: Callable[[np.ndarray], float]) -> float:
    """Mask bits with each group (row or column) given a bucket of its change rate relative to
    what the exponent model expects (observed / expected: < 1/2, < 1, < 2, more), the buckets sent
    as side information (an adaptive 4-symbol code over the groups), or the plain exponent model
    where that is cheaper."""
    m = max(256, int(exp.max()) + 1)
    n_e = np.bincount(exp, minlength=m)
    k_e = np.bincount(exp[ch], minlength=m)
    p = (k_e / np.maximum(n_e, 1))[exp]
    expected = np.bincount(group, weights=p, minlength=groups)
    seen = np.bincount(group[ch], minlength=groups)
    ratio = np.log2((seen + 0.5) / (expected + 0.5))
    bucket = np.digitize(ratio, [-1.0, 0.0, 1.0])
    side = kt_multi_bits(np.bincount(bucket, minlength=4)[None, :])
    return min(mcost(exp), side + mcost(exp * 4 + bucket[group]))


def saturating_votes(order: np.ndarray, cols: np.ndarray, dirs: np.ndarray, lim: int) -> np.ndarray:
    """Per change (in tensor order), its column's saturating counter before it: +1 per earlier
    change up, -1 per change down, held within [-lim, lim] (a model that forgets)."""
    out = np.zeros(order.size, np.int64)
    state: dict[int, int] = {}
    for j, col, dd in zip(order.tolist(), cols.tolist(), dirs.tolist()):
        v = state.get(col, 0)
        out[j] = v
        state[col] = max(-lim, min(lim, v + (1 if dd == 1 else -1)))
    return out


INACTIVE = 1000  # a shifted key of its own: a group with no change where some were expected


def fit_shifts(key: np.ndarray, ch: np.ndarray, group: np.ndarray, groups: int, lo: int, hi: int,
               inactive: bool) -> tuple[np.ndarray, float]:
    """Per group (row or column), an exponent shift in [lo, hi]: the group's rate relative to the
    per-key model, rounded to a power of two (a group changing twice as often behaves as if its
    exponents were one lower). With `inactive`, a group without changes gets its own symbol.
    Returns (shift per group, bits of the shifts as side information: an adaptive code)."""
    n_e = np.bincount(key, minlength=key.max() + 1)
    k_e = np.bincount(key[ch], minlength=key.max() + 1)
    p = (k_e / np.maximum(n_e, 1))[key]
    expected = np.bincount(group, weights=p, minlength=groups)
    seen = np.bincount(group[ch], minlength=groups)
    shift = np.clip(np.round(np.log2((seen + 0.5) / (expected + 0.5))), lo, hi).astype(np.int64)
    symbols = shift - lo
    if inactive:
        symbols = np.where(seen == 0, hi - lo + 1, symbols)
        shift = np.where(seen == 0, INACTIVE, shift)
    side = kt_multi_bits(np.bincount(symbols, minlength=hi - lo + 2)[None, :])
    return shift, side


def shifted(key: np.ndarray, shift: np.ndarray) -> np.ndarray:
    return np.where(shift >= INACTIVE, 2 * INACTIVE, key + 4 - np.minimum(shift, INACTIVE))


def history_fields(history: list[np.ndarray]) -> Elem:
    """Per element, from the steps (in value order) of the H deltas before the base, most recent
    first: `count` (how many changed it), `recency` (1 + steps since its last change, 0 where none
    did: with `lastdir`, a 3-bit state a receiver could keep per element and update from each
    delta it applies), `lastdir` (that change's direction, +1 or -1, 0 where none) and `net` (the
    sum of the directions)."""
    count = np.zeros(history[0].size, np.int64)
    net = np.zeros(history[0].size, np.int64)
    recency = np.zeros(history[0].size, np.int64)
    lastdir = np.zeros(history[0].size, np.int64)
    for h, step in enumerate(history):
        moved = step != 0
        count += moved
        net += np.sign(step)
        first = moved & (recency == 0)
        recency[first] = h + 1
        lastdir[first] = np.sign(step[first])
    return {"count": count, "recency": recency, "lastdir": lastdir, "net": net}


def run_pair(base: dict, target: dict, before: list[dict]) -> dict:
    """Bits of every model on one pair (before: the snapshots preceding base, most recent first,
    for temporal contexts; empty for none)."""
    mask: dict[str, float] = {}
    value_counts: dict[str, dict[int, np.ndarray]] = {}
    raw_bits = 0.0
    changes = 0
    elements = 0

    def add_mask(name: str, cost: float) -> None:
        mask[name] = mask.get(name, 0.0) + cost

    def add_values(name: str, ctx: np.ndarray, tok: np.ndarray) -> None:
        table = value_counts.setdefault(name, {})
        key = ctx * VALUE_TOKENS + tok
        u, c = np.unique(key, return_counts=True)
        for kk, cc in zip(u.tolist(), c.tolist()):
            row = table.setdefault(kk // VALUE_TOKENS, np.zeros(VALUE_TOKENS, np.int64))
            row[kk % VALUE_TOKENS] += cc

    for ti, (name, t) in enumerate(target.items()):
        if t.dtype != np.uint16 or name not in base:
            continue
        b = base[name].reshape(-1)
        tt = t.reshape(-1)
        shape = tuple(t.shape) if t.ndim else (1,)
        elements += b.size
        ch = b != tt
        k = int(ch.sum())
        changes += k
        prev = None
        hist: Elem | None = None
        if before:
            later = b
            steps = []
            for snap_ in before:  # the steps of the deltas before base, most recent first
                earlier = snap_[name].reshape(-1)
                steps.append(ordered(later) - ordered(earlier))
                later = earlier
            prev = np.where(steps[0] == 0, 0, np.where(steps[0] > 0, 1, 2))
            if len(steps) > 1:
                hist = history_fields(steps)
        f = element_contexts(b, shape, prev)

        def mcost(ctx: np.ndarray, sel: np.ndarray | None = None, ch: np.ndarray = ch) -> float:
            c = ctx if sel is None else ctx[sel]
            chs = ch if sel is None else ch[sel]
            if c.size == 0:
                return 0.0
            m = int(c.max()) + 1
            return kt_binary_bits(np.bincount(c, minlength=m), np.bincount(c[chs], minlength=m))

        exp = f["exp"]
        add_mask("exp", mcost(exp))
        add_mask("exp+m1", mcost(exp * 2 + f["m1"]))
        add_mask("exp+m2", mcost(exp * 4 + f["m2"]))
        add_mask("exp+m3", mcost(exp * 8 + f["m3"]))
        add_mask("exp+sign", mcost(exp * 2 + f["sign"]))
        if prev is not None:
            add_mask("exp+prev", mcost(exp * 3 + prev))
            pr = np.zeros(int(f["row"].max()) + 1, bool)
            pr[f["row"][prev != 0]] = True
            add_mask("exp+prevrow", mcost(exp * 2 + pr[f["row"]]))
        if hist is not None:
            hn = len(before)
            add_mask(f"exp+count{hn}", mcost(exp * (hn + 1) + hist["count"]))
            add_mask(f"exp+recency{hn}", mcost(exp * (hn + 1) + hist["recency"]))
            add_mask(f"exp+prev+count{hn}", mcost((exp * 2 + (prev != 0)) * (hn + 1) + hist["count"]))
            # the codec's own mask classes (at most 8 exponent intervals, chosen as the encoder
            # does), then v5's history classes beside them (docs/design/temporal-contexts.md): the
            # elements with history left out of their interval and coded as classes of their own,
            # one per recency (3) or per recency and exponent half (6)
            from codec.methods import exponent_classes as ec

            thr = ec.analyze(b, tt)[0]
            cls = ec.class_lut(thr)[exp].astype(np.int64)
            rc = hist["recency"]
            half = (cls >= max(1, (thr.size + 1) // 2)).astype(np.int64)
            add_mask("classes", mcost(cls))
            add_mask(f"classes+{hn} recency classes", mcost(np.where(rc == 0, cls, 8 + rc - 1)))
            add_mask(f"classes+{2 * hn} recency x half classes", mcost(np.where(rc == 0, cls, 8 + 2 * (rc - 1) + half)))
            add_mask(f"classes x recency{hn}", mcost(cls * (hn + 1) + rc))
            # recency as an exponent shift instead (the scan keeps at most 8 interval classes): per
            # tensor and recency r, a shift s_r in [-4, 4] added to the exponent of the elements
            # of recency r (a recently changed element behaves like one of another binade), fitted
            # greedily; then the intervals chosen on the shifted keys from full statistics, beside
            # the same choice on the plain exponents
            def intervals(key: np.ndarray, ch: np.ndarray = ch) -> np.ndarray:
                n_e = np.bincount(key, minlength=256)[:256]
                k_e = np.bincount(key[ch], minlength=256)[:256]
                return ec.class_lut(ec.choose_classes(n_e, k_e, ec.MAX_CLASSES))[key].astype(np.int64)

            shifts = np.zeros(hn + 1, np.int64)
            for r in range(1, hn + 1):
                best = None
                for sh in range(-4, 5):
                    shifts[r] = sh
                    c_ = mcost(np.clip(exp + shifts[rc], 0, 255))
                    if best is None or c_ < best[0]:
                        best = (c_, sh)
                shifts[r] = best[1]
            skey = np.clip(exp + shifts[rc], 0, 255)
            add_mask("intervals (full stats)", mcost(intervals(exp)))
            add_mask(f"intervals of exp+shift(recency{hn})", mcost(intervals(skey)) + 4.0 * hn)
            add_mask(f"exp+shift(recency{hn})", mcost(skey) + 4.0 * hn)
            # the temporal state mixed with the column rate bucket (both together: what a v5 would code)
            if int(f["row"].max()) > 0 and k:
                rkey = exp * (hn + 1) + hist["recency"]
                add_mask(f"exp+recency{hn}*colrate4", rate_buckets(rkey, ch, f["col"], int(f["col"].max()) + 1, mcost))
            else:
                add_mask(f"exp+recency{hn}*colrate4", mcost(exp * (hn + 1) + hist["recency"]))
        # row activity sent as side information: an adaptive bit per row, then the mask of the
        # active rows only (elements of inactive rows cost nothing)
        rows = int(f["row"].max()) + 1
        active = np.zeros(rows, bool)
        active[f["row"][ch]] = True
        side = kt_binary_bits(np.array([rows]), np.array([int(active.sum())])) if rows > 1 else 0.0
        inrow = active[f["row"]]
        add_mask("exp|rows", side + mcost(exp, inrow))
        add_mask("best(exp, exp|rows)", min(mcost(exp), side + mcost(exp, inrow)))
        cols = int(f["col"].max()) + 1
        cact = np.zeros(cols, bool)
        cact[f["col"][ch]] = True
        cside = kt_binary_bits(np.array([cols]), np.array([int(cact.sum())])) if cols > 1 and rows > 1 else 0.0
        add_mask("best(exp, exp|cols)", min(mcost(exp), cside + mcost(exp, cact[f["col"]])))
        # shifted exponents: per-column and per-row rate multipliers (powers of two) folded into
        # the key the mask classes are drawn from, with inactive rows as a key of their own
        if rows > 1 and k:
            plain = mcost(exp)
            cs, cside = fit_shifts(exp, ch, f["col"], cols, -2, 2, False)
            kc = shifted(exp, cs[f["col"]])
            add_mask("best(exp, exp-colshift)", min(plain, cside + mcost(kc)))
            rs, rside = fit_shifts(exp, ch, f["row"], rows, -2, 2, True)
            add_mask("best(exp, exp-rowshift)", min(plain, rside + mcost(shifted(exp, rs[f["row"]]))))
            rs2, rside2 = fit_shifts(kc, ch, f["row"], rows, -2, 2, True)
            both = cside + rside2 + mcost(shifted(kc, rs2[f["row"]]))
            add_mask("best(exp, -col-rowshift)", min(plain, both))
        else:
            for m in ("best(exp, exp-colshift)", "best(exp, exp-rowshift)", "best(exp, -col-rowshift)"):
                add_mask(m, mcost(exp))
        # per-row (per-column) rate relative to the exponent model, sent as a 2-bit bucket per row
        # (column) and mixed with the exponent: how much rate structure rows and columns hold
        for axis, cnt in (("row", rows), ("col", cols)):
            if rows > 1 and k:
                add_mask(f"exp*{axis}rate4", rate_buckets(exp, ch, f[axis], cnt, mcost))
        if k == 0:
            continue
        where = np.flatnonzero(ch)
        step = ordered(tt[where]) - ordered(b[where])
        tok, raw = tokens(zigzag(step))
        raw_bits += float(raw.sum())
        e = exp[where]
        add_values("exp", e, tok)
        add_values("exp+sign", e * 2 + f["sign"][where], tok)
        add_values("exp+m1", e * 2 + f["m1"][where], tok)
        add_values("exp+m2", e * 4 + f["m2"][where], tok)
        add_values("tensor*exp", e + 256 * ti, tok)
        # causal spatial contexts the value phase has (values are decoded in tensor order): the
        # direction of the previous change in the same row, and in the same column
        d = np.where(step > 0, 1, 2)
        r = f["row"][where]
        c = f["col"][where]
        rowdir = np.zeros(k, np.int64)
        same = np.flatnonzero(r[1:] == r[:-1]) + 1
        rowdir[same] = d[same - 1]
        order = np.lexsort((r, c))  # by column, then row: each change after the one above it
        coldir = np.zeros(k, np.int64)
        sc = np.flatnonzero(c[order][1:] == c[order][:-1]) + 1
        coldir[order[sc]] = d[order[sc - 1]]
        # the column's running vote (ups minus downs among its earlier changes), bucketed
        cs_ = c[order]
        sgn = np.where(d[order] == 1, 1, -1)
        run = np.cumsum(sgn)
        start = np.r_[0, np.flatnonzero(cs_[1:] != cs_[:-1]) + 1]
        before_ = run - sgn  # inclusive sum less this change
        base_run = np.repeat(np.r_[0, run][start], np.diff(np.r_[start, k]))
        vote = np.zeros(k, np.int64)
        vote[order] = np.clip(before_ - base_run, -2, 2) + 2
        last2 = np.zeros(k, np.int64)
        sc2 = np.flatnonzero((cs_[2:] == cs_[:-2])) + 2
        last2[order[sc2]] = d[order[sc2 - 2]]
        add_values("exp+colvote5", e * 5 + vote, tok)
        raw_vote = np.zeros(k, np.int64)
        raw_vote[order] = before_ - base_run
        # the step flipped where the column's vote says down (then "up" is the predicted way),
        # the tables keyed by the exponent and the vote's strength
        flip = np.where(raw_vote < 0, -step, step)
        ftok, _ = tokens(zigzag(flip))
        strength = np.minimum(np.abs(raw_vote), 4)
        add_values("flip: exp", e, ftok)
        add_values("flip: exp+|vote|5", e * 5 + strength, ftok)
        add_values("flip: exp+|vote|3", e * 3 + np.minimum(np.abs(raw_vote), 2), ftok)
        for lim in (2, 4, 8):  # a saturating counter per column instead of the whole vote
            sat = saturating_votes(order, c[order], d[order], lim)
            sflip = np.where(sat < 0, -step, step)
            stok, _ = tokens(zigzag(sflip))
            add_values(f"flip: exp+|sat{lim}|", e * (lim + 1) + np.abs(sat), stok)
            if prev is not None and lim == 4:
                # the previous step's direction at the element, relative to the way the vote
                # predicts (0 unchanged, 1 the predicted way, 2 against it), in the flipped frame
                pd = prev[where]
                rel = np.where(pd == 0, 0, np.where((pd == 1) == (sat >= 0), 1, 2))
                add_values("flip: exp+|sat4|+pdir", (e * (lim + 1) + np.abs(sat)) * 3 + rel, stok)
                pflip = np.where(pd == 2, -step, step)  # where the element last moved down, flip by it
                ptok, _ = tokens(zigzag(np.where(pd == 0, sflip, pflip)))
                add_values("flip by pdir else sat4: exp+|sat4|+[pdir]",
                           (e * (lim + 1) + np.abs(sat)) * 2 + (pd != 0), ptok)
                if hist is not None:
                    hn = len(before)
                    sctx = e * (lim + 1) + np.abs(sat)
                    # the 3-bit state: flip by the last direction seen, context its recency
                    ld, rc, nt = hist["lastdir"][where], hist["recency"][where], hist["net"][where]
                    ltok, _ = tokens(zigzag(np.where(ld < 0, -step, np.where(ld > 0, step, sflip))))
                    add_values(f"flip by lastdir{hn} else sat4: +|sat4|+recency", sctx * (hn + 1) + rc, ltok)
                    # the same with one context axis of 8 levels (fits v4's vote symbols, 256 x 8
                    # contexts): |sat4| where the element has no history, else 4 + its recency
                    lvl = np.where(rc > 0, lim + rc, np.abs(sat))
                    add_values(f"flip by lastdir{hn} else sat4: +(|sat4| or 4+recency)", e * (lim + hn + 1) + lvl, ltok)
                    # the net direction: flip by it where not 0, context its size
                    ntok, _ = tokens(zigzag(np.where(nt < 0, -step, np.where(nt > 0, step, sflip))))
                    add_values(f"flip by net{hn} else sat4: +|sat4|+|net|", sctx * (hn + 1) + np.abs(nt), ntok)
                    # flipped by the column, context the net's size and whether it agrees
                    rel = np.where(nt == 0, 0, np.where((nt > 0) == (sat >= 0), 1, 2))
                    add_values(f"flip sat4: +|sat4|+|net{hn}|+agrees", (sctx * (hn + 1) + np.abs(nt)) * 3 + rel, stok)
        for lim in (4, 8):
            add_values(f"exp+colvote{2 * lim + 1}", e * (2 * lim + 1) + np.clip(raw_vote, -lim, lim) + lim, tok)
        add_values("exp+coldir+coldir2", (e * 3 + coldir) * 3 + last2, tok)
        add_values("coldir", coldir, tok)
        add_values("exp+rowdir", e * 3 + rowdir, tok)
        add_values("exp+coldir", e * 3 + coldir, tok)
        add_values("exp+rowdir+coldir", (e * 3 + rowdir) * 3 + coldir, tok)
        add_values("exp+sign+rowdir+coldir", ((e * 2 + f["sign"][where]) * 3 + rowdir) * 3 + coldir, tok)
        if prev is not None:
            add_values("exp+pdir+rowdir+coldir", ((e * 3 + prev[where]) * 3 + rowdir) * 3 + coldir, tok)
            add_values("exp+pdir", e * 3 + prev[where], tok)
            add_values("exp+sign+pdir", (e * 2 + f["sign"][where]) * 3 + prev[where], tok)
    values = {}
    for name, table in value_counts.items():
        values[name] = kt_multi_bits(np.stack(list(table.values()))) + raw_bits
        values[name + " (tables)"] = static_table_bits(np.stack(list(table.values()))) + raw_bits
    return {"elements": elements, "changes": changes, "mask": mask, "values": values}


def load_bits(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's BF16 tensors as uint16 (safetensors.numpy has no bfloat16)."""
    import torch
    from safetensors.torch import load_file as load_torch

    out = {}
    for k, v in load_torch(str(path)).items():
        if v.dtype == torch.bfloat16:
            out[k] = v.contiguous().view(torch.int16).numpy().view(np.uint16)
    return out


def study(corpus: Path, span: int, first: int, limit: int, history: int = 1,
          history_span: int | None = None) -> list[dict]:
    """Pairs t -> t + span from t = first on; the history is the `history` deltas of
    `history_span` steps each (default span) before t."""
    hs = span if history_span is None else history_span
    files = sorted(corpus.glob("step_*.safetensors"))
    rows: list[dict] = []
    cache: dict[int, dict] = {}

    def snap(i: int) -> dict:
        if i not in cache:
            cache[i] = load_bits(files[i])
            for old in [j for j in cache if j < i - hs * history]:
                del cache[old]
        return cache[i]

    for t in range(first, len(files) - span):
        if len(rows) >= limit:
            break
        before = [snap(t - hs * h) for h in range(1, history + 1) if t - hs * h >= 0]
        r = run_pair(snap(t), snap(t + span), before)
        r["pair"] = f"{files[t].stem}->{files[t + span].stem}"
        rows.append(r)
    return rows


def report(name: str, rows: list[dict], out: Callable[[str], None]) -> dict:
    k = sum(r["changes"] for r in rows)
    n = sum(r["elements"] for r in rows)
    mask = {m: sum(r["mask"].get(m, 0.0) for r in rows) / k for m in rows[0]["mask"]}
    vals = {m: sum(r["values"].get(m, 0.0) for r in rows) / k for m in rows[0]["values"]}
    base = mask["exp"] + vals["exp"]
    out(f"## {name}: {len(rows)} pairs, {100 * k / n:.3f}% changed; baseline {mask['exp']:.3f} mask + "
        f"{vals['exp']:.3f} value = {base:.3f} bits/change")
    for m, v in mask.items():
        out(f"  mask   {m:<22} {v:7.3f} bits/change  total saving {100 * (mask['exp'] - v) / base:+6.2f}%")
    for m, v in vals.items():
        out(f"  values {m:<22} {v:7.3f} bits/change  total saving {100 * (vals['exp'] - v) / base:+6.2f}%")
    return {"corpus": name, "changed_fraction": k / n, "mask": mask, "values": vals}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpora", nargs="+", type=Path)
    p.add_argument("--span", type=int, default=1, help="steps between base and target (4: a host behind)")
    p.add_argument("--pairs", type=int, default=3, help="pairs per corpus")
    p.add_argument("--history", type=int, default=1, help="deltas before the base that temporal contexts see")
    p.add_argument("--history-span", type=int, help="steps per history delta (default --span; 1 with --span 4: "
                   "a host that followed the chain until it fell behind)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    a = p.parse_args(argv)
    results = []
    for c in a.corpora:
        if a.history_span is not None:
            rows = study(c, a.span, a.history * a.history_span, a.pairs, a.history, a.history_span)
        else:
            rows = study(c, a.span, a.history if a.span == 1 else a.history - 1, a.pairs, a.history)
        if not rows:
            print(f"{c}: too few snapshots for span {a.span}", file=sys.stderr)
            continue
        results.append(report(f"{c.name} (span {a.span})", rows, print))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
