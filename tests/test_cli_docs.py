"""docs/CLI.md is generated from the `deltarelay` parser (scripts/gen_cli_docs.py) and must match it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    gen = _generator()
    expected = gen.render()
    current = (ROOT / "docs" / "CLI.md").read_text()
    assert current == expected, f"docs/CLI.md is stale; regenerate it with: {gen.REGENERATE}"


def test_cli_reference_covers_every_command():
    """Every subcommand, nested ones included, has its own section with its usage line."""
    import argparse

    from relay import cli

    text = (ROOT / "docs" / "CLI.md").read_text()
    parser = cli.build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in top.choices.items():
        assert f"## `deltarelay {name}`" in text, name
        assert f"usage: deltarelay {name}" in text, name
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices:
                    assert f"## `deltarelay {name} {child}`" in text, f"{name} {child}"
