"""`deltarelay encode | decode | inspect` on single files and shard directories.

Most tests call `relay.cli.main` in-process; one runs the real console entry in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import codec
from codec_cases import FORMAT_VERSIONS, assert_bit_exact, edge_pair, fix_checksum, model_pair
from relay import checkpoint
from relay.checkpoint import INDEX_NAME, SINGLE_NAME, Layout
from relay.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def single(tmp_path):
    base, target = edge_pair(seed=2)
    checkpoint.save(base, tmp_path / "base.safetensors", Layout(metadata={"step": "1"}))
    checkpoint.save(target, tmp_path / "target.safetensors", Layout(metadata={"step": "2"}))
    return tmp_path, base, target


@pytest.fixture
def sharded(tmp_path):
    base, target = model_pair(n_tensors=6, shape=(64, 64), fraction=0.01, seed=5)
    plan = checkpoint.shard_plan(base, max_shard_bytes=3 * 64 * 64 * 2)
    assert len(set(plan.values())) > 1
    checkpoint.save(base, tmp_path / "base", Layout(True, plan))
    checkpoint.save(target, tmp_path / "target", Layout(True, plan))
    return tmp_path, base, target, plan


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("effort", ["fast", "default", "max"])
def test_single_file_round_trip(capsys, single, version, effort):
    d, base, target = single
    rc, out, err = run(capsys, "encode", d / "base.safetensors", d / "target.safetensors", "-o", d / "delta.bin",
                       "--effort", effort, "--format-version", version)
    assert rc == 0 and err == ""
    assert "delta.bin" in out
    assert codec.describe((d / "delta.bin").read_bytes())["format_version"] == version
    rc, out, err = run(capsys, "decode", d / "base.safetensors", d / "delta.bin", "-o", d / "out.safetensors")
    assert rc == 0 and err == ""
    decoded, layout = checkpoint.load(d / "out.safetensors")
    assert_bit_exact(decoded, target)
    assert not layout.sharded and layout.metadata == {"step": "1"}  # the base's layout
    assert leftovers(d) == []


def test_shard_directory_round_trip(capsys, sharded):
    d, base, target, plan = sharded
    assert run(capsys, "encode", d / "base", d / "target", "-o", d / "delta.bin")[0] == 0
    rc, _, err = run(capsys, "decode", d / "base", d / "delta.bin", "-o", d / "out")
    assert rc == 0 and err == ""
    assert sorted(p.name for p in (d / "out").iterdir()) == sorted(p.name for p in (d / "base").iterdir())
    assert json.loads((d / "out" / INDEX_NAME).read_text())["weight_map"] == plan
    decoded, layout = checkpoint.load(d / "out")
    assert_bit_exact(decoded, target)
    assert layout.sharded and layout.weight_map == plan
    assert leftovers(d) == []


def test_directory_with_one_model_file_keeps_that_layout(capsys, tmp_path):
    base, target = model_pair(n_tensors=2, seed=6)
    for name, tensors in (("base", base), ("target", target)):
        (tmp_path / name).mkdir()
        checkpoint.save(tensors, tmp_path / name / SINGLE_NAME)
    assert run(capsys, "encode", tmp_path / "base", tmp_path / "target", "-o", tmp_path / "d.bin")[0] == 0
    assert run(capsys, "decode", tmp_path / "base", tmp_path / "d.bin", "-o", tmp_path / "out")[0] == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == [SINGLE_NAME]
    assert_bit_exact(checkpoint.load(tmp_path / "out")[0], target)


def test_mixed_file_and_directory_inputs(capsys, sharded):
    d, base, target, _ = sharded
    checkpoint.save(target, d / "target.safetensors")
    assert run(capsys, "encode", d / "base", d / "target.safetensors", "-o", d / "delta.bin")[0] == 0
    assert run(capsys, "decode", d / "base", d / "delta.bin", "-o", d / "out")[0] == 0
    assert_bit_exact(checkpoint.load(d / "out")[0], target)


def test_inspect_text_and_json(capsys, single):
    d, base, target = single
    run(capsys, "encode", d / "base.safetensors", d / "target.safetensors", "-o", d / "delta.bin")
    info = codec.describe((d / "delta.bin").read_bytes())

    rc, out, err = run(capsys, "inspect", d / "delta.bin")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    for row in info["tensors"]:
        line = next(ln for ln in lines if ln.split()[0] == row["name"])
        assert row["dtype"] in line and row["method"] in line
        assert f"{100 * row['changed_fraction']:.4f}%" in line
        assert f"{row['bytes']:,}" in line
        for stream, n in row["streams"].items():
            assert f"{stream}={n}" in line
        for key, value in row.items():  # bits-per-element fields, when a method reports them
            if isinstance(value, float) and key != "changed_fraction":
                assert f"{key}={value:.3f}" in line
    total = next(ln for ln in lines if ln.startswith("TOTAL"))
    assert f"{info['body_bytes']:,}" in total
    assert f"{info['total_bytes']:,}" in out

    rc, out, err = run(capsys, "inspect", d / "delta.bin", "--json")
    assert rc == 0 and json.loads(out) == json.loads(json.dumps(info))


def _damaged(delta: bytes, how: str) -> bytes:
    if how == "corrupt":
        data = bytearray(delta)
        data[len(data) // 2] ^= 0x20
        return bytes(data)
    if how == "truncated":
        return delta[: len(delta) - 7]
    if how == "forged":  # tampered body, checksum recomputed: the tensor digests refuse it
        data = bytearray(delta)
        data[-1] ^= 0x01
        return fix_checksum(data)
    if how == "empty":
        return b""
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "forged", "empty", "wrong-base"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_refused_decode_leaves_no_out(capsys, tmp_path, how, layout):
    base, target = model_pair(n_tensors=4, shape=(48, 48), fraction=0.02, seed=7)
    other = dict(base)
    other["layers.2.weight"] = target["layers.2.weight"]  # another checkpoint, one tensor changed
    lay = Layout(True, checkpoint.shard_plan(base, 48 * 48 * 2)) if layout == "sharded" else Layout()
    suffix = "" if layout == "sharded" else ".safetensors"
    for name, tensors in (("base", base), ("target", target), ("other", other)):
        checkpoint.save(tensors, tmp_path / f"{name}{suffix}", lay)
    assert run(capsys, "encode", tmp_path / f"base{suffix}", tmp_path / f"target{suffix}",
               "-o", tmp_path / "delta.bin")[0] == 0
    delta = (tmp_path / "delta.bin").read_bytes()
    if how == "wrong-base":
        use_base = tmp_path / f"other{suffix}"
    else:
        use_base = tmp_path / f"base{suffix}"
        (tmp_path / "delta.bin").write_bytes(_damaged(delta, how))
    out_path = tmp_path / f"out{suffix}"

    rc, out, err = run(capsys, "decode", use_base, tmp_path / "delta.bin", "-o", out_path)

    assert rc != 0
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("deltarelay decode: error:")
    if how == "wrong-base":
        assert "layers.2.weight" in err and "base" in err
    assert not out_path.exists()
    assert leftovers(tmp_path) == []


def test_encode_failures_leave_no_out(capsys, tmp_path):
    base, target = model_pair(n_tensors=2, seed=8)
    checkpoint.save(base, tmp_path / "base.safetensors")
    grown = dict(target, extra=target["layers.0.weight"].clone())
    checkpoint.save(grown, tmp_path / "grown.safetensors")

    rc, _, err = run(capsys, "encode", tmp_path / "base.safetensors", tmp_path / "grown.safetensors",
                     "-o", tmp_path / "d.bin")
    assert rc != 0 and "extra" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, "encode", tmp_path / "base.safetensors", tmp_path / "missing.safetensors",
                     "-o", tmp_path / "d.bin")
    assert rc != 0 and "missing.safetensors" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.bin").exists()
    assert leftovers(tmp_path) == []


def test_inspect_with_base_splits_mask_and_value_bits(capsys, single):
    d, base, target = single
    run(capsys, "encode", d / "base.safetensors", d / "target.safetensors", "-o", d / "delta.bin")
    rc, out, err = run(capsys, "inspect", d / "delta.bin", "--base", d / "base.safetensors", "--json")
    assert rc == 0, err
    rows = [r for r in json.loads(out)["tensors"] if r["method"] == "conditional"]
    assert rows, "the RL-style BF16 tensors should use the v2 method"
    for r in rows:
        split = r["mask_bits_per_change"] + r["value_bits_per_change"]
        assert 0 < r["value_bits_per_change"] and 0 < r["mask_bits_per_change"]
        assert split <= r["bits_per_change"] + 1e-9  # the stream also carries params and the final state


def test_inspect_and_decode_of_a_missing_or_bad_delta(capsys, single):
    d, _, _ = single
    rc, _, err = run(capsys, "inspect", d / "nothing.bin")
    assert rc != 0 and "nothing.bin" in err
    (d / "junk.bin").write_bytes(b"not a delta at all, just some bytes" * 3)
    rc, _, err = run(capsys, "inspect", d / "junk.bin")
    assert rc != 0 and "magic" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, "decode", d / "base.safetensors", d / "junk.bin", "-o", d / "out.safetensors")
    assert rc != 0 and not (d / "out.safetensors").exists()


def test_console_entry_in_a_subprocess(capsys, tmp_path):
    """The real entry point, `python -m relay.cli`, as a shell sees it: a truncated delta exits
    non-zero with one line on stderr and writes nothing (success paths run in-process above)."""
    base, target = model_pair(n_tensors=3, shape=(32, 32), fraction=0.05, seed=9)
    checkpoint.save(base, tmp_path / "b.safetensors")
    checkpoint.save(target, tmp_path / "t.safetensors")
    assert run(capsys, "encode", tmp_path / "b.safetensors", tmp_path / "t.safetensors",
               "-o", tmp_path / "d.bin")[0] == 0
    (tmp_path / "bad.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-1])

    bad = subprocess.run([sys.executable, "-m", "relay.cli", "decode", str(tmp_path / "b.safetensors"),
                          str(tmp_path / "bad.bin"), "-o", str(tmp_path / "x.safetensors")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert bad.returncode == 1, bad.stderr
    assert bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("deltarelay decode: error:") and "checksum" in bad.stderr
    assert not (tmp_path / "x.safetensors").exists()
    assert leftovers(tmp_path) == []
