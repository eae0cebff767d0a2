"""The main job runs from an installed package: build the wheel, install it (not editable) into a
fresh venv through constraints.txt as the Makefile does, and run `deltarelay` from a directory
outside the checkout: first the runtime alone (what a rollout host installs), then with the
`demo` extra, `deltarelay demo --tiny` and `deltarelay bench --tiny`.

`make` installs editable, which hides a package that only works from its checkout (a lab module
loading scripts/ by path, a dependency only [dev] brings); this test is where that shows.
Slow (a fresh venv: torch, numba, s3fs, moto, transformers; about 3-4 minutes with a warm pip
cache), so marked slow; CI still runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP_VERSION = re.search(r"^PIP_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _env() -> dict:
    """The caller's environment (pip's index and find-links settings among it) minus whatever
    would put the checkout or another venv on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME",
                                                            "PYTHONSTARTUP", "PYTHONUSERBASE")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd: list, cwd: Path, timeout: float, ok: bool = True) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(f"[{time.monotonic() - t0:5.1f}s] {' '.join(map(str, cmd[:6]))} -> {out.returncode}")
    if ok:
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_installed_wheel_runs_demo_and_bench_outside_the_checkout(tmp_path):
    wheels, venv, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # from a copy without build outputs: setuptools' build/lib keeps modules since moved or deleted
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                                             "corpus", "out", "__pycache__", ".*cache", ".hypothesis"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, src], tmp_path, 300)
    (wheel,) = wheels.glob("deltarelay-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert shipped == {str(p.relative_to(ROOT)) for pkg in ("codec", "relay") for p in (ROOT / pkg).rglob("*.py")}
    _run([sys.executable, "-m", "venv", venv], tmp_path, 120)
    py, deltarelay = venv / "bin" / "python", venv / "bin" / "deltarelay"
    pip = [py, "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt"]
    _run([py, "-m", "pip", "install", "-q", f"pip=={PIP_VERSION}"], tmp_path, 300)

    # The runtime alone, as a rollout host installs it.
    _run([*pip, wheel], tmp_path, 600)
    where = _run([py, "-c", "import codec, relay, relay.cli; print(relay.__file__); print(codec.__file__)"],
                 elsewhere, 300).stdout
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not the checkout
    help_text = " ".join(_run([deltarelay, "--help"], elsewhere, 300).stdout.split())
    assert "watch" in help_text and "publish" in help_text
    assert "[needs the demo extra: pip install 'deltarelay[demo]'; missing moto" in help_text
    refused = _run([deltarelay, "demo", "--tiny", "--steps", "1", "--workdir", "refused"], elsewhere, 300, ok=False)
    assert refused.returncode == 1 and "pip install 'deltarelay[demo]'" in refused.stderr, refused.stderr

    # With the lab: the bench on a corpus it makes itself, then the demo on moto S3 servers. The
    # bench goes first: one process compiles the codec's kernels into the fresh install's cache,
    # where the demo's trainer, relay and watcher processes find them instead of each compiling.
    _run([*pip, f"{wheel}[demo]"], tmp_path, 600)
    bench = _run([deltarelay, "bench", "--tiny", "--pairs", "1", "--repeat", "1"], elsewhere, 600)
    assert re.search(r"^deltarelay v3 +\d+\.\d+% ", bench.stdout, re.M), bench.stdout
    assert "entropy bound" in bench.stdout and "speed vs zstd-1" in bench.stdout
    demo = _run([deltarelay, "demo", "--tiny", "--steps", "2", "--regions", "1", "--watchers", "1",
                 "--chart", "out/demo.png"], elsewhere, 600)
    assert "bit-exact checks: 3/3 (every watcher, every step)" in demo.stdout, demo.stdout
    assert "stores: s3 (moto on loopback)" in demo.stdout
    assert (elsewhere / "out" / "demo.png").read_bytes()[:4] == b"\x89PNG"
