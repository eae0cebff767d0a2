"""What a fresh host's first delta costs in kernel compilation, before and after codec.warm_up.

Each run is a new process with an empty kernel cache (NUMBA_CACHE_DIR in a new temp dir), as on
a fresh host. A publisher's first delta is an encode, a watcher's an apply_; each follows a
simulated snapshot transfer of --download seconds (sleep: the snapshot path runs no kernel).
Modes: "none" (the first call compiles), "overlap" (warm_up started before the transfer, in the
background, waited for after it), "inline" (warm_up waited for before the transfer), "interim"
(the publisher's way, relay.Publisher: warm_up in the background, and a first delta that finds it
unfinished is coded without kernels, `codec.encode(compiled=False)`, a larger payload; watchers as
"overlap"). The extra time is the
first call's wall time after the transfer, plus any wait past it, minus a steady-state call.
--baseline-tree runs "none" against another checkout (main) in the same run.

    PYTHONPATH=. python scripts/bench_coldstart.py [--download 10] [--repeats 1] [--json out/coldstart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time, resource
t0 = time.perf_counter()
import torch
import codec
imported = time.perf_counter() - t0
role, mode, download, data = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
blob = torch.load(data)
base, target, payload = blob["base"], blob["target"], blob["payload"]
path = {"publisher": "encode", "watcher": "apply_"}[role]
run = (lambda: codec.encode(base, target)) if role == "publisher" else (
    lambda: codec.apply_({k: v.clone() for k, v in base.items()}, payload) or payload)
handle = None
start = time.perf_counter()
if mode in ("overlap", "interim"):
    handle = codec.warm_up((path,))
elif mode == "inline":
    codec.warm_up((path,), background=False)
time.sleep(download)  # the snapshot moves; no kernel runs on that path
s = time.perf_counter()
waited = 0.0
interim = False
if mode == "interim" and role == "publisher" and not handle.done():
    interim = True  # what relay.Publisher does: this delta without kernels, no wait
    size = len(codec.encode(base, target, compiled=False))
else:
    if handle is not None:
        handle.wait()
        waited = time.perf_counter() - s
    size = len(run())
first = time.perf_counter() - s
to_first = time.perf_counter() - start
if handle is not None:
    handle.wait()  # the next delta is a compiled one
s = time.perf_counter()
run()
steady = time.perf_counter() - s
cpu = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"import_s": imported, "first_s": first, "steady_s": steady, "waited_s": waited,
                  "interim": interim, "first_bytes": size, "steady_bytes": len(payload),
                  "to_first_delta_s": to_first - steady, "cpu_s": cpu.ru_utime + cpu.ru_stime}))
"""


def _data(path: Path) -> None:
    """A small BF16 checkpoint (8 x 1M elements, 1% changed by one ULP) and its payload."""
    import torch

    import codec
    g = torch.Generator().manual_seed(0)
    base = {f"layer{i}.weight": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16) for i in range(8)}
    base["norm.weight"] = torch.ones(1024)
    target = {k: v.clone() for k, v in base.items()}
    for v in target.values():
        if v.dtype == torch.bfloat16:
            flat = v.view(-1).view(torch.int16)
            idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]
            flat[idx] += 1
    torch.save({"base": base, "target": target, "payload": codec.encode(base, target)}, path)


def _child(tree: str, role: str, mode: str, download: float, data: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="coldstart-kernels-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": tree}
        out = subprocess.run([sys.executable, "-c", _CHILD, role, mode, str(download), str(data)], env=env,
                             capture_output=True, text=True, timeout=900, cwd=tree)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["extra_s"] = row["to_first_delta_s"] - download
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--download", type=float, default=10.0, help="simulated snapshot transfer, seconds")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell (medians)")
    ap.add_argument("--baseline-tree", default=None, help="checkout whose codec has no warm_up (e.g. /work/main)")
    ap.add_argument("--roles", default="publisher,watcher")
    ap.add_argument("--modes", default="none,overlap,inline,interim")
    ap.add_argument("--json", type=Path, default=Path("out/coldstart.json"))
    args = ap.parse_args(argv)
    here = str(Path(__file__).resolve().parent.parent)
    cells = [(here, mode) for mode in args.modes.split(",")]
    if args.baseline_tree:
        cells.insert(0, (args.baseline_tree, "none"))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "ckpt.pt"
        _data(data)
        rows = []
        for role in args.roles.split(","):
            for tree, mode in cells:
                runs = [_child(tree, role, mode, args.download, data) for _ in range(args.repeats)]
                row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row.update(role=role, mode=mode, tree="baseline" if tree != here else "this")
                rows.append(row)
                print(f"{role:9} {row['tree']:8} {mode:8} extra {row['extra_s']:6.1f} s  first call "
                      f"{row['first_s']:6.2f} s (waited {row['waited_s']:5.1f}; {row['first_bytes'] / 1e3:.0f} KB, "
                      f"steady {row['steady_bytes'] / 1e3:.0f} KB)  steady {row['steady_s']:.3f} s  "
                      f"cpu {row['cpu_s']:5.1f} s  import {row['import_s']:.1f} s", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"download_s": args.download, "repeats": args.repeats, "rows": rows,
                                     "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
