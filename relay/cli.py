"""`deltarelay` command line. Each feature module registers its own subcommands.

A module listed in COMMAND_MODULES (the runtime: the commands that operate a run) defines
`register(subparsers)`, adding parsers whose `func(args) -> int` runs the command. Failures
print one line on stderr and exit non-zero.

Other packages add commands through the `deltarelay.commands` entry point group: each entry
point names a `register(subparsers)` function. The lab's `demo` and `bench` come that way
(pyproject.toml), so this module never imports them; they are loaded only when the command
line does not name a runtime command (a runtime command never loads them), and a broken or
absent lab leaves the runtime commands working.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys
import tomllib
from pathlib import Path

from relay.cli_options import ShownFormatter, shown

COMMAND_MODULES = (
    "relay.cli_codec",  # encode, decode, inspect
    "relay.cli_relay",  # publish, watch, rebase, gc, status
    "relay.cli_fanout",  # relay
    "relay.cli_security",  # keygen, verify, doctor
    "relay.cli_regional",  # materialise
    "relay.cli_fleet",  # wait-fleet (and status --fleet)
)
COMMAND_GROUP = "deltarelay.commands"
LAB_HINT = "The lab commands (demo, bench) come with the demo extra: pip install 'deltarelay[demo]'."


class _Parser(argparse.ArgumentParser):
    note = ""  # said after "invalid choice" when no command of COMMAND_GROUP could be loaded
    runtime: frozenset[str] = frozenset()  # the commands of COMMAND_MODULES

    def error(self, message: str):
        if self.note and "invalid choice" in message:
            message = f"{message}\n{self.note}"
        super().error(message)


def package_version() -> str:
    """The installed distribution's version; from a source tree that was never installed, its pyproject's."""
    try:
        return importlib.metadata.version("deltarelay")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
                   ["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def command_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of COMMAND_GROUP, by name."""
    return sorted(importlib.metadata.entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)


def build_parser(command: str | None = None) -> _Parser:
    """The parser. With `command` a runtime command, the entry point commands are not loaded."""
    parser = _Parser(
        prog="deltarelay",
        description="Lossless BF16 checkpoint deltas, and an object-store relay that keeps rollout hosts on the "
                    "trainer's weights.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
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
    parser.runtime = frozenset(sub.choices)
    if command in sub.choices:
        return parser
    runtime = parser.runtime
    loaded, failed = [], []
    for ep in command_entry_points():
        if ep.name in runtime:
            failed.append(f"{ep.name} (would replace the runtime command)")
            continue
        try:
            register = ep.load()
            register(sub)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the runtime commands with it
            failed.append(f"{ep.name} ({type(exc).__name__}: {exc})")
            continue
        loaded.append(ep.name)
    notes = []
    if failed:
        notes.append(f"Commands of {COMMAND_GROUP} that did not load: {'; '.join(failed)}.")
    if not loaded:
        notes.append(LAB_HINT)
        parser.note = " ".join(notes)
    parser.epilog = " ".join(notes) or None
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named on a command line (the first word not an option: -v takes no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    handler = logging.StreamHandler()
    handler.setFormatter(ShownFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    if args.command in parser.runtime:  # a runtime command's one line per step (relay.progress.STEP_LOG)
        from relay.progress import STEP_LOG

        STEP_LOG.setLevel(min(level, logging.INFO))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, no traceback, for operators and scripts
        if args.verbose >= 2:
            raise
        print(shown(f"deltarelay {args.command}: error: {exc}"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
