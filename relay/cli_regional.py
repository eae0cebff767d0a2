"""`deltarelay materialise`: keep a region's own snapshots, built from the chain it holds (relay/regional.py).

    deltarelay materialise s3://eu-bucket/run --workdir /var/lib/deltarelay/eu \
        --bootstrap-from s3://origin-bucket/run [--every 25] [--trusted-key keys/trainer.pub]
"""

from __future__ import annotations

import argparse
import json
import logging

from relay.cli_options import add_trusted_key, storage_options

log = logging.getLogger(__name__)


def _materialise(args: argparse.Namespace) -> int:
    from relay.regional import Materialiser

    if args.origin_snapshots:
        log.warning("--origin-snapshots is ignored: readers use every snapshot the region holds, the trainer's and "
                    "its own, and no announcement changes that")
    with Materialiser(args.url, args.workdir, bootstrap_from=args.bootstrap_from, every=args.every, keep=args.keep,
                      trusted_keys=args.trusted_key, storage_options=storage_options(args.storage_options),
                      bootstrap_options=storage_options(args.bootstrap_options)) as mat:
        if args.once:
            mat.sync_once(timeout=args.timeout)
            print(json.dumps(mat.status(), indent=1))
        else:
            mat.run(poll_interval=args.poll_interval)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("materialise", help="build a region's own snapshots from the chain it holds, so no "
                                                  "snapshot crosses into the region after its bootstrap")
    p.add_argument("url", metavar="REGION_URL", help="the regional store (a relay's or a replica's destination)")
    p.add_argument("--workdir", required=True, help="local directory for snapshot downloads")
    p.add_argument("--bootstrap-from", metavar="ORIGIN_URL",
                   help="the origin run: one snapshot is read from it when the region has none to start from")
    p.add_argument("--every", type=int, metavar="N",
                   help="also snapshot when a step is N steps past the region's newest snapshot (default: only at "
                        "the steps the trainer snapshots)")
    p.add_argument("--keep", type=int, default=2, metavar="K", help="regional snapshots to keep (default 2)")
    p.add_argument("--origin-snapshots", action="store_true", help=argparse.SUPPRESS)  # gone; warned, ignored
    p.add_argument("--once", action="store_true", help="sync to the head once, print the status and exit")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="with --once: give up after S seconds")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S")
    add_trusted_key(p)
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for REGION_URL, as a JSON object")
    p.add_argument("--bootstrap-options", metavar="JSON", help="fsspec options for ORIGIN_URL, as a JSON object")
    p.set_defaults(func=_materialise)
