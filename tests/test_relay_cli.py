"""`deltarelay publish | watch | rebase | gc | status` in-process, and one real subprocess."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from relay import checkpoint
from relay.cli import main
from relay.store import open_store

ROOT = Path(__file__).resolve().parents[1]


def test_cli_round_trip(s3_run, trainer, bits_equal, tmp_path, capsys):
    t = trainer(seed=30)
    opts = json.dumps(s3_run.options)
    states = {}
    for step in range(4):
        states[step] = t.step()
        path = tmp_path / f"ckpt-{step}"
        checkpoint.save(states[step], path, checkpoint.Layout(sharded=True))
        resume = ["--resume"] if step else []
        assert main(["publish", s3_run.url, str(path), "--step", str(step), "--snapshot-every", "2",
                     "--storage-options", opts, *resume]) == 0
    capsys.readouterr()
    assert main(["publish", s3_run.url, str(tmp_path / "ckpt-3"), "--step", "9", "--storage-options", opts]) == 1
    assert "--resume" in capsys.readouterr().err

    dest = tmp_path / "dest"
    assert main(["watch", s3_run.url, "--dest", str(dest), "--once", "--storage-options", opts]) == 0
    assert capsys.readouterr().out.strip().endswith("step 3")
    tensors, _ = checkpoint.load(dest)
    assert bits_equal(tensors, states[3])

    assert main(["status", s3_run.url, "--json", "--storage-options", opts]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert (row["head"], row["base"], row["chain_length"], row["snapshots"]) == (3, 2, 1, [0, 2])
    assert main(["rebase", s3_run.url, "--storage-options", opts]) == 0
    assert "base is now step 3" in capsys.readouterr().out
    assert main(["gc", s3_run.url, "--keep-snapshots", "1", "--storage-options", opts]) == 0
    assert "kept snapshots [3]" in capsys.readouterr().out
    assert main(["status", s3_run.url, "s3://no-such-bucket-x/run", "--storage-options", opts]) == 1
    out = capsys.readouterr().out
    assert "error" in out and s3_run.url in out


def test_cli_watch_partial_replica(file_run, trainer, bits_equal, tmp_path, capsys):
    """`watch --tensors PATTERN` keeps DIR on only the matching tensors, and says so in relay-state.json."""
    t = trainer(seed=32)
    state = t.step()
    checkpoint.save(state, tmp_path / "a.safetensors")
    assert main(["publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", "0"]) == 0
    dest = tmp_path / "dest"
    assert main(["watch", file_run.url, "--dest", str(dest), "--once", "--tensors", "0.*", "--tensors", "4.bias"]) == 0
    tensors, _ = checkpoint.load(dest)
    assert set(tensors) == {"0.weight", "0.bias", "4.bias"}
    assert bits_equal(tensors, {k: state[k] for k in tensors})
    doc = json.loads((dest / "relay-state.json").read_bytes())
    assert doc["partial"] is True and set(doc["tensors"]) == set(tensors)


def test_cli_watch_timeout_leaves_last_good_step(file_run, trainer, bits_equal, tmp_path, capsys):
    t = trainer(seed=31)
    first = t.step()
    checkpoint.save(first, tmp_path / "a.safetensors")
    assert main(["publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", "0"]) == 0
    dest = tmp_path / "dest"
    assert main(["watch", file_run.url, "--dest", str(dest), "--once"]) == 0
    checkpoint.save(t.step(), tmp_path / "b.safetensors")
    assert main(["publish", file_run.url, str(tmp_path / "b.safetensors"), "--step", "1", "--resume"]) == 0
    open_store(file_run.url).delete(["deltas/1-0.drd"])  # named by the manifest, not in the store
    capsys.readouterr()
    assert main(["watch", file_run.url, "--dest", str(dest), "--once", "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert "gave up after 0.3s" in err and "deltas/1-0.drd" in err
    tensors, _ = checkpoint.load(dest)
    assert bits_equal(tensors, first)


def test_cli_subprocess(s3_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=32)
    checkpoint.save(t.step(), tmp_path / "a.safetensors")
    opts = json.dumps(s3_run.options)
    assert main(["publish", s3_run.url, str(tmp_path / "a.safetensors"), "--step", "5", "--storage-options", opts]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "watch", s3_run.url, "--dest", str(tmp_path / "d"),
                           "--once", "--timeout", "30", "--storage-options", opts],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "step 5" in proc.stdout
    tensors, _ = checkpoint.load(tmp_path / "d")
    assert bits_equal(tensors, t.state())


def test_rebase_script(file_run, trainer, monkeypatch, capsys):
    t = trainer(seed=33)
    src = file_run.url.removeprefix("file://") + "-a.safetensors"
    checkpoint.save(t.step(), src)
    assert main(["publish", file_run.url, src, "--step", "0"]) == 0
    checkpoint.save(t.step(), src)
    assert main(["publish", file_run.url, src, "--step", "1", "--resume"]) == 0
    monkeypatch.setattr(sys, "argv", ["rebase.py", file_run.url])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "scripts" / "rebase.py"), run_name="__main__")
    assert exc.value.code == 0
    assert "base is now step 1" in capsys.readouterr().out


def test_rebase_gives_up_after_its_timeout_on_a_missing_object(file_run, trainer, capsys):
    """A delta the manifest names that never arrives: `rebase` exits non-zero after --timeout, having committed
    nothing, instead of waiting forever."""
    import time

    t = trainer(seed=34)
    src = file_run.url.removeprefix("file://") + "-b.safetensors"
    for step in range(3):
        checkpoint.save(t.step(), src)
        assert main(["publish", file_run.url, src, "--step", str(step), *(["--resume"] if step else [])]) == 0
    store = open_store(file_run.url)
    before = store.read_manifest().data
    store.delete([k for k in store.list("deltas/") if k.startswith("deltas/2-")])
    started = time.monotonic()
    assert main(["rebase", file_run.url, "--timeout", "1"]) != 0
    assert time.monotonic() - started < 30
    assert store.read_manifest().data == before


BAD_URLS = [("s3//bucket/run", "mistyped URL"), ("s3:/bucket/run", "mistyped URL"),
            ("nosuchscheme://bucket/run", "unknown scheme 'nosuchscheme'"), ("s3://", "no bucket"),
            ("s3:///run", "no bucket")]


def test_watch_refuses_a_mistyped_url_at_once(tmp_path):
    """`deltarelay watch s3//bucket/run` (a typo) used to be read as a local path, create it and wait forever in
    silence; the real command now exits 1 with one line naming the URL and the reason, and writes nothing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "watch", "s3//bucket/run", "--dest", "d", "--once"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "'s3//bucket/run'" in proc.stderr and "mistyped URL" in proc.stderr and "s3://bucket/run" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("url,reason", BAD_URLS)
def test_every_command_refuses_malformed_urls(url, reason, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "c.safetensors"
    checkpoint.save({"w": __import__("torch").zeros(4, dtype=__import__("torch").bfloat16)}, ckpt)
    for argv in (["publish", url, str(ckpt), "--step", "0"], ["watch", url, "--dest", "d", "--once"],
                 ["gc", url, "--keep-snapshots", "1"], ["rebase", url], ["verify", url], ["status", url],
                 ["relay", "--source", url, "--dest", f"file://{tmp_path}/r", "--once"]):
        assert main(argv) == 1, argv
        said = capsys.readouterr()
        text = said.err + said.out
        assert repr(url) in text and reason in text, (argv, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_cli_errors_name_the_flags(file_run, trainer, tmp_path):
    """Errors the Python API raises in its own words ("pass resume=True") name the flag when the real command
    shows them."""
    t = trainer(seed=35)
    checkpoint.save(t.step(), tmp_path / "a.safetensors")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "relay.cli", *argv], capture_output=True, text=True, env=env,
                              timeout=120, cwd=ROOT)

    assert cli("publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", "0").returncode == 0
    again = cli("publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", "1")
    assert again.returncode == 1 and "--resume" in again.stderr, again.stderr
    partial = cli("watch", file_run.url, "--dest", str(tmp_path / "d"), "--once", "--tensors", "0.*",
                  "--persist", "journal")
    assert partial.returncode == 1 and "--persist full" in partial.stderr and "--tensors" in partial.stderr, \
        partial.stderr


def test_gc_dry_run_lists_what_gc_deletes_and_deletes_nothing(file_run, trainer, tmp_path):
    """`deltarelay gc --dry-run` (the real command) prints each object gc would delete with its bytes, changes
    nothing, and names exactly what the real gc then deletes."""
    t = trainer(seed=36)
    for step in range(5):
        checkpoint.save(t.step(), tmp_path / "a.safetensors")
        assert main(["publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", str(step),
                     "--snapshot-every", "2", *(["--resume"] if step else [])]) == 0
    store = open_store(file_run.url)
    before, manifest = store.list_run(), store.read_manifest().data
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "gc", file_run.url, "--keep-snapshots", "1", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    listed = {}
    for line in proc.stdout.splitlines()[:-1]:
        key, size = line.removeprefix("would delete ").removesuffix(" bytes)").split(" (")
        listed[key] = int(size)
    assert listed and all(k.startswith(("deltas/", "records/", "snapshots/")) for k in listed), proc.stdout
    assert f"would delete {len(listed)} objects ({sum(listed.values())} bytes)" in proc.stdout.splitlines()[-1]
    assert store.list_run() == before and store.read_manifest().data == manifest
    assert {k: before[k] for k in listed} == listed
    assert main(["gc", file_run.url, "--keep-snapshots", "1"]) == 0
    assert set(before) - set(store.list_run()) == set(listed)


def test_cli_publish_prints_what_it_did(file_run, trainer, tmp_path):
    """The real `publish` prints one line from Publisher.publish's result: kind, bytes written, changed fraction."""
    import re

    t = trainer(seed=37)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = []
    for step in range(2):
        checkpoint.save(t.step(), tmp_path / "a.safetensors")
        proc = subprocess.run([sys.executable, "-m", "relay.cli", "publish", file_run.url,
                               str(tmp_path / "a.safetensors"), "--step", str(step), *(["--resume"] if step else [])],
                              capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.strip())
    sizes = open_store(file_run.url).list_run()
    got = re.fullmatch(rf"published to {re.escape(file_run.url)}: step 1: delta, (\d+) bytes written, "
                       r"([\d.]+)% changed; .*s \(encode .*s, upload .*s, commit .*s\)", outs[1])
    assert got, outs
    assert int(got.group(1)) == sum(n for k, n in sizes.items() if k.startswith(("deltas/1-", "records/1")))
    assert 0 < float(got.group(2)) <= 100
    assert outs[0].startswith(f"published to {file_run.url}: step 0: snapshot, ")


def test_watch_and_relay_log_one_line_per_step_by_default(file_run, trainer, tmp_path):
    """A healthy watcher and relay are not silent: the real commands, with no -v, log one INFO line per step
    with the step, the bytes it moved (checked against the store) and seconds."""
    import re

    t = trainer(seed=38)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "relay.cli", *argv], capture_output=True, text=True, env=env,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return proc

    for step in range(2):
        checkpoint.save(t.step(), tmp_path / "a.safetensors")
        assert main(["publish", file_run.url, str(tmp_path / "a.safetensors"), "--step", str(step),
                     *(["--resume"] if step else [])]) == 0
        watched = cli("watch", file_run.url, "--dest", str(tmp_path / "d"), "--once", "--no-report")
    sizes = open_store(file_run.url).list_run()
    got = re.search(rf"relay.steps INFO {re.escape(str(tmp_path / 'd'))}: now at step 1 \({re.escape(file_run.url)}\): "
                    r"(\d+) bytes downloaded, [\d.]+ s", watched.stderr)
    assert got, watched.stderr
    assert int(got.group(1)) == sizes["deltas/1-0.drd"] + sizes["records/1.json"]
    region = f"file://{tmp_path}/region"
    relayed = cli("relay", "--source", file_run.url, "--dest", region, "--once")
    got = re.search(rf"relay.steps INFO {re.escape(region)}: now at step 1 \(origin 1\): (\d+) bytes copied",
                    relayed.stderr)
    assert got, relayed.stderr
    held = open_store(region).list_run()
    assert int(got.group(1)) == sum(n for k, n in held.items() if k.startswith(("deltas/", "records/", "snapshots/")))
