"""`deltarelay keygen | verify | doctor`: signing keys for a run, the store's fsck, and what the store honours.

    deltarelay keygen --out keys/trainer          # keys/trainer.key (private, 0600), keys/trainer.pub
    deltarelay verify s3://bucket/run --deep --trusted-key keys/trainer.pub
    deltarelay doctor s3://bucket/run             # the conditional-write probe's table (docs/STORES.md)
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


def _doctor(args: argparse.Namespace) -> int:
    from relay.s3probe import StoreCapabilityError
    from relay.store import S3Store, open_store

    store = open_store(args.url, storage_options(args.storage_options))
    if not isinstance(store, S3Store):
        print(f"{store.url}: {type(store).__name__}: creates and compare-and-swap are the store's own (link(2) and "
              f"rename under flock for file://; one process's lock otherwise); nothing to probe")
        return 0
    caps = store.capabilities()
    print(caps.table())
    try:
        caps.require(store.url)
    except StoreCapabilityError as exc:
        print(f"\nrefused: {exc}")
        return 1
    print(f"\n{store.url}: deltarelay can write here (docs/STORES.md)")
    return 0


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

    p = subparsers.add_parser("doctor", help="probe which conditional writes the store honours (scratch keys under "
                                             "URL, removed after) and say whether deltarelay can write there")
    p.add_argument("url")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for the URL, as a JSON object")
    p.set_defaults(func=_doctor)
