"""scripts/bench_snapshot.py end to end on a tiny synthetic corpus: every codec runs and round-trips,
the JSON has sane numbers; without the demo extra (no zipnn) the bench says what to install."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_snapshot.py"


def test_bench_snapshot_on_a_tiny_corpus(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--no-model", "--synthetic-mb", "1", "--runs", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if importlib.util.find_spec("zipnn") is None:  # CI's dev install: the baseline is the demo extra's
        assert run.returncode != 0 and "zipnn" in run.stderr and "deltarelay[demo]" in run.stderr, run.stderr
        return
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    (name, corpus), = result["corpora"].items()
    assert name == "synthetic-bf16-1mb" and corpus["raw_bytes"] == 1_000_000
    for key in ("ours", "zipnn", "zstd1"):
        m = corpus[key]
        assert m["round_trip"] is True and m["runs"] == 2
        assert 0 < m["bytes"] < corpus["raw_bytes"]
        assert m["compress_gbps"] > 0 and m["decompress_gbps"] > 0
    # N(0, 0.02) BF16: the exponent's ~2.1 bits leave ~63% for an entropy coder, zstd-1 far more
    assert 60 < corpus["ours"]["percent_of_raw"] < 67 < corpus["zstd1"]["percent_of_raw"]
    assert corpus["ours_vs_zipnn"]["size"] == corpus["ours"]["bytes"] / corpus["zipnn"]["bytes"]
    assert corpus["zipnn"]["mutates_its_input"] in (True, False)
    assert "ours/ZipNN: size" in run.stdout
    assert result["done_when"] == {}  # judged on MiniLM only, which --no-model skips
