"""Watcher hardening (adversarial review): one watcher per DEST, all-or-nothing hot-load with retries,
foreign symlinks in DEST, symlinks never followed when cleaning up, bounded refetching of a bad object,
recovery that deletes only a proven-bad version, and what the Reader blames, caches and warns about.

Real stores (file://, moto S3), real processes for the DEST lock and the CLI; nothing of relay is mocked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from relay import checkpoint
from relay import watcher as wmod
from relay.manifest import Manifest, ObjRef, Record
from relay.publisher import Publisher
from relay.signing import generate_keypair
from relay.store import open_store
from relay.watcher import STATE_NAME, SyncError, Watcher

from conftest import Trainer, same_bits

ROOT = Path(__file__).resolve().parents[1]
SHARD = "model-00001-of-00001.safetensors"


def publish(url: str, n: int, *, seed: int = 7, options: dict | None = None, **kw) -> list[dict]:
    """Publish steps 0..n-1 of a small trainer; returns each step's state."""
    t = Trainer(seed=seed)
    states = []
    with Publisher(url, storage_options=options, background=False, **kw) as pub:
        for step in range(n):
            states.append(t.state() if step == 0 else t.step())
            pub.publish(states[-1], step)
    return states


def store_path(run, key: str) -> Path:
    return Path(run.url.removeprefix("file://")) / key


def rewrite_object(run, key: str, data: bytes) -> None:
    """Replace an object's bytes in a file:// store (what a damaged disk or a bucket writer does)."""
    p = store_path(run, key)
    p.unlink()
    p.write_bytes(data)


def manifest_of(run) -> Manifest:
    return Manifest.parse(open_store(run.url, run.options).read_manifest().data)


def commit(run, m: Manifest) -> None:
    store = open_store(run.url, run.options)
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)


def dest_state(dest: Path) -> dict:
    return checkpoint.load(dest)[0]


# -- 5. one watcher per DEST ---------------------------------------------------------------------------
def test_second_watcher_process_on_one_dest_is_refused(file_run, tmp_path):
    """A `watch` service polls DEST; a second `watch --once` on the same DEST (a restart overlap, a second
    unit) exits 1 naming DEST on stderr, and DEST keeps its step. Once the first exits, the lock is free."""
    states = publish(file_run.url, 2)
    dest = tmp_path / "dest"
    log_path = tmp_path / "first.log"
    cmd = [sys.executable, "-m", "relay.cli", "watch", file_run.url, "--dest", str(dest)]
    with open(log_path, "w") as log_file:
        first = subprocess.Popen(cmd + ["--poll-interval", "0.05"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=log_file)
    try:
        deadline = time.monotonic() + 60
        while not (dest / STATE_NAME).exists():
            assert first.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        second = subprocess.run(cmd + ["--once"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, (second.returncode, second.stdout, second.stderr)
        assert str(dest) in second.stderr and "another watcher" in second.stderr, second.stderr
        assert first.poll() is None, "the running watcher must be unaffected"
        assert json.loads((dest / STATE_NAME).read_text())["step"] == 1
        assert same_bits(dest_state(dest), states[1])
    finally:
        first.terminate()
        first.wait(30)
    third = subprocess.run(cmd + ["--once"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert third.returncode == 0 and "step 1" in third.stdout, third.stderr


def test_two_watchers_in_one_process_on_one_dest(file_run, tmp_path):
    """In-process the same: the second Watcher raises DestLocked until the first is closed."""
    publish(file_run.url, 2)
    dest = tmp_path / "dest"
    first = Watcher(file_run.url, dest)
    assert first.sync() == 1
    with pytest.raises(wmod.DestLocked, match=str(dest)):
        Watcher(file_run.url, dest)
    assert issubclass(wmod.DestLocked, SyncError)
    first.close()
    with pytest.raises(SyncError, match="closed"):
        first.sync()
    with Watcher(file_run.url, dest) as second:
        assert second.step == 1
        with pytest.raises(wmod.DestLocked):
            Watcher(file_run.url, dest)
    with Watcher(file_run.url, dest) as third:  # released on leaving the block
        assert third.step == 1


# -- 6. hot-load is all or nothing, and retried ---------------------------------------------------------
def module_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_hot_load_of_a_mismatched_module_changes_nothing_and_is_retried(file_run, tmp_path):
    """A module whose last layer has the wrong shape: the old code copied the first layers and then failed
    (a mixed module). Now the sync persists DEST, raises, leaves the module untouched; once the module is
    fixed the next sync loads it even though the manifest did not change."""
    states = publish(file_run.url, 2)
    module = Trainer(seed=99).model
    module[4] = torch.nn.Linear(96, 8).to(torch.bfloat16)
    before = module_values(module)
    w = Watcher(file_run.url, tmp_path / "dest", module=module)
    with pytest.raises(SyncError, match="module"):
        w.sync()
    assert w.step == 1 and same_bits(dest_state(w.dest), states[1])  # DEST persistence comes first
    assert same_bits(module_values(module), before), "module left mixed"
    module[4] = torch.nn.Linear(96, 16).to(torch.bfloat16)
    assert w.sync() == 1
    assert same_bits(module_values(module), states[1])


def test_hot_load_refuses_a_broadcasting_copy(file_run, tmp_path):
    """A (2, 16) bias would silently take the (16,) tensor by broadcasting: refused, module unchanged."""
    publish(file_run.url, 2)
    module = Trainer(seed=99).model
    module[4].bias = torch.nn.Parameter(torch.zeros(2, 16, dtype=torch.bfloat16))
    before = module_values(module)
    w = Watcher(file_run.url, tmp_path / "dest", module=module)
    with pytest.raises(SyncError, match="shape"):
        w.sync()
    assert same_bits(module_values(module), before)


def test_hot_load_failing_mid_copy_restores_the_previous_step(file_run, tmp_path):
    """Shapes and dtypes fit but one copy_ fails (a parameter whose elements share memory): the tensors
    already copied are restored from the previous held step, so the module stays entirely at that step."""
    url = file_run.url
    t = Trainer(seed=5)
    module = Trainer(seed=99).model
    with Publisher(url, background=False) as pub:
        s0 = t.state()
        pub.publish(s0, 0)
        w = Watcher(url, tmp_path / "dest", module=module)
        assert w.sync() == 0 and same_bits(module_values(module), s0)
        # same shape and dtype, but an expanded tensor: copy_ into it raises
        module[4].weight = torch.nn.Parameter(s0["4.weight"][:1].expand(16, 96))
        held = module_values(module)
        s1 = t.step()
        pub.publish(s1, 1)
    with pytest.raises(SyncError, match="module"):
        w.sync()
    assert w.step == 1 and same_bits(dest_state(w.dest), s1)
    assert same_bits(module_values(module), held), "tensors copied before the failure were not restored"
    module[4].weight = torch.nn.Parameter(s0["4.weight"].clone())
    assert w.sync() == 1 and same_bits(module_values(module), s1)


def test_on_update_failure_is_retried_by_the_next_sync(file_run, tmp_path):
    states = publish(file_run.url, 2)
    calls = []

    def flaky(step: int, tensors: dict) -> None:
        calls.append(step)
        if len(calls) == 1:
            raise RuntimeError("consumer not ready")
        assert same_bits(tensors, states[step])

    w = Watcher(file_run.url, tmp_path / "dest", on_update=flaky)
    with pytest.raises(RuntimeError, match="not ready"):
        w.sync()
    assert w.step == 1
    assert w.sync() == 1 and calls == [1, 1]
    assert w.sync() == 1 and calls == [1, 1]  # delivered: not again


# -- 7. foreign symlinks in DEST --------------------------------------------------------------------------
def hub_style_dest(tmp_path: Path, state: dict) -> tuple[Path, dict[str, Path], dict[str, bytes]]:
    """A DEST laid out like a Hugging Face hub snapshot: visible names are symlinks into a blob cache.
    Returns (dest, name -> blob, blob path -> its bytes)."""
    hub = tmp_path / "hub"
    ckpt = hub / "ckpt"
    checkpoint.save(state, ckpt, checkpoint.Layout(True, {k: SHARD for k in state}))
    blobs = hub / "blobs"
    blobs.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    saved, by_name = {}, {}
    for i, f in enumerate(sorted(ckpt.iterdir())):
        blob = by_name[f.name] = blobs / f"blob{i}"
        os.rename(f, blob)
        saved[str(blob)] = blob.read_bytes()
        os.symlink(os.path.relpath(blob, dest), dest / f.name)
    return dest, by_name, saved


def test_foreign_symlinks_in_dest_are_replaced(file_run, tmp_path, caplog):
    """DEST is an HF hub download of step 0 (symlinks into blobs): after a sync, the visible names serve
    the new step (the old code kept the links, so DEST kept serving the blobs' weights); blobs untouched."""
    states = publish(file_run.url, 2)
    dest, _, saved = hub_style_dest(tmp_path, states[0])
    assert same_bits(dest_state(dest), states[0])
    caplog.set_level(logging.WARNING, logger="relay")
    with Watcher(file_run.url, dest) as w:
        assert w.sync() == 1
    assert same_bits(dest_state(dest), states[1])
    for name in (SHARD, checkpoint.INDEX_NAME):
        assert os.readlink(dest / name) == os.path.join(".current", name)
    assert {p: Path(p).read_bytes() for p in saved} == saved
    assert "replaced a symlink" in caplog.text


def test_restart_repairs_visible_links(file_run, tmp_path):
    """A tool re-pointed a visible name while the watcher was down: the restart restores the link."""
    states = publish(file_run.url, 2)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest) as w:
        assert w.sync() == 1
    (tmp_path / "other").mkdir()
    _, blobs, saved = hub_style_dest(tmp_path / "other", states[0])
    (dest / SHARD).unlink()
    os.symlink(blobs[SHARD], dest / SHARD)
    assert not same_bits(dest_state(dest), states[1])
    with Watcher(file_run.url, dest) as w:
        assert w.step == 1
        assert os.readlink(dest / SHARD) == os.path.join(".current", SHARD)
        assert same_bits(dest_state(dest), states[1])
    assert {p: Path(p).read_bytes() for p in saved} == saved


# -- 8. cleaning up never follows a link ----------------------------------------------------------------------
def precious(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "data.bin").write_bytes(b"keep me")
    (outside / "file.bin").write_bytes(b"keep me too")
    return outside


def intact(outside: Path) -> bool:
    return ((outside / "precious" / "data.bin").read_bytes() == b"keep me"
            and (outside / "file.bin").read_bytes() == b"keep me too")


def test_symlinked_versions_dir_is_unlinked_not_emptied(file_run, tmp_path, caplog):
    states = publish(file_run.url, 2)
    outside = precious(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / ".versions")
    caplog.set_level(logging.WARNING, logger="relay")
    with Watcher(file_run.url, dest) as w:
        assert intact(outside), "start-up deleted a directory outside DEST"
        assert not (dest / ".versions").is_symlink()
        assert w.sync() == 1
    assert intact(outside) and same_bits(dest_state(dest), states[1])
    assert (dest / ".versions").is_dir() and not (dest / ".versions").is_symlink()
    assert ".versions" in caplog.text


def test_symlinked_version_entry_is_unlinked(file_run, tmp_path):
    publish(file_run.url, 2)
    outside = precious(tmp_path)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest) as w:
        assert w.sync() == 1
    planted = dest / ".versions" / "0-deadbeef"
    os.symlink(outside, planted)
    with Watcher(file_run.url, dest) as w:
        assert w.step == 1
    assert not os.path.lexists(planted) and intact(outside)


def test_current_pointing_outside_versions_is_not_trusted(file_run, tmp_path, caplog):
    """.current must name .versions/<name>: a link to a (valid-looking) copy elsewhere is dropped, not loaded."""
    states = publish(file_run.url, 2)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest) as w:
        assert w.sync() == 1
    elsewhere = tmp_path / "elsewhere"
    real = dest / ".versions" / os.path.basename(os.readlink(dest / ".current"))
    os.rename(real, elsewhere)
    os.unlink(dest / ".current")
    os.symlink(elsewhere, dest / ".current")
    caplog.set_level(logging.WARNING, logger="relay")
    with Watcher(file_run.url, dest) as w:
        assert w.step is None
        assert not os.path.lexists(dest / ".current")
        assert elsewhere.is_dir() and (elsewhere / STATE_NAME).is_file()
        assert w.sync() == 1 and same_bits(dest_state(dest), states[1])
    assert ".current" in caplog.text


# -- 10. a bad object is not refetched at every poll --------------------------------------------------------
def corrupt(run, key: str) -> bytes:
    good = store_path(run, key).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    rewrite_object(run, key, bytes(bad))
    return good


def test_corrupt_object_backs_off_then_repaired_object_is_used(file_run, tmp_path):
    url = file_run.url
    t = Trainer(seed=8)
    with Publisher(url, background=False, snapshot_every=100) as pub:
        pub.publish(t.state(), 0)
        pub.publish(t.step(), 1)
        w = Watcher(url, tmp_path / "dest", failure_backoff_initial=1.0, failure_backoff_max=8.0)
        assert w.sync() == 1
        pub.publish(s2 := t.step(), 2)
    m = manifest_of(file_run)
    delta, rec = m.step(2).parts[0].ref, m.step(2).record
    good = corrupt(file_run, delta.key)
    before = w.bytes_downloaded
    t0 = time.monotonic()
    for _ in range(20):  # 20 polls: the old code downloaded the delta twice at each
        with pytest.raises(SyncError, match="no verified path"):
            w.sync()
    assert time.monotonic() - t0 < 1.0, "premise: the polls ran within the first backoff"
    # fetched, refetched once, then backed off; the record's fetch runs beside the delta's and is cancelled
    # when the delta fails first (Executor.map), so it counts once or not at all
    assert 2 * delta.size <= w.bytes_downloaded - before <= 2 * delta.size + rec.size
    first = w.reader._failures[delta]  # when the backoff ends, from the failure itself (not from t0: load varies)
    assert first.count == 1
    time.sleep(max(0.0, first.retry_at - time.monotonic() + 0.05))
    before = w.bytes_downloaded
    with pytest.raises(SyncError):
        w.sync()  # the backoff ran out: one more try of the plan (no immediate refetch), then twice as long
    second = w.reader._failures[delta]
    assert second.count == 2 and 1.9 <= second.retry_at - time.monotonic() + 0.1
    assert delta.size <= w.bytes_downloaded - before <= delta.size + rec.size
    rewrite_object(file_run, delta.key, good)  # repaired, same reference
    mid = w.bytes_downloaded
    for _ in range(5):
        with pytest.raises(SyncError):
            w.sync()
    assert w.bytes_downloaded == mid, "downloaded within the backoff"
    time.sleep(max(0.0, second.retry_at - time.monotonic() + 0.05))
    assert w.sync() == 2 and same_bits(w.tensors, s2)


def test_new_reference_is_a_fresh_try(file_run, tmp_path):
    """The manifest named a wrong tag (the object is fine): a manifest with the right reference is tried at
    once, backoff or not, because failures are remembered per reference, not per key."""
    states = publish(file_run.url, 2)
    m = manifest_of(file_run)
    step1 = m.step(1)
    part = step1.parts[0]
    wrong = dataclasses.replace(part, ref=dataclasses.replace(part.ref, xxh3="0" * 32))
    m.steps[-1] = dataclasses.replace(step1, parts=(wrong,))
    commit(file_run, m)
    w = Watcher(file_run.url, tmp_path / "dest", failure_backoff_initial=600.0)
    with pytest.raises(SyncError, match="no verified path"):
        w.sync()  # snapshot 0 plus the chain: the only path
    m.steps[-1] = step1
    commit(file_run, m)
    assert w.sync() == 1 and same_bits(w.tensors, states[1])


def test_newer_snapshot_is_used_without_refetching_the_bad_object(file_run, tmp_path):
    url = file_run.url
    t = Trainer(seed=9)
    with Publisher(url, background=False, snapshot_every=3) as pub:
        pub.publish(t.state(), 0)
        pub.publish(t.step(), 1)
        w = Watcher(url, tmp_path / "dest", failure_backoff_initial=600.0)
        assert w.sync() == 1
        pub.publish(t.step(), 2)
        corrupt(file_run, manifest_of(file_run).step(2).parts[0].ref.key)
        with pytest.raises(SyncError):
            w.sync()
        pub.publish(s3 := t.step(), 3)
    m = manifest_of(file_run)
    assert m.snapshot(3) is not None
    before = w.bytes_downloaded
    assert w.sync() == 3 and same_bits(w.tensors, s3)
    assert w.bytes_downloaded - before == m.snapshot(3).bytes + m.step(3).record.size


# -- a. recovery removes only a proven-bad version ----------------------------------------------------------
LOW_MEMORY = r'''
import resource, sys
import relay

def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

resource.setrlimit(resource.RLIMIT_AS, (vm() + (16 << 20), resource.RLIM_INFINITY))
try:
    relay.Watcher(sys.argv[1], sys.argv[2])
except MemoryError as exc:
    print("MemoryError", exc)
    sys.exit(3)
print("started")
'''


def test_memory_error_at_start_deletes_nothing(tmp_path):
    """A watcher restarted under memory pressure (a real address-space limit, 16 MiB over what it has mapped,
    and a 48 MiB held step) fails with MemoryError and leaves DEST's version alone."""
    url = f"file://{tmp_path}/store/run"
    state = {"w": torch.arange(24 << 20, dtype=torch.int32).to(torch.bfloat16)}
    with Publisher(url, background=False) as pub:
        pub.publish(state, 0)
    dest = tmp_path / "dest"
    with Watcher(url, dest) as w:
        assert w.sync() == 0
    versions = sorted(p.name for p in (dest / ".versions").iterdir())
    proc = subprocess.run([sys.executable, "-c", LOW_MEMORY, url, str(dest)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert sorted(p.name for p in (dest / ".versions").iterdir()) == versions
    with Watcher(url, dest) as w:
        assert w.step == 0 and same_bits(w.tensors, state)


def test_proven_bad_version_is_still_removed(file_run, tmp_path, caplog):
    publish(file_run.url, 2)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest) as w:
        assert w.sync() == 1
    version = dest / ".versions" / os.path.basename(os.readlink(dest / ".current"))
    shard = version / SHARD
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])  # truncated: safetensors cannot parse it
    with Watcher(file_run.url, dest) as w:
        assert w.step is None and not version.exists()
        assert w.sync() == 1


# -- b. a snapshot that does not match its record is blamed alone ---------------------------------------------
def test_bad_snapshot_does_not_exclude_the_head_record(file_run, tmp_path):
    """Snapshot 2 (the head) was rewritten with consistent tags but other weights: it fails against record 2.
    Only the snapshot is blamed, so a fresh watcher reaches 2 from snapshot 0 and the chain."""
    states = publish(file_run.url, 3, snapshot_every=2)
    m = manifest_of(file_run)
    i = next(i for i, s in enumerate(m.snapshots) if s.step == 2)
    snap = m.snapshots[i]
    ref = snap.files[0]
    tensors = st_load(store_path(file_run, ref.key).read_bytes())
    tensors["0.bias"] = tensors["0.bias"] + 1
    forged = st_save(tensors)
    rewrite_object(file_run, ref.key, forged)
    m.snapshots[i] = dataclasses.replace(snap, files=(ObjRef.of(ref.key, forged),))
    commit(file_run, m)
    with Watcher(file_run.url, tmp_path / "dest", retry_initial=0.01) as w:
        assert w.sync(timeout=30) == 2 and same_bits(w.tensors, states[2])


# -- c. cached bytes are reused only for the reference they were checked against ------------------------------
def test_cache_is_keyed_by_reference(s3_run, tmp_path):
    """While a sync waits for a missing delta, the manifest is re-committed naming another record for the
    head (new bytes, new tags). The retry must use the record the manifest now names, not bytes cached
    from the first attempt that were checked against the old reference.

    moto behind the fault proxy: the delta's GET is delayed 0.5 s (then 404s), so the record is certainly
    fetched and cached in the first attempt; the swap happens while the reader sleeps before retrying."""
    from faultproxy import FaultProxy

    run = s3_run
    publish(run.url, 2, options=run.options)
    proxy = FaultProxy(run.region.endpoint, seed=1).start()
    dest = tmp_path / "dest"
    w = Watcher(run.url, dest, storage_options=proxy.options(run.options), retry_initial=1.5, retry_max=1.5)
    assert w.sync() == 1
    with Publisher(run.url, storage_options=run.options, background=False, resume=True) as pub:
        pub.publish(s2 := Trainer(seed=11).step(), 2)
    m = manifest_of(run)
    rec_ref, delta = m.step(2).record, m.step(2).parts[0].ref
    s3 = run.region.client()
    obj = lambda key: f"run/{key}"  # noqa: E731
    rec = Record.parse(s3.get_object(Bucket=run.bucket, Key=obj(rec_ref.key))["Body"].read())
    renamed = "model-00009-of-00009.safetensors"
    forged = dataclasses.replace(rec, weight_map={k: renamed for k in rec.weight_map}).to_bytes()
    delta_bytes = s3.get_object(Bucket=run.bucket, Key=obj(delta.key))["Body"].read()
    s3.delete_object(Bucket=run.bucket, Key=obj(delta.key))  # step 2's delta has not arrived yet

    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting"):
                waiting.set()

    def swap() -> None:  # while the watcher sleeps between attempts
        if waiting.wait(30):
            s3.put_object(Bucket=run.bucket, Key=obj(rec_ref.key), Body=forged)
            m.steps[-1] = dataclasses.replace(m.steps[-1], record=ObjRef.of(rec_ref.key, forged))
            commit(run, m)
        s3.put_object(Bucket=run.bucket, Key=obj(delta.key), Body=delta_bytes)

    proxy.add("delay", methods=("GET",), key=r"/deltas/2-", seconds=0.5, times=1)
    handler = Seen(logging.INFO)
    logger = logging.getLogger("relay.watcher")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    helper = threading.Thread(target=swap)
    helper.start()
    try:
        assert w.sync(timeout=60) == 2
    finally:
        waiting.set()
        helper.join(40)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        proxy.stop()
        w.close()
    assert len(proxy.injected("delay")) == 1
    index = json.loads((dest / checkpoint.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {renamed}
    assert same_bits(dest_state(dest), s2)


# -- d. a signed run read without keys is said so -------------------------------------------------------------
def test_signed_run_without_trusted_keys_warns_once(tmp_path, caplog):
    key, pub, _ = generate_keypair(tmp_path / "keys" / "a")
    url = f"file://{tmp_path}/store/run"
    publish(url, 2, signing_key=key)
    caplog.set_level(logging.WARNING, logger="relay")
    with Watcher(url, tmp_path / "dest") as w:
        assert w.sync() == 1
        assert w.sync() == 1
    assert caplog.text.count("run is signed but this watcher trusts no key") == 1
    assert "--trusted-key" in caplog.text
    caplog.clear()
    with Watcher(url, tmp_path / "dest2", trusted_keys=[pub]) as w:
        assert w.sync() == 1
    unsigned = f"file://{tmp_path}/store/unsigned"
    publish(unsigned, 1)
    with Watcher(unsigned, tmp_path / "dest3") as w:
        assert w.sync() == 0
    assert "trusts no key" not in caplog.text


def test_a_watcher_a_forged_head_moved_past_the_trainer_is_repaired_once_by_accept_older_head(tmp_path):
    """An unsigned run: a bucket writer commits a manifest whose head is step 2**62 (the trainer's own step-3
    weights under a new step number: nothing looks wrong), and a watcher moves there. Once the bucket is
    repaired the watcher refuses every real head, across restarts: it never moves back. accept_older_head=6
    (`deltarelay watch --accept-older-head 6`) takes that older head once; after that the rule holds again."""
    from relay.manifest import Snapshot, Step
    from relay.manifest import record_key as rkey
    from relay.manifest import snapshot_prefix as sprefix

    url = f"file://{tmp_path}/run"
    trainer = Trainer(seed=5)
    states = {}
    pub = Publisher(url, snapshot_every=3, background=False, snapshot_fraction=100.0)
    for step in range(5):
        states[step] = trainer.state() if step == 0 else trainer.step()
        pub.publish(states[step], step)
    pub.close()
    store = open_store(url)
    genuine = store.read_manifest().data
    huge = 1 << 62
    m = Manifest.parse(genuine)
    rec = json.loads(store.get(m.step(3).record.key))
    rec["step"] = huge
    rec_bytes = json.dumps(rec).encode()
    store.put_new(rkey(huge), rec_bytes)
    refs = []
    for ref in (m.snapshot(3).index, *m.snapshot(3).files):
        key = sprefix(huge) + ref.key.rsplit("/", 1)[1]
        store.put_new(key, store.get(ref.key))
        refs.append(ObjRef(key, ref.size, ref.xxh3))
    m.steps.append(Step(huge, ObjRef.of(rkey(huge), rec_bytes)))
    m.snapshots.append(Snapshot(huge, refs[0], tuple(refs[1:])))
    m.head = huge
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    dest = tmp_path / "dest"
    with Watcher(url, dest, report_interval=None) as w:
        assert w.sync(timeout=30) == huge

    store.commit_manifest(genuine, store.read_manifest().etag)  # repaired; the trainer goes on
    with Publisher(url, snapshot_every=3, background=False, resume=True) as pub:
        for step in (5, 6):
            states[step] = trainer.step()
            pub.publish(states[step], step)
    with Watcher(url, dest, report_interval=None) as w:
        assert w.sync(timeout=30) == huge  # never moves back on its own
    with Watcher(url, dest, report_interval=None, accept_older_head=6) as w:
        assert w.sync(timeout=30) == 6 and same_bits(w.tensors, states[6])
        assert w.accept_older_head is None
        assert same_bits(dest_state(dest), states[6])
        replay = Manifest.parse(genuine)  # an older manifest of the run again: kept at 6 (once means once)
        store.commit_manifest(replay.to_bytes(), store.read_manifest().etag)
        assert w.sync(timeout=30) == 6
    with Watcher(url, dest, report_interval=None) as w:  # DEST holds 6 across a restart
        assert w.step == 6


def test_a_new_tensor_selection_still_never_moves_back_or_across_runs(tmp_path):
    """A watcher restarted with another selection (`tensors=`) cannot build on DEST's step and starts from a
    snapshot, but what DEST held still pins it: a replayed older manifest of the run is refused, as it would
    be for the held step itself, and the repaired bucket is followed again."""
    url = f"file://{tmp_path}/run"
    trainer = Trainer(seed=9)
    pub = Publisher(url, snapshot_every=2, background=False, snapshot_fraction=100.0)
    states = {}
    manifests = {}
    store = open_store(url)
    for step in range(5):
        states[step] = trainer.state() if step == 0 else trainer.step()
        pub.publish(states[step], step)
        manifests[step] = store.read_manifest().data
    pub.close()
    dest = tmp_path / "dest"
    with Watcher(url, dest, report_interval=None) as w:
        assert w.sync(timeout=30) == 4
    name = sorted(states[4])[0]
    store.commit_manifest(manifests[2], store.read_manifest().etag)  # a replayed older manifest
    with Watcher(url, dest, report_interval=None, tensors=[name]) as w:
        assert w.step is None  # another selection: not built on
        with pytest.raises(SyncError, match="held step 4"):
            w.sync(timeout=30)
        store.commit_manifest(manifests[4], store.read_manifest().etag)  # repaired
        assert w.sync(timeout=30) == 4 and same_bits(w.tensors, {name: states[4][name]})
