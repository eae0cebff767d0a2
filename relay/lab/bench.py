"""`deltarelay bench`: our codec against the anchors' formats on consecutive checkpoints, in one run.

For every consecutive pair of every corpus (relay.lab.corpus writes them) it encodes and
decodes with deltarelay v1, v3 and v4 (the default) and every anchor (codec.lab.fireworks.select: the real
Fireworks ARCv2 / ARCv3 when `fireworks-delta-compression` is installed, and the
reimplementations in codec.lab.baselines of the formats that have no package), checks every
reconstruction bit for bit, and reports medians over pairs and repeats: payload size (percent
of the BF16 checkpoint, bytes per changed element, ratio to the ARCv3 reference, real ARCv3
where installed and ARCv3-style otherwise, and to the conditional entropy bound) and one-core
encode / decode speed (checkpoint MB per second; decode returns new tensors, output allocation
included; ours are also timed applying the payload in place with `codec.apply_`, which is what a
watcher does to the checkpoint it holds). zstd-1 on the raw target checkpoint, timed in the same
run, is the speed yardstick: each method's encode, decode (and apply) is paired with a zstd-1
compression timed just before it, its speed ratios are medians of those pairs' ratios, and its
speed against ARCv3 is the quotient of the two methods' yardstick ratios. (On a shared machine
the speed of everything drifts by tens of percent over seconds; timings seconds apart would
compare different machines.)

One core: torch and numba run one thread, and every thread of the process is pinned to one CPU
(sched_setaffinity) while the one-core rows are timed, so that ARCv3's candidate threads and
its multi-threaded zstd share that CPU as our codec does; times are process CPU time.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file

import codec
from codec import tensors
from codec.lab import fireworks
from codec.lab.bound import conditional_entropy_bound
from relay.lab import corpus

Tensors = Mapping[str, torch.Tensor]
# What the table says of its reference column, by key.
REFERENCE_NAMES = {"arc_v3": "real ARCv3 (fireworks-delta-compression {version}, default race)",
                   "arcv3": "ARCv3-style reimplementation (codec.lab.baselines)"}


def corpus_files(directory: str | Path) -> list[Path]:
    files = sorted(Path(directory).glob("step_*.safetensors"))
    if len(files) < 2:
        raise ValueError(f"{directory}: a corpus needs at least two step_*.safetensors files, found {len(files)}")
    return files


def _methods(slow: bool) -> tuple[list[tuple[str, str, Callable, Callable]], str, dict[str, str]]:
    """(key, label, encode, decode) for every method the bench runs, ours first; the reference's
    key; the anchors that cannot run here, with the reason."""
    ours = [
        ("deltarelay-v1", "deltarelay v1", lambda b, t: codec.encode(b, t, format_version=1), codec.decode),
        ("deltarelay-v3", "deltarelay v3", lambda b, t: codec.encode(b, t, format_version=3), codec.decode),
        # v4: the default
        ("deltarelay-v4", "deltarelay v4", lambda b, t: codec.encode(b, t, format_version=4), codec.decode),
    ]
    chosen, reference, not_run = fireworks.select(slow)
    return ours + [(b.key, b.label, b.encode, b.decode) for b in chosen.values()], reference, not_run


def identical(a: Tensors, b: Tensors) -> bool:
    """Same names, dtypes, shapes and bits."""
    if set(a) != set(b):
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            return False
        if not np.array_equal(tensors.element_view(x), tensors.element_view(y)):
            return False
    return True


# CPU time of this process: with torch and numba pinned to one thread it is one core's time, and
# unlike wall time it does not count what other processes on a shared machine take from us.
# Multi-core rows (`--workers`) are timed on the wall clock instead.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _timed(fn: Callable, *args, clock: Callable[[], float] | None = None):
    clock = clock or _clock
    start = clock()
    out = fn(*args)
    return out, clock() - start


def _changed_elements(base: Tensors, target: Tensors) -> int:
    return int(sum(np.count_nonzero(tensors.element_view(base[k]) != tensors.element_view(v))
                   for k, v in target.items()))


class _Zstd1:
    """zstd-1 on the raw bytes of a target checkpoint: the speed yardstick."""

    def __init__(self, target: Tensors) -> None:
        self.raw = b"".join(tensors.element_view(v).tobytes() for v in target.values())
        self.comp, self.decomp = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def compress_seconds(self, clock: Callable[[], float] | None = None) -> float:
        return _timed(self.comp.compress, self.raw, clock=clock)[1]


def _raw_zstd(target: Tensors, repeat: int, clock: Callable[[], float] | None = None
              ) -> tuple[list[float], list[float], int]:
    """zstd-1 compress / decompress seconds on the raw bytes of the target checkpoint."""
    z = _Zstd1(target)
    enc, dec = [], []
    blob = b""
    for _ in range(repeat):
        blob, s = _timed(z.comp.compress, z.raw, clock=clock)
        enc.append(s)
        out, s = _timed(z.decomp.decompress, blob, clock=clock)
        dec.append(s)
        if out != z.raw:
            raise RuntimeError("zstd-1 did not round-trip the raw checkpoint")
    return enc, dec, len(blob)


class _SingleCore:
    """Pin torch and numba to one thread for the run, then put them back."""

    def __enter__(self):
        self.torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.numba_threads = None
        try:
            import numba

            self.numba_threads = numba.get_num_threads()
            numba.set_num_threads(1)
        except (ImportError, ValueError, RuntimeError):
            pass
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.torch_threads)
        if self.numba_threads is not None:
            import numba

            numba.set_num_threads(self.numba_threads)


class _OneCpu:
    """Pin every thread of this process to one CPU, then give every thread the process's mask back.

    Threads started meanwhile (ARCv3's candidate pools, zstd's workers) inherit the pin; all of
    them, new ones included, get the old mask back on exit, so multi-core rows are not pinned.
    Where the platform has no sched_setaffinity nothing is pinned (`cpu` is None).
    """

    def __init__(self) -> None:
        self.cpu: int | None = None
        self.mask: set[int] = set()

    @staticmethod
    def _set_all(cpus: set[int]) -> None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                pass

    def __enter__(self) -> _OneCpu:
        if hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task"):
            self.mask = os.sched_getaffinity(0)
            self.cpu = min(self.mask)
            self._set_all({self.cpu})
        return self

    def __exit__(self, *exc) -> None:
        if self.cpu is not None:
            self._set_all(self.mask)


def _multicore(base: Tensors, target: Tensors, workers: int, repeat: int) -> dict[int, tuple[list[float], list[float]]]:
    """Wall-clock encode / decode seconds of the default format with one thread and with `workers` threads,
    interleaved run by run so that both see the same machine (bit-exactness checked)."""
    times: dict[int, tuple[list[float], list[float]]] = {1: ([], []), workers: ([], [])}
    for _ in range(repeat):
        for w, (enc, dec) in times.items():
            payload, es = _timed(lambda w=w: codec.encode(base, target, workers=w), clock=time.perf_counter)
            out, ds = _timed(lambda w=w, payload=payload: codec.decode(base, payload, workers=w),
                             clock=time.perf_counter)
            if not identical(out, target):
                raise RuntimeError(f"deltarelay v{codec.FORMAT_VERSION} with {w} workers is not bit-exact")
            enc.append(es)
            dec.append(ds)
    return times


def _bench_corpus(directory: Path, repeat: int, pairs: int | None, slow: bool, log: Callable[[str], None],
                  workers: int = 0) -> dict:
    files = corpus_files(directory)
    if pairs is not None:
        files = files[: pairs + 1]
    meta_path = directory / "corpus.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    methods, reference, not_run = _methods(slow)
    per: dict[str, dict[str, list]] = {k: {"bytes": [], "per_changed": [], "vs_ref": [], "vs_bound": [],
                                           "percent": [], "enc": [], "dec": [], "enc_ratio": [], "dec_ratio": [],
                                           "app": [], "app_ratio": []}
                                       for k, *_ in methods}
    pin = _OneCpu()
    bounds, raw_enc, raw_dec, raw_sizes, changed_fracs = [], [], [], [], []
    mc_enc, mc_dec, mc_raw, one_enc, one_dec = [], [], [], [], []
    ckpt_bytes = 0
    base = load_file(str(files[0]))
    for i, path in enumerate(files[1:]):
        target = load_file(str(path))
        ckpt_bytes = sum(tensors.element_view(v).nbytes for v in target.values())
        changed = _changed_elements(base, target)
        numel = sum(v.numel() for v in target.values())
        changed_fracs.append(changed / numel if numel else 0.0)
        bound = conditional_entropy_bound(base, target)
        bounds.append(bound)
        with pin:
            if i == 0:  # warm up every codec once (numba JIT, allocator) before anything is timed
                for key, _, enc, dec in methods:
                    payload = enc(base, target)
                    dec(base, payload)
                    if key.startswith("deltarelay"):
                        codec.apply_({k: v.clone() for k, v in base.items()}, payload)
            e, d, size = _raw_zstd(target, repeat)
        raw_enc += e
        raw_dec += d
        raw_sizes.append(size)
        if workers > 1:
            times = _multicore(base, target, workers, repeat)
            one_enc += times[1][0]
            one_dec += times[1][1]
            mc_enc += times[workers][0]
            mc_dec += times[workers][1]
            mc_raw += _raw_zstd(target, repeat, clock=time.perf_counter)[0]
        sizes = {}
        yardstick = _Zstd1(target)
        with pin:
            for key, label, enc, dec in methods:
                lengths = []
                for _ in range(repeat):
                    # speed ratios pair each run with a zstd-1 run just before it (see module doc)
                    zs = yardstick.compress_seconds()
                    payload, es = _timed(enc, base, target)
                    out, ds = _timed(dec, base, payload)
                    per[key]["enc_ratio"].append(zs / es)
                    per[key]["dec_ratio"].append(zs / ds)
                    # every run: a racing encoder (ARCv3) may pick other candidates each time
                    if not identical(out, target):
                        raise RuntimeError(f"{label}: decode of {path.name} against {files[i].name} "
                                           "is not bit-exact")
                    per[key]["enc"].append(es)
                    per[key]["dec"].append(ds)
                    if key.startswith("deltarelay"):  # the watcher's path: in place on a held copy
                        held = {k: v.clone() for k, v in base.items()}
                        zs = yardstick.compress_seconds()
                        _, aps = _timed(codec.apply_, held, payload)
                        if not identical(held, target):
                            raise RuntimeError(f"{label}: apply_ of {path.name} to {files[i].name} "
                                               "is not bit-exact")
                        per[key]["app"].append(aps)
                        per[key]["app_ratio"].append(zs / aps)
                        del held
                    lengths.append(len(payload))
                sizes[key] = statistics.median_low(lengths)  # one a run produced
        for key, _, _, _ in methods:
            n = sizes[key]
            per[key]["bytes"].append(n)
            per[key]["percent"].append(100 * n / ckpt_bytes)
            per[key]["per_changed"].append(n / changed if changed else float("nan"))
            per[key]["vs_ref"].append(n / sizes[reference])
            per[key]["vs_bound"].append(n / bound["bytes"] if bound["bytes"] else float("nan"))
        log(f"{directory.name}: {path.name} done ({100 * changed_fracs[-1]:.3f}% changed)")
        base = target

    med = statistics.median
    mb = ckpt_bytes / 1e6
    rows = []
    ref_enc, ref_dec = med(per[reference]["enc_ratio"]), med(per[reference]["dec_ratio"])
    for key, label, *_ in methods:
        p = per[key]
        rows.append({
            "key": key, "method": label, "bytes": med(p["bytes"]), "percent": med(p["percent"]),
            "bytes_per_changed": med(p["per_changed"]), "vs_arcv3": med(p["vs_ref"]), "vs_bound": med(p["vs_bound"]),
            "encode_s": med(p["enc"]), "decode_s": med(p["dec"]),
            "encode_mbps": mb / med(p["enc"]), "decode_mbps": mb / med(p["dec"]), "exact": True,
            # speed against zstd-1 compressing the raw target (paired runs) and against the reference
            "encode_vs_zstd1": med(p["enc_ratio"]), "decode_vs_zstd1": med(p["dec_ratio"]),
            "encode_vs_arcv3": med(p["enc_ratio"]) / ref_enc, "decode_vs_arcv3": med(p["dec_ratio"]) / ref_dec,
            # in place (ours only): None for the anchors, which have no such path
            "apply_mbps": mb / med(p["app"]) if p["app"] else None,
            "apply_vs_zstd1": med(p["app_ratio"]) if p["app_ratio"] else None,
        })
    ref = next(r for r in rows if r["key"] == reference)
    bound_bytes = med([b["bytes"] for b in bounds])
    bound_row = {
        "key": "bound", "method": "entropy bound (mask|exponent + ULP step)", "bytes": bound_bytes,
        "percent": med([b["percent"] for b in bounds]),
        "bytes_per_changed": med([b["bits_per_changed"] / 8 for b in bounds]),
        "vs_arcv3": bound_bytes / ref["bytes"], "vs_bound": 1.0,
        "mask_bits_per_changed": med([b["mask_bits_per_changed"] for b in bounds]),
        "value_bits_per_changed": med([b["value_bits_per_changed"] for b in bounds]),
    }
    zstd = {"compress_mbps": mb / med(raw_enc), "decompress_mbps": mb / med(raw_dec),
            "percent": 100 * med(raw_sizes) / ckpt_bytes}
    # The yardstick is zstd-1 *compressing* the raw target (encode and decode alike), each of our
    # runs against the zstd-1 run just before it, median over runs; decode is also compared with
    # zstd-1 decompressing (medians of the separate timings), the stricter reading.
    speed = {r["key"]: {"encode": r["encode_vs_zstd1"], "decode": r["decode_vs_zstd1"], "apply": r["apply_vs_zstd1"],
                        "decode_vs_decompress": r["decode_mbps"] / zstd["decompress_mbps"]}
             for r in rows if r["key"].startswith("deltarelay")}
    multicore = None
    if workers > 1:
        multicore = {"workers": workers, "encode_mbps": mb / med(mc_enc), "decode_mbps": mb / med(mc_dec),
                     "zstd1_compress_mbps_wall": mb / med(mc_raw)}
        # against one thread timed the same way in the same loop (the one-core rows above are CPU
        # time, which leaves out waits a wall clock counts)
        multicore["encode_vs_one_core"] = med(one_enc) / med(mc_enc)
        multicore["decode_vs_one_core"] = med(one_dec) / med(mc_dec)
    version = fireworks.version() if reference == fireworks.REFERENCE else None
    return {
        "corpus": str(directory), "regime": meta.get("regime"),
        "settings": {k: meta.get(k) for k in ("model", "lr", "weight_decay", "master", "seed", "warmup", "batch",
                                              *corpus.REGIME_DEFAULTS, "input_vocab")},
        "reference": {"key": reference, "name": REFERENCE_NAMES[reference].format(version=version)},
        "not_run": not_run, "pinned_cpu": pin.cpu,
        "pairs": len(files) - 1, "repeat": repeat, "checkpoint_bytes": ckpt_bytes,
        "changed_fraction": med(changed_fracs), "changed_fraction_range": [min(changed_fracs), max(changed_fracs)],
        "rows": rows, "bound": bound_row, "zstd1_raw": zstd, "speed_vs_zstd1": speed, "multicore": multicore,
    }


def run_bench(corpus_dirs: Iterable[str | Path], repeat: int = 3, pairs: int | None = None, slow: bool = False,
              log: Callable[[str], None] | None = None, clock: str = "cpu", workers: int = 0) -> dict:
    """Bench every corpus directory; returns {"corpora": [per-corpus results], ...} (see module doc)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if pairs is not None and pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    dirs = [Path(d) for d in corpus_dirs]
    if not dirs:
        raise ValueError("no corpus directory given")
    for d in dirs:
        corpus_files(d)  # fail before any work on a bad path
    log = log or (lambda msg: None)
    global _clock
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}")
    _clock, saved = CLOCKS[clock], _clock
    try:
        with _SingleCore():
            corpora = [_bench_corpus(d, repeat, pairs, slow, log, workers) for d in dirs]
    finally:
        _clock = saved
    return {"threads": 1, "clock": clock, "repeat": repeat, "corpora": corpora}


def _non_default_settings(settings: Mapping) -> dict:
    """The regime settings (betas, loss, head, ...) a corpus set away from corpus.REGIME_DEFAULTS."""
    out = {}
    for key, default in corpus.REGIME_DEFAULTS.items():
        value = settings.get(key)
        if value is None:  # a corpus written before the setting existed
            continue
        if (list(value) != list(default)) if isinstance(default, tuple) else (value != default):
            out[key] = value
    return out


def format_table(results: dict) -> str:
    """The human-readable report: one table per corpus, then the speed comparison with zstd-1."""
    lines = []
    head = (f"{'method':44} {'size %':>8} {'B/chg':>6} {'/ARCv3':>7} {'/bound':>7} {'enc MB/s':>9} {'dec MB/s':>9} "
            f"{'enc/z1':>7} {'dec/z1':>7} {'enc/ARC':>8} {'dec/ARC':>8}")
    for c in results["corpora"]:
        s = c["settings"]
        lo, hi = c["changed_fraction_range"]
        extra = "".join(f", {k} {v}" for k, v in _non_default_settings(s).items())
        lines.append(f"corpus {c['corpus']}: {c['regime'] or 'custom'} (lr {s['lr']}, wd {s['weight_decay']}, "
                     f"master {s['master']}{extra}), {c['pairs']} pairs x {c['repeat']} repeats, "
                     f"{c['checkpoint_bytes'] / 1e6:.1f} MB checkpoint, changed {100 * c['changed_fraction']:.3f}% "
                     f"median ({100 * lo:.3f}-{100 * hi:.3f}%)")
        ref = c.get("reference") or {"name": "ARCv3-style reimplementation (codec.lab.baselines)"}
        lines.append(f"/ARCv3, enc/ARC, dec/ARC: against {ref['name']}; enc/z1, dec/z1: against zstd-1 compressing "
                     "the raw checkpoint, paired runs")
        lines.append(head)
        for r in c["rows"]:
            lines.append(f"{r['method']:44} {r['percent']:7.3f}% {r['bytes_per_changed']:6.2f} {r['vs_arcv3']:7.3f} "
                         f"{r['vs_bound']:7.2f} {r['encode_mbps']:9.1f} {r['decode_mbps']:9.1f} "
                         f"{r['encode_vs_zstd1']:7.3f} {r['decode_vs_zstd1']:7.3f} "
                         f"{r['encode_vs_arcv3']:8.2f} {r['decode_vs_arcv3']:8.2f}")
        for key, why in (c.get("not_run") or {}).items():
            lines.append(f"{key:44} not run: {why}")
        b = c["bound"]
        lines.append(f"{b['method']:44} {b['percent']:7.3f}% {b['bytes_per_changed']:6.2f} {b['vs_arcv3']:7.3f} "
                     f"{b['vs_bound']:7.2f} {'':>9} {'':>9}   ({b['mask_bits_per_changed']:.2f} mask + "
                     f"{b['value_bits_per_changed']:.2f} value bits per change)")
        z = c["zstd1_raw"]
        parts = [f"{k.replace('deltarelay-', '')} encode {v['encode']:.2f}x, decode {v['decode']:.2f}x "
                 f"({v['decode_vs_decompress']:.2f}x decompress), apply_ {v['apply']:.2f}x"
                 for k, v in c["speed_vs_zstd1"].items()]
        pinned = "" if c.get("pinned_cpu") is None else f" (CPU {c['pinned_cpu']}, every thread pinned)"
        lines.append(f"speed vs zstd-1 compressing the raw checkpoint ({z['compress_mbps']:.0f} MB/s; decompress "
                     f"{z['decompress_mbps']:.0f} MB/s; {z['percent']:.1f}% size), {results.get('clock', 'cpu')} time, "
                     f"one core{pinned}: " + "; ".join(parts))
        m = c.get("multicore")
        if m:
            lines.append(f"multi-core (wall clock): v{codec.FORMAT_VERSION} with {m['workers']} workers "
                         f"encodes {m['encode_mbps']:.0f} MB/s "
                         f"({m['encode_vs_one_core']:.2f}x one thread, same clock), "
                         f"decodes {m['decode_mbps']:.0f} MB/s ({m['decode_vs_one_core']:.2f}x); "
                         f"zstd-1 compress {m['zstd1_compress_mbps_wall']:.0f} MB/s wall")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def save_chart(results: dict, path: str | Path) -> Path:
    """PNG: per corpus, payload size (log scale) and encode / decode speed of every method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = results["corpora"]
    fig, axes = plt.subplots(len(corpora), 2, figsize=(14, 3.2 * len(corpora) + 0.6), squeeze=False)
    for row, c in enumerate(corpora):
        rows = c["rows"] + [c["bound"]]
        names = [r["method"] for r in rows]
        y = np.arange(len(rows))
        ax = axes[row][0]
        colors = ["tab:green" if r["key"].startswith("deltarelay") else "tab:gray" if r["key"] == "bound"
                  else "tab:blue" for r in rows]
        ax.barh(y, [r["percent"] for r in rows], color=colors)
        ax.set_xscale("log")
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("payload, % of the BF16 checkpoint (log)")
        ax.set_title(f"{c['regime'] or Path(c['corpus']).name}: size ({100 * c['changed_fraction']:.2f}% changed)",
                     fontsize=10)
        for yi, r in zip(y, rows):
            ax.annotate(f"{r['percent']:.3f}%", (r["percent"], yi), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax = axes[row][1]
        speed_rows = c["rows"]
        ys = np.arange(len(speed_rows))
        ax.barh(ys - 0.2, [r["encode_mbps"] for r in speed_rows], height=0.4, label="encode")
        ax.barh(ys + 0.2, [r["decode_mbps"] for r in speed_rows], height=0.4, label="decode")
        z = c["zstd1_raw"]
        ax.axvline(z["compress_mbps"], color="tab:red", ls="--", lw=1, label="zstd-1 raw compress")
        ax.axvline(z["decompress_mbps"], color="tab:purple", ls=":", lw=1, label="zstd-1 raw decompress")
        ax.set_xscale("log")
        ax.set_yticks(ys, [r["method"] for r in speed_rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("checkpoint MB/s, one core (log)")
        ax.set_title("speed", fontsize=10)
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def generate_corpus(parent: Path, tiny: bool, steps: int, log: Callable[[str], None]) -> Path:
    """The corpus `deltarelay bench` makes when given none: fp32-lr1e-6, in a new directory under `parent`."""
    out = parent / ("tiny-fp32-lr1e-6" if tiny else "minilm-fp32-lr1e-6")
    log(f"no corpus given: generating {'a tiny-model' if tiny else 'a MiniLM'} corpus ({steps} steps) in {out}")
    corpus.make_corpus(out, regime="fp32-lr1e-6", steps=steps, tiny=tiny, log=log)
    return out
