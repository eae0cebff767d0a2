"""`deltarelay publish | watch | dest | rebase | gc | status`: the relay from the command line.

Store URLs take s3fs's usual environment (credentials, AWS_ENDPOINT_URL); `--storage-options JSON`
passes fsspec options for that URL unchanged.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

from relay import checkpoint, dest, fleet, ops, progress
from relay.manifest import PERSIST_MODES
from relay.cli_fleet import add_fleet_status, fleet_status
from relay.cli_options import (add_metrics, add_no_progress, add_storage_options, add_trusted_key, add_writer_keys,
                               shown, storage_options)
from relay.publisher import Publisher
from relay.watcher import SyncError, Watcher


def _publish(args: argparse.Namespace) -> int:
    tensors, _ = checkpoint.load(args.checkpoint)
    with Publisher(args.url, snapshot_every=args.snapshot_every, storage_options=storage_options(args.storage_options),
                   resume=args.resume, background=False, signing_key=args.signing_key,
                   trusted_keys=args.trusted_key, adopt_unsigned=args.adopt_unsigned,
                   snapshot_format=args.snapshot_format) as pub:
        start = pub.bytes_uploaded
        with progress.Poller(lambda: (pub.bytes_uploaded - start, None), f"publish step {args.step}",
                             enabled=progress.wanted() and not args.no_progress):
            done = pub.publish(tensors, args.step)
    print(f"published to {args.url}: {done.line()}")
    return 0


def tensor_selector(patterns: list[str] | None) -> Callable[[str], bool] | None:
    """--tensors PATTERN...: a partial replica's tensors, shell-style patterns (fnmatchcase; a plain name
    matches itself). None: every tensor."""
    if not patterns:
        return None
    pats = list(patterns)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in pats)


def engine_of(spec: str | None, pause_mode: str):
    """--engine: `vllm+http://HOST:PORT` drives `vllm serve` there (relay.engines.vllm.VLLMServer)."""
    if spec is None:
        return None
    kind, sep, rest = spec.partition("+")
    if kind != "vllm" or not sep or not rest.startswith(("http://", "https://")):
        raise SystemExit(f"--engine {spec!r}: expected vllm+http://HOST:PORT (a `vllm serve` started with "
                         f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls relay.engines.vllm.WorkerExtension)")
    from relay.engines.vllm import VLLMServer

    return VLLMServer(rest, pause_mode=pause_mode)


_BARE = -1  # --accept-older-head without its STEP (the old boolean spelling); not a str: argparse would parse it


def _older_head(text: str) -> int:
    """--accept-older-head STEP: a step number (argparse reports the ValueError's message)."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no step: name the step to go back to, as in "
                                         f"--accept-older-head 4") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{step}: a step is >= 0")
    return step


def _watch(args: argparse.Namespace) -> int:
    if args.accept_older_head == _BARE:
        raise SystemExit("deltarelay watch: --accept-older-head now names the step to go back to, once, at start: "
                         "--accept-older-head STEP (the bare flag stayed armed for the watcher's lifetime, so a "
                         "manifest replayed later could roll the host back; it is refused)")
    # DestLocked (another watcher on DEST) is raised here and reported by main() as one line, exit 1
    with Watcher(args.url, args.dest, poll_interval=args.poll_interval,
                 storage_options=storage_options(args.storage_options),
                 trusted_keys=args.trusted_key, tensors=tensor_selector(args.tensors), persist=args.persist,
                 compact_fraction=args.compact_fraction, compact_steps=args.compact_steps, host=args.host,
                 region=args.region, report_interval=None if args.no_report else args.report_interval,
                 metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                 engine=engine_of(args.engine, args.engine_pause), accept_older_head=args.accept_older_head) as w:
        if w.metrics_port is not None:
            print(f"metrics on http://{args.metrics_addr}:{w.metrics_port}/metrics", file=sys.stderr, flush=True)
        try:
            with progress.Poller(w.reader.progress, f"{args.dest}: download",
                                 enabled=progress.wanted() and not args.no_progress):
                if args.once:
                    step = w.sync(timeout=args.timeout)
                    print(f"{args.dest}: step {step}")
                else:
                    w.run(sync_timeout=args.timeout)
        except SyncError as exc:
            held = "no step yet" if w.step is None else f"step {w.step}"
            raise SyncError(f"{exc}; {args.dest} stays on {held}") from None
    return 0


def _held_bytes(directory: str) -> int | None:
    """The tensor bytes of the step a watcher's DIR holds (what materialize writes, headers aside)."""
    from codec.tensors import DTYPES

    version = dest.current_version(directory)
    if version is None:
        return None
    sizes = {d.name: d.itemsize for d in DTYPES}
    return sum(math.prod(t.shape) * sizes.get(t.dtype, 0) for t in dest.read_state(version).tensors.values())


def _dest_materialize(args: argparse.Namespace) -> int:
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # where dest.materialize writes before its rename
    bar = progress.wanted() and not args.no_progress
    total = _held_bytes(args.dest) if bar else None
    with progress.Poller(lambda: (progress.written_bytes(tmp if tmp.exists() else out), total),
                         f"materialize {args.out}", enabled=bar):
        step = dest.materialize(args.dest, args.out)
    print(f"{args.out}: step {step} of {args.dest}")
    return 0


def _rebase(args: argparse.Namespace) -> int:
    step = ops.rebase(args.url, storage_options(args.storage_options), signing_key=args.signing_key,
                      trusted_keys=args.trusted_key, adopt_unsigned=args.adopt_unsigned, timeout=args.timeout)
    print(f"{args.url}: base is now step {step}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    out = ops.gc(args.url, args.keep_snapshots, storage_options(args.storage_options), signing_key=args.signing_key,
                 trusted_keys=args.trusted_key, adopt_unsigned=args.adopt_unsigned, regional_only=args.regional_only,
                 dry_run=args.dry_run)
    regional = f", regional snapshots {out['regional_snapshots']}" if out["regional_snapshots"] else ""
    if args.dry_run:
        for key, size in sorted(out["doomed"].items()):
            print(f"would delete {key} ({size} bytes)")
    print(f"{args.url}: {'would keep' if args.dry_run else 'kept'} snapshots {out['snapshots']}{regional}, "
          f"{'would delete' if args.dry_run else 'deleted'} {out['deleted']} objects ({out['freed_bytes']} bytes)")
    return 0


def _status(args: argparse.Namespace) -> int:
    if args.fleet:
        return fleet_status(args)
    given = args.storage_options or []
    if len(given) > 1 and len(given) != len(args.urls):
        raise ValueError(f"{len(given)} --storage-options for {len(args.urls)} URLs: give one, or one per URL")
    rows, failed = [], 0
    for i, url in enumerate(args.urls):
        opts = storage_options(given[i] if len(given) > 1 else (given[0] if given else None))
        try:
            rows.append(ops.status(url, opts))
        except Exception as exc:  # noqa: BLE001 - one bad store must not hide the others
            failed += 1
            rows.append({"url": url, "error": str(exc)})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'url':40} {'head':>8} {'base':>8} {'chain':>6} {'chain bytes':>12} {'base bytes':>12}")
        for r in rows:
            if "error" in r:
                print(shown(f"{r['url']:40} error: {r['error']}"))
            else:
                print(f"{r['url']:40} {r['head']:>8} {r['base']:>8} {r['chain_length']:>6} {r['chain_bytes']:>12} "
                      f"{r['base_bytes']:>12}")
    return 1 if failed else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("publish", help="publish a safetensors checkpoint as a step of a run")
    p.add_argument("url", help="run prefix: s3://bucket/run, file:///path, memory://run")
    p.add_argument("checkpoint", help="a .safetensors file or a shard directory")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--resume", action="store_true", help="continue an existing run (required unless it is empty)")
    p.add_argument("--snapshot-every", type=int, default=25)
    p.add_argument("--snapshot-format", choices=("safetensors", "compressed"), default="safetensors",
                   help="snapshot files as safetensors (default) or as compressed snapshot objects (docs/FORMAT.md), "
                        "which watchers decode into safetensors in DEST")
    add_writer_keys(p)
    add_storage_options(p)
    add_no_progress(p)
    p.set_defaults(func=_publish)

    p = subparsers.add_parser("watch", help="keep a directory on a run's head")
    p.add_argument("url")
    p.add_argument("--dest", required=True, help="directory that always holds one verified step")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--once", action="store_true", help="sync to the head once and exit")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="give up a sync after S seconds (exit non-zero, DIR stays on its last good step)")
    p.add_argument("--tensors", action="append", metavar="PATTERN",
                   help="a partial replica: hold only the tensors matching this shell-style pattern (a plain name "
                        "matches itself; repeat for more); only the parts and snapshot files holding them are "
                        "downloaded, and DIR's relay-state.json says \"partial\"")
    p.add_argument("--persist", choices=PERSIST_MODES, default="full",
                   help="full: every step a complete checkpoint under the visible names (engines that reload "
                        "from disk); journal: a base plus the verified deltas since, disk writes per step "
                        "proportional to the delta (read it with relay.dest.open_head or `deltarelay dest "
                        "materialize`)")
    p.add_argument("--compact-fraction", type=float, default=0.5, metavar="F",
                   help="journal mode: compact once the journal exceeds F times the model's bytes")
    p.add_argument("--compact-steps", type=int, default=64, metavar="N",
                   help="journal mode: compact once the journal holds more than N steps")
    p.add_argument("--host", default=None, metavar="ID",
                   help="this watcher's id in the fleet ledger (fleet/hosts/ID.json in the store it follows; "
                        "default <hostname>-<hash of DIR>)")
    p.add_argument("--region", default=None, help="the region the ledger entry names (informational)")
    p.add_argument("--report-interval", type=float, default=fleet.DEFAULT_INTERVAL, metavar="S",
                   help="ledger heartbeat: report the held step at least every S seconds (and after every sync)")
    p.add_argument("--no-report", action="store_true", help="write no fleet ledger entry (a read-only store)")
    add_metrics(p)
    p.add_argument("--engine", metavar="URL",
                   help="also put each verified step into a running inference engine, without a restart: "
                        "vllm+http://HOST:PORT for `vllm serve` (README, Serving with vLLM); needs --persist full")
    p.add_argument("--engine-pause", choices=("abort", "wait", "keep"), default="abort",
                   help="what the engine does with in-flight requests while it applies a step (vLLM's pause "
                        "modes: abort them, wait for them, keep them frozen until resume)")
    p.add_argument("--accept-older-head", nargs="?", const=_BARE, type=_older_head, metavar="STEP",
                   help="repair: if at the first sync the store's head is exactly STEP, older than the step DIR holds "
                        "(same run), take it; spent by that sync whether it moved back or not (a watcher that a "
                        "forged manifest moved past the trainer refuses every real head otherwise; without this "
                        "flag a watcher never moves back)")
    add_trusted_key(p)
    add_storage_options(p)
    add_no_progress(p)
    p.set_defaults(func=_watch)

    p = subparsers.add_parser("dest", help="read a watcher's directory")
    dsub = p.add_subparsers(dest="dest_command", required=True)
    q = dsub.add_parser("materialize", help="write the step DEST holds (either persist mode) as a shard directory")
    q.add_argument("dest", metavar="DEST")
    q.add_argument("out", metavar="OUT", help="new directory (must not exist)")
    add_no_progress(q)
    q.set_defaults(func=_dest_materialize)

    p = subparsers.add_parser("rebase", help="write the head as a new snapshot and make it the base")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="give up (exit non-zero, nothing committed) after S seconds without a verified path to the "
                        "head, e.g. waiting for an object the manifest names that never arrives (default 600)")
    add_writer_keys(p)
    add_storage_options(p)
    p.set_defaults(func=_rebase)

    p = subparsers.add_parser("gc", help="delete objects the last K snapshots no longer need")
    p.add_argument("url")
    p.add_argument("--keep-snapshots", type=int, required=True, metavar="K")
    p.add_argument("--regional-only", action="store_true",
                   help="a regional store: collect only its own snapshots (regional/snapshots/), leave the manifest "
                        "alone (a signed run's region, whose manifest only the trainer's key may change)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each object gc would delete (key and bytes) and the total; change nothing")
    add_writer_keys(p)
    add_storage_options(p)
    p.set_defaults(func=_gc)

    p = subparsers.add_parser("status", help="head, base, chain length and bytes per run; --fleet: which hosts "
                                             "hold which step")
    p.add_argument("urls", nargs="+", metavar="URL")
    p.add_argument("--json", action="store_true")
    add_fleet_status(p)
    add_storage_options(p, many=True)
    p.set_defaults(func=_status)
