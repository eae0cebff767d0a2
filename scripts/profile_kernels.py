"""Where one codec operation spends its time, kernel by kernel, under `perf` (Linux).

    python scripts/profile_kernels.py corpus/minilm-fp32-lr5e-6-wd --op decode

For one pair of a corpus (steps `--step` and the next) this runs `--op` (encode, decode, or apply:
`codec.apply_` on a fresh clone of the base each time, the clone included) on one core in a loop
for `--seconds`, under `perf record`, and prints perf's report by symbol: numba kernels by name
(`codec.lab.perfmap`), the xxh3 and kernel (page zeroing) time beside them. Sampling runs only
during the loop (perf's control fifo), not while the kernels compile: they compile afresh into
an empty numba cache, since only a kernel compiled in the process has the symbols to name it.
The counters of this kind of VM are not exposed, so this samples the CPU clock.

The sample shares are of the whole process, Python included; `--keep FILE` keeps perf's data.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _codec_modules() -> list:
    """Every module of the codec outside its lab: the ones that define kernels."""
    import codec

    names = [m.name for m in pkgutil.walk_packages(codec.__path__, "codec.") if ".lab" not in m.name]
    return [importlib.import_module(n) for n in names]


def _operation(corpus: Path, step: int, op: str):
    from safetensors.torch import load_file

    import codec

    base = load_file(str(corpus / f"step_{step:04d}.safetensors"))
    target = load_file(str(corpus / f"step_{step + 1:04d}.safetensors"))
    payload = codec.encode(base, target, workers=1)
    if op == "encode":
        return lambda: codec.encode(base, target, workers=1)
    if op == "decode":
        return lambda: codec.decode(base, payload, workers=1)

    def apply() -> None:
        held = {k: v.clone() for k, v in base.items()}
        codec.apply_(held, payload)

    return apply


def _child(args: argparse.Namespace) -> None:
    """Under perf: compile and warm up, write the perf map, then the sampled loop."""
    import torch

    from codec.lab import perfmap

    torch.set_num_threads(1)
    run = _operation(args.corpus, args.step, args.op)
    for _ in range(3):
        run()
    path, count = perfmap.write_map(_codec_modules())
    print(f"perf map: {path} ({count} symbols)", flush=True)
    times = []
    with open(args.control, "w") as ctl:
        ctl.write("enable\n")
        ctl.flush()
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            t = time.process_time()
            run()
            times.append(time.process_time() - t)
        ctl.write("disable\n")
        ctl.flush()
    print(f"{args.op}: {len(times)} runs, median {statistics.median(times) * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--op", choices=("encode", "decode", "apply"), default="decode")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=25, help="report lines to print")
    ap.add_argument("--keep", type=Path, help="keep perf's data file here")
    ap.add_argument("--control", help=argparse.SUPPRESS)  # the child's end of perf's control fifo
    args = ap.parse_args()
    if args.control:
        _child(args)
        return
    if shutil.which("perf") is None:
        sys.exit("profile_kernels: needs `perf` (linux-perf) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        ctl, data = Path(tmp) / "ctl", args.keep or Path(tmp) / "perf.data"
        os.mkfifo(ctl)
        env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(tmp) / "numba"), NUMBA_NUM_THREADS="1")
        cmd = ["perf", "record", "-q", "-F", "999", "-D", "-1", f"--control=fifo:{ctl}", "-o", str(data), "--",
               "taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, __file__, str(args.corpus),
               "--step", str(args.step), "--op", args.op, "--seconds", str(args.seconds), "--control", str(ctl)]
        child = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write(child.stdout)
        if child.returncode:
            sys.exit(f"profile_kernels: the profiled run failed:\n{child.stderr[-4000:]}")
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "sym", "--stdio"],
                                capture_output=True, text=True, check=True).stdout
        lines = [ln for ln in report.splitlines() if ln.strip() and not ln.startswith("#")]
        for line in lines[: args.top]:
            print(line[:160])
        for line in child.stdout.splitlines():  # the map perf needed: not left behind in /tmp
            if line.startswith("perf map: "):
                Path(line.split()[2]).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
