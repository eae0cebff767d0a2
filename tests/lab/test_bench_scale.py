"""scripts/bench_scale.py end to end at a tiny size: every role runs, the JSON has sane numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_scale.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_step_moves_about_the_asked_fraction_by_one_ulp_small_weights_more_often():
    bench = _module()
    g = torch.Generator().manual_seed(0)
    tensors = {"w": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)}
    before = tensors["w"].clone()
    changed = bench.mutate_(tensors, 1, 0.01)
    bits_now, bits_before = tensors["w"].view(torch.int16).long(), before.view(torch.int16).long()
    moved = bits_now != bits_before
    assert int(moved.sum()) <= changed and 0.006 < int(moved.sum()) / moved.numel() < 0.012
    assert set((bits_now - bits_before)[moved].abs().tolist()) == {1}  # one ULP, never a sign flip
    small = before.float().abs() < 0.005
    assert moved[small].float().mean() > 3 * moved[~small].float().mean()
    again = {"w": before.clone()}
    bench.mutate_(again, 1, 0.01)
    assert torch.equal(again["w"].view(torch.int16), tensors["w"].view(torch.int16))  # deterministic per step


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_scale")
    out = tmp / "bench_scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "0.03125", "--tensor-mib", "8", "--steps", "2",
                          "--follow", "2", "--repeats", "1", "--workdir", str(tmp / "work"), "--json", str(out),
                          "--chart", str(tmp / "bench_scale.png")], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout, tmp


def test_every_role_reports_sane_numbers(report):
    data, _, _ = report
    (r,) = data["results"]
    model = r["model_bytes"]
    assert model == 4 * 8 << 20 and r["tensors"] == 4
    pub = r["publisher"]
    assert len(pub["step_s"]) == 2 + 2 * len(r["watchers"]) and all(0 < s < 300 for s in pub["step_s"])
    assert pub["snapshot_s"] > 0 and pub["peak_rss"] > model
    assert all(0.005 * model / 2 < c < 0.015 * model / 2 for c in pub["changed_per_step"])  # ~1% of the elements
    assert r["resume"]["resume_s"] > 0
    # the watchers (one per persist mode) start in turn: each cold-syncs to the head the one before it left
    assert [w["cold_step"] for w in r["watchers"].values()] == [2 + 2 * i for i in range(len(r["watchers"]))]
    assert len(r["watchers"]) == 2  # persist="full" and persist="journal"
    for w in r["watchers"].values():
        assert w["cold_bytes_down"] >= model  # the snapshot, and the chain
        assert len(w["step_s"]) == 2
        # a delta step moves far less than the model: 1% of elements changed
        assert all(0 < d < 0.05 * model for d in w["bytes_down"])
        assert all(x >= 0 for x in w["disk_writes"])
    full = r["full"]
    assert all(model <= b < model + (1 << 20) for b in full["bytes_down"])  # the files: the model and headers
    assert full["step_s"][0] > 0
    trl = r["trl"]
    assert trl["trl"]["bytes"] >= 6 * trl["changes"]  # int32 + bf16 per change
    assert trl["codec"]["bytes"] < trl["trl"]["bytes"]


def test_summary_targets_and_cost_model(report):
    data, stdout, tmp = report
    (r,) = data["results"]
    roles = [row["role"] for row in r["summary"]["rows"]]
    assert roles[0] == "publisher" and any(x.startswith("watcher") for x in roles)
    assert "baseline: full checkpoint per step" in roles and "baseline: TRL sparse (int32 + bf16)" in roles
    for check in r["summary"]["checks"]:
        assert check["pass"] == (check["value"] <= check["target"]) and math.isfinite(check["value"])
    cm = r["cost_model"]
    # the watcher's rate is the journal mode's (a step that costs what changed), not the full mode's
    assert cm["watcher_mode"] == "journal"
    assert math.isclose(cm["watcher_s_per_gb"], statistics.median(r["watchers"]["journal"]["step_s"])
                        / cm["measured_at_gb"])
    assert {(row["model"], row["cores"]) for row in cm["rows"]} == {("70B", 32), ("70B", 128), ("1T", 32), ("1T", 128)}
    for row in cm["rows"]:
        assert row["publish_s"] > 0 and row["watcher_s"] > 0 and row["net_bytes"] < row["model_bytes"]
    by = {(row["model"], row["cores"]): row for row in cm["rows"]}
    assert by[("1T", 128)]["watcher_s"] < by[("1T", 32)]["watcher_s"]  # more cores, faster
    assert "| publisher" in stdout and "| target |" in stdout and "pass" in data["markdown"]
    if importlib.util.find_spec("matplotlib") is None:  # a dev install (CI): the numbers, no charts
        assert "charts skipped" in stdout
    else:
        assert (tmp / "bench_scale.png").stat().st_size > 0 and (tmp / "bench_scale_model.png").stat().st_size > 0
