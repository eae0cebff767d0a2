"""`deltarelay demo | bench`: the lab's subcommands, registered through the `deltarelay.commands`
entry point group (pyproject.toml), which relay.cli loads; the runtime never imports this module.

Kept light: parsers only; the demo and the bench (torch, the baselines, moto) are imported when
a command runs. Where the demo extra is not installed the commands still register (the tiny
model on local directories needs nothing more) and their help says what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from relay import lab

BENCH_CLOCKS = ("cpu", "wall")  # relay.lab.bench.CLOCKS (tests/lab/test_bench.py checks)


def _needs() -> str:
    gone = lab.missing()
    return f" [needs the demo extra: {lab.INSTALL_HINT}; missing {', '.join(gone)}]" if gone else ""


def _demo(args: argparse.Namespace) -> int:
    from relay.lab.demo import run_demo

    summary = run_demo(store=args.store, steps=args.steps, regions=args.regions, watchers=args.watchers,
                       chart=args.chart, tiny=args.tiny, baseline_every=args.baseline_every, workdir=args.workdir,
                       json_path=args.json, copy_snapshots=args.copy_snapshots,
                       snapshot_format=args.snapshot_format, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(summary["text"])
    return 0 if summary["ok"] else 1


def register_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="the whole pipeline on local S3 servers: train, publish, relay, watch"
                                           + _needs())
    p.add_argument("--store", metavar="file://DIR", help="use local directories instead of S3 servers")
    p.add_argument("--steps", type=int, default=30, help="training steps published after the first")
    p.add_argument("--regions", type=int, default=3, help="rollout regions (1-5)")
    p.add_argument("--watchers", type=int, default=2, help="watcher processes per region")
    p.add_argument("--chart", metavar="PNG", default="out/demo.png", help="where to write the chart")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.add_argument("--tiny", action="store_true", help="a small model instead of all-MiniLM-L6-v2 (tests)")
    p.add_argument("--baseline-every", type=int, default=None, metavar="K",
                   help="encode the baselines on every K-th step (default: 5; 1 with --tiny)")
    p.add_argument("--workdir", metavar="DIR", help="keep stores, watcher directories and logs here")
    p.add_argument("--copy-snapshots", action="store_true",
                   help="relays copy every origin snapshot into the regions (the default: regional snapshots, "
                        "only one bootstrap snapshot crosses per region)")
    p.add_argument("--snapshot-format", choices=("safetensors", "compressed"), default="compressed",
                   help="the trainer's snapshot files (default: compressed, DRSN objects, so the bootstrap that "
                        "crosses into each region is 0.66x the safetensors one)")
    p.set_defaults(func=_demo)


def _bench(args: argparse.Namespace) -> int:
    from relay.lab.bench import format_table, generate_corpus, run_bench, save_chart

    if args.chart:
        lab.require("--chart", "matplotlib")  # before the run, not after it
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.json else (lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="deltarelay-bench-") as tmp:
        dirs = list(args.corpus) or [generate_corpus(Path(tmp), args.tiny, args.pairs or 3, log)]
        results = run_bench(dirs, repeat=args.repeat, pairs=args.pairs, slow=args.slow, log=log, clock=args.clock,
                            workers=args.workers)
    if args.chart:
        results["chart"] = str(save_chart(results, args.chart))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(format_table(results), end="")
        if args.chart:
            print(f"chart: {results['chart']}")
    return 0


def register_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="compare the codec with the anchors' formats on checkpoint corpora"
                                            + _needs(),
                              description="`deltarelay bench`: our codec against the anchors' formats on consecutive "
                                          "checkpoints, in one run.")
    p.add_argument("corpus", nargs="*", metavar="CORPUS_DIR",
                   help="directories of step_*.safetensors (default: generate a small MiniLM corpus first)")
    p.add_argument("--json", action="store_true", help="print machine-readable results instead of the table")
    p.add_argument("--chart", metavar="PNG", help="save a bar chart of size and speed per method")
    p.add_argument("--repeat", type=int, default=3, help="timed repeats per pair (default 3)")
    p.add_argument("--pairs", type=int, help="consecutive pairs per corpus (default: all)")
    p.add_argument("--slow", action="store_true", help="also run slow reference baselines (ARCv3 max race)")
    p.add_argument("--tiny", action="store_true", help="with no CORPUS_DIR, generate a tiny-model corpus (smoke test)")
    p.add_argument("--clock", choices=BENCH_CLOCKS, default="cpu",
                   help="time one-core runs in process CPU time (default; robust on a shared machine) or wall time")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="also time v2 with N threads across tensors (wall clock), reported separately")
    p.set_defaults(func=_bench)
