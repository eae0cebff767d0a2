"""`deltarelay keygen | verify`: signing keys for a run, and the store's fsck.

    deltarelay keygen --out keys/trainer          # keys/trainer.key (private, 0600), keys/trainer.pub
    deltarelay verify s3://bucket/run --deep --trusted-key keys/trainer.pub
"""

from __future__ import annotations

import argparse
import json

from relay.cli_options import add_trusted_key, storage_options
from relay.signing import generate_keypair


def _keygen(args: argparse.Namespace) -> int:
    key, pub, kid = generate_keypair(args.out)
    print(f"private key {key} (keep it on the trainer only), public key {pub}, key id {kid}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from relay.verify import verify

    report = verify(args.url, storage_options(args.storage_options), deep=args.deep, trusted_keys=args.trusted_key,
                    workers=args.workers)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.text())
    return 0 if report.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keygen", help="write an Ed25519 key pair for signing manifests")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.key (private) and PREFIX.pub")
    p.set_defaults(func=_keygen)

    p = subparsers.add_parser("verify", help="check that every object a run's manifest reaches is there and intact")
    p.add_argument("url")
    p.add_argument("--deep", action="store_true",
                   help="also rebuild every step from its snapshot and deltas and check the trainer's digests")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--workers", type=int, default=4, help="parallel object reads")
    add_trusted_key(p)
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for the URL, as a JSON object")
    p.set_defaults(func=_verify)
