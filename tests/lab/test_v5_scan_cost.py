"""scripts/v5_scan_cost.py: every prototype v5 position scan finds exactly the changed positions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from relay.lab.corpus import make_corpus

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "v5_scan_cost.py"


def _module():
    spec = importlib.util.spec_from_file_location("v5_scan_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chain(directory: Path, steps: int = 5, seed: int = 0) -> Path:
    """Snapshots of BF16 tensors whose sizes are not whole 64-element blocks (the scan then reads
    a padded copy), each step changing a few percent of the elements by an ULP or two, some of
    them again and again (so every recency occurs)."""
    g = np.random.default_rng(seed)
    shapes = {"w": (37, 129), "b": (1000,), "e": (5, 64)}
    state = {k: torch.randn(*s, dtype=torch.float32).to(torch.bfloat16) for k, s in shapes.items()}
    hot = {k: g.random(int(np.prod(s))) < 0.1 for k, s in shapes.items()}
    directory.mkdir(parents=True)
    for i in range(steps + 1):
        save_file({k: v.clone() for k, v in state.items()}, str(directory / f"step_{i:04d}.safetensors"))
        for k, v in state.items():
            bits = v.view(torch.int16).numpy().reshape(-1).copy()
            moved = (g.random(bits.size) < 0.02) | (hot[k] & (g.random(bits.size) < 0.5))
            bits[moved] += g.choice(np.array([-2, -1, 1, 2], np.int16), int(moved.sum()))
            state[k] = torch.from_numpy(bits).view(torch.bfloat16).reshape(v.shape)
    return directory


def test_every_form_finds_exactly_the_changes_on_padded_tensors(tmp_path, capsys):
    mod = _module()
    corpus = _chain(tmp_path / "chain")
    jobs = mod.prepare(corpus, 3)
    assert {j["name"] for j in jobs} == {"w", "b", "e"}
    assert all(j["hpos"].size and set(np.unique(j["hrec"])) == {1, 2, 3} for j in jobs)
    for form in mod.FORMS:
        mod.run(jobs, form)
        for j in jobs:
            np.testing.assert_array_equal(j["found_" + form], j["true"], err_msg=f"{form} on {j['name']}")
    assert mod.main([str(corpus), "--step", "3", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "positions found exactly by both" in out
    for form in mod.FORMS[1:]:
        assert f"{form} / v4, median of paired runs:" in out


def test_a_scan_that_misses_a_change_is_reported(tmp_path):
    """The check is real: a bitmap with one change's bit cleared makes the run fail."""
    mod = _module()
    jobs = mod.prepare(_chain(tmp_path / "chain", seed=1), 3)
    j = jobs[0]
    bits, start, lim = j["v5"]
    broken = bits.copy()
    broken[np.flatnonzero(broken)[0]] &= broken[np.flatnonzero(broken)[0]] - np.uint64(1)  # lowest set bit off
    j["v5"] = (broken, start, lim)
    mod.run(jobs, "v5-planes")
    assert not np.array_equal(j["found_v5-planes"], j["true"])


def test_on_a_tiny_model_corpus(tmp_path, capsys):
    mod = _module()
    out = tmp_path / "tiny"
    make_corpus(out, regime="fp32-lr1e-6", steps=5, tiny=True)
    assert mod.main([str(out), "--step", "3", "--repeat", "1"]) == 0
    assert "found exactly by both" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--step must be in 3\.\.4"):  # 6 snapshots: 3 before, 1 after
        mod.main([str(out), "--step", "5"])
