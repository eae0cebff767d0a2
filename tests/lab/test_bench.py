"""`deltarelay bench` end to end on a tiny-model corpus: every method, verified, with sane numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from codec.lab import fireworks
from relay import cli
from relay.lab.bench import CLOCKS, format_table, run_bench, save_chart
from relay.lab.commands import BENCH_CLOCKS
from relay.lab.corpus import make_corpus

OURS = ("deltarelay-v1", "deltarelay-v3", "deltarelay-v4")
ANCHORS, REFERENCE, NOT_RUN = fireworks.select()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny"
    make_corpus(out, regime="fp32-lr1e-6", steps=2, tiny=True)
    return out


@pytest.fixture(scope="module")
def results(corpus):
    return run_bench([corpus], repeat=1)


def test_every_method_is_reported_with_sane_numbers(results, corpus):
    assert len(results["corpora"]) == 1
    c = results["corpora"][0]
    assert c["pairs"] == 2 and c["regime"] == "fp32-lr1e-6"
    meta = json.loads((corpus / "corpus.json").read_text())
    assert c["checkpoint_bytes"] == meta["checkpoint_bytes"]
    rows = {r["key"]: r for r in c["rows"]}
    assert set(rows) == set(OURS) | set(ANCHORS)
    assert c["reference"]["key"] == REFERENCE and c["not_run"] == NOT_RUN
    for r in rows.values():
        assert r["exact"] is True
        assert r["bytes"] > 0 and 0 < r["percent"] < 100
        for k in ("encode_mbps", "decode_mbps", "encode_vs_zstd1", "decode_vs_zstd1", "encode_vs_arcv3",
                  "decode_vs_arcv3"):
            assert math.isfinite(r[k]) and r[k] > 0
    ref = rows[REFERENCE]
    assert ref["vs_arcv3"] == 1.0 and ref["encode_vs_arcv3"] == 1.0 and ref["decode_vs_arcv3"] == 1.0
    # the speed ratios against ARCv3 go through the paired zstd-1 runs of both methods
    for r in rows.values():
        assert r["encode_vs_arcv3"] == pytest.approx(r["encode_vs_zstd1"] / ref["encode_vs_zstd1"])
    # every delta beats shipping the checkpoint; the formats cost what they say per change
    assert all(r["percent"] < rows["zstd1-full"]["percent"] / 5 for k, r in rows.items() if k != "zstd1-full")
    # 6 and 4 bytes per change plus the safetensors header (a few KB of names on this tiny model)
    assert 6.0 <= rows["trl-sparse"]["bytes_per_changed"] < 9.0
    assert 4.0 <= rows["trl-gap16"]["bytes_per_changed"] < rows["trl-sparse"]["bytes_per_changed"] - 1.9
    assert rows["pulse"]["bytes"] < rows["trl-gap16"]["bytes"] < rows["trl-sparse"]["bytes"]
    b = c["bound"]
    assert b["vs_bound"] == 1.0 and 0 < b["percent"] < ref["percent"]
    assert b["bytes_per_changed"] * 8 == pytest.approx(b["mask_bits_per_changed"] + b["value_bits_per_changed"])
    for r in rows.values():
        assert r["vs_bound"] == pytest.approx(r["bytes"] / b["bytes"], rel=0.05)
    lo, hi = c["changed_fraction_range"]
    assert 0.002 < lo <= c["changed_fraction"] <= hi < 0.05
    z = c["zstd1_raw"]
    assert z["compress_mbps"] > 0 and z["decompress_mbps"] > 0 and 30 < z["percent"] <= 101
    assert set(c["speed_vs_zstd1"]) == set(OURS)
    # ours are also timed applying in place (the watcher's path), the anchors have no such path
    for k, r in rows.items():
        if k in OURS:
            assert math.isfinite(r["apply_mbps"]) and r["apply_mbps"] > 0
            assert c["speed_vs_zstd1"][k]["apply"] == r["apply_vs_zstd1"] > 0
        else:
            assert r["apply_mbps"] is None and r["apply_vs_zstd1"] is None


def test_thread_settings_are_restored(corpus):
    before = torch.get_num_threads()
    run_bench([corpus], repeat=1, pairs=1)
    assert torch.get_num_threads() == before


def test_multicore_rows_compare_threads_on_one_clock(corpus):
    """--workers N times v2 with one thread and with N threads in the same loop (wall clock) and
    reports their ratio; both are checked bit-exact along the way."""
    c = run_bench([corpus], repeat=2, pairs=1, workers=2)["corpora"][0]
    m = c["multicore"]
    assert m["workers"] == 2
    for k in ("encode_mbps", "decode_mbps", "zstd1_compress_mbps_wall", "encode_vs_one_core", "decode_vs_one_core"):
        assert math.isfinite(m[k]) and m[k] > 0, k
    assert "2 workers" in format_table({"corpora": [c]}) and "one thread, same clock" in format_table({"corpora": [c]})
    assert run_bench([corpus], repeat=1, pairs=1)["corpora"][0]["multicore"] is None


def test_table_names_every_method_the_bound_and_the_reference(results):
    table = format_table(results)
    labels = ["deltarelay v1", "deltarelay v3", "deltarelay v4", "entropy bound", "speed vs zstd-1",
              "every thread pinned"]
    labels += [b.label for b in ANCHORS.values()]
    labels.append("real ARCv3 (fireworks-delta-compression" if REFERENCE == "arc_v3" else "ARCv3-style")
    for label in labels:
        assert label in table
    for key in NOT_RUN:
        assert f"not run: {NOT_RUN[key]}" in table


def test_without_the_package_the_style_arcv3_is_the_reference_and_the_real_ones_are_listed(corpus, monkeypatch):
    reason = "fireworks-delta-compression is not installed (pip install 'deltarelay[fireworks]')"
    monkeypatch.setattr(fireworks, "unavailable", lambda: reason)
    c = run_bench([corpus], repeat=1, pairs=1)["corpora"][0]
    assert c["reference"]["key"] == "arcv3" and "ARCv3-style" in c["reference"]["name"]
    assert c["not_run"] == {k: reason for k in fireworks.BASELINES}
    assert not {r["key"] for r in c["rows"]} & set(fireworks.BASELINES)
    table = format_table({"corpora": [c]})
    assert "against ARCv3-style reimplementation" in table
    assert all(f"{k:44} not run: {reason}" in table for k in fireworks.BASELINES)


def test_one_core_pin_is_undone(corpus):
    import os

    before = os.sched_getaffinity(0)
    c = run_bench([corpus], repeat=1, pairs=1)["corpora"][0]
    assert c["pinned_cpu"] in before and os.sched_getaffinity(0) == before


def test_cli_json(corpus, capsys):
    assert cli.main(["bench", str(corpus), "--json", "--repeat", "1", "--pairs", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["corpora"][0]["pairs"] == 1
    assert {r["key"] for r in data["corpora"][0]["rows"]} == set(OURS) | set(ANCHORS)


def test_chart_is_a_png(results, tmp_path):
    pytest.importorskip("matplotlib")  # the demo extra
    chart = save_chart(results, tmp_path / "out" / "bench.png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_directory_without_a_corpus(tmp_path, capsys):
    assert cli.main(["bench", str(tmp_path)]) == 1
    assert "at least two step_*.safetensors" in capsys.readouterr().err


def test_the_parser_offers_the_clocks_the_bench_has():
    assert BENCH_CLOCKS == tuple(sorted(CLOCKS))
