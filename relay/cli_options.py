"""The options several `deltarelay` commands share: store options and keys, spelled and checked once."""

from __future__ import annotations

import argparse
import json
import logging
import re

# What a terminal acts on rather than shows: C0 and C1 controls (escape sequences, carriage returns, newlines that
# forge lines), DEL, and the invisible or reordering Unicode format characters (bidi overrides, zero widths)
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                      "\ufeff\ufff9-\ufffb]")


def shown(text: object) -> str:
    """`text` as an operator's terminal may show it: every character it would act on instead is written as
    its escape (\\x1b, \\u202e). Text from a bucket (an entry, a region document, an error quoting one) is
    anybody's who can write there; every line the CLI prints or logs goes through this."""
    s = str(text)
    if _UNSHOWN.search(s) is None:
        return s
    return _UNSHOWN.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", s)


class ShownFormatter(logging.Formatter):
    """Log lines with their message escaped by shown() (a traceback, appended after it, is the program's)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = shown(record.message)
        return super().formatMessage(record)

_TRUSTED_HELP = {
    "reader": "act only on manifests signed by this Ed25519 public key (PEM); repeat to trust several (key rotation)",
    "writer": "also accept a manifest signed by this public key before re-signing it (a key rotation); the signing "
              "keys' own public keys are always accepted",
}


def storage_options(text: str | None) -> dict | None:
    """The value of --storage-options: a JSON object handed to fsspec as is (None when not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--storage-options is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--storage-options must be a JSON object")
    return value


def add_storage_options(p: argparse.ArgumentParser, many: bool = False) -> None:
    """--storage-options JSON: once, or (`many`) once for every URL or once per URL in order."""
    if many:
        p.add_argument("--storage-options", action="append", metavar="JSON",
                       help="fsspec options as JSON: once for every URL, or once per URL in order")
    else:
        p.add_argument("--storage-options", metavar="JSON", help="fsspec options for the URL, as a JSON object")


def add_signing_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--signing-key", action="append", metavar="PATH",
                   help="sign the manifest with this Ed25519 private key (PEM, deltarelay keygen); repeat during a "
                        "key rotation; required to change a signed run")


def add_trusted_key(p: argparse.ArgumentParser, role: str = "reader") -> None:
    """--trusted-key PATH (repeatable): for a reader, the keys it acts on; for a writer, the other keys whose
    signatures it accepts on what it re-signs (relay.commit)."""
    p.add_argument("--trusted-key", action="append", metavar="PATH", help=_TRUSTED_HELP[role])


def add_writer_keys(p: argparse.ArgumentParser) -> None:
    """A writer's keys (relay.commit): --signing-key, and what it accepts on the manifest it changes
    (--trusted-key, --adopt-unsigned)."""
    add_signing_key(p)
    add_trusted_key(p, "writer")
    p.add_argument("--adopt-unsigned", action="store_true",
                   help="sign an UNSIGNED run from now on (refused otherwise: whoever can write the bucket can strip "
                        "signatures); check it first with deltarelay verify --deep")


def add_metrics(p: argparse.ArgumentParser) -> None:
    """--metrics-port / --metrics-addr: Prometheus metrics over HTTP (relay.metrics)."""
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (/metrics; 0: any free port, logged)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics server binds (default this host only, as from Python; 0.0.0.0: all "
                        "interfaces, for a scraper on another host)")


def add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal)")
