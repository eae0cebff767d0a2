"""`deltarelay` command line. Each feature module registers its own subcommands.

A module listed in COMMAND_MODULES defines `register(subparsers)`, adding parsers whose
`func(args) -> int` runs the command. Failures print one line on stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "relay.cli_codec",  # encode, decode, inspect
    "relay.bench",  # bench
    "relay.cli_relay",  # publish, watch, rebase, gc, status
    "relay.cli_fanout",  # relay, demo
    "relay.cli_security",  # keygen, verify
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltarelay",
        description="Lossless BF16 checkpoint deltas, and an object-store relay that keeps rollout hosts on the trainer's weights.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # feature not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, no traceback, for operators and scripts
        if args.verbose >= 2:
            raise
        print(f"deltarelay {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
