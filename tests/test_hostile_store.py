"""Hostile stores: whoever can write the bucket controls every byte a watcher reads before it checks a
signature. The parsers must fail only with ManifestError (no other exception, no hang, no allocation
driven by the input), and no name from a manifest, record or payload may create a file outside DEST."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.manifest import (MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, Manifest, ManifestError, ObjRef, Record, Step,
                            TensorInfo, safe_shard_name, step_of_key)
from relay.publisher import Publisher
from relay.store import UnsafeStorePath, open_store
from relay.watcher import SyncError, Trail, Watcher

from conftest import Trainer, publish_steps, same_bits

H32, H64 = "a" * 32, "b" * 64


def _ref(key, size=10, strong=False):
    return {"key": key, "size": size, "xxh3": H32, **({"sha256": H64} if strong else {})}


def valid_manifest_doc(signed: bool = False) -> dict:
    doc = {"format": "deltarelay.manifest", "version": 1, "run": "a" * 32, "head": 2, "base": 0,
           "snapshots": [{"step": 0, "index": _ref("snapshots/0/model.safetensors.index.json", strong=signed),
                          "files": [_ref("snapshots/0/model-00001-of-00001.safetensors", 99, signed)]}],
           "steps": [{"step": 0, "record": _ref("records/0.json", strong=signed), "parent": None, "parts": None},
                     {"step": 1, "record": _ref("records/1.json", strong=signed), "parent": 0,
                      "parts": [{**_ref("deltas/1-0.drd", strong=signed), "tensors": None}]},
                     {"step": 2, "record": _ref("records/2.json", strong=signed), "parent": 1,
                      "parts": [{**_ref("deltas/2-0.drd", strong=signed), "tensors": ["w", "b"]}]}]}
    if signed:
        doc["signatures"] = [{"key_id": "c" * 16, "sig": "A" * 86 + "=="}]
    return doc


def valid_record_doc() -> dict:
    return {"format": "deltarelay.record", "version": 1, "run": "a" * 32, "step": 2,
            "tensors": {"w": {"dtype": "BF16", "shape": [4, 2], "digest": H32},
                        "b": {"dtype": "F32", "shape": [4], "digest": H32}},
            "weight_map": {"w": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
    | st.sampled_from(["../../etc/x", "/etc/passwd", "snapshots/0/../../x", "records/1.json", "a\x00b",
                       "deltas/99999999999999999999999-0.drd", "x" * 300, H32, H64]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)


def mutate(doc, data) -> object:
    """Replace, delete or add one value somewhere in `doc` (a random walk from the root)."""
    doc = copy.deepcopy(doc)
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans(), label="descend"):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, data.draw(st.sampled_from(keys), label="key")
        node = parent[key]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
    if parent is None:
        return data.draw(json_values, label="root") if action == "replace" else doc
    if action == "replace":
        parent[key] = data.draw(json_values, label="value")
    elif action == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=10), label="new key")] = data.draw(json_values, label="value")
    else:
        parent.append(data.draw(json_values, label="value"))
    return doc


def parse_only_manifest_errors(parse, data: bytes) -> None:
    start = time.monotonic()
    try:
        parse(data)
    except ManifestError:
        pass
    assert time.monotonic() - start < 2.0, "parser took too long on a small input"


# -- parsers ---------------------------------------------------------------------------------------
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.data(), signed=st.booleans(), rounds=st.integers(1, 3))
def test_fuzz_manifest_mutations(data, signed, rounds):
    doc = valid_manifest_doc(signed)
    for _ in range(rounds):
        doc = mutate(doc, data)
    parse_only_manifest_errors(Manifest.parse, json.dumps(doc).encode())


@FUZZ
@given(data=st.data(), rounds=st.integers(1, 3))
def test_fuzz_record_mutations(data, rounds):
    doc = valid_record_doc()
    for _ in range(rounds):
        doc = mutate(doc, data)
    parse_only_manifest_errors(Record.parse, json.dumps(doc).encode())


@FUZZ
@given(raw=st.binary(max_size=400) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bytes(raw):
    parse_only_manifest_errors(Manifest.parse, raw)
    parse_only_manifest_errors(Record.parse, raw)


@pytest.mark.parametrize("data", [
    b"[" * 200_000 + b"]" * 200_000,  # nesting beyond the interpreter's recursion limit
    b'{"head": ' + b"9" * 50_000 + b"}",  # an integer beyond Python's digit limit
    b'{"format": "deltarelay.manifest", "version": 1e999}',
    b'{"a": NaN, "b": -Infinity}',
    b"\xef\xbb\xbf{}",  # a byte order mark
    b"\x00" * 100,
    "{\"run\": \"\udcff\"}".encode("utf-8", "surrogatepass"),
])
def test_pathological_json(data):
    for parse in (Manifest.parse, Record.parse):
        with pytest.raises(ManifestError):
            parse(data)


def test_size_cap_before_parsing():
    """A 64 MiB+ manifest is refused by its length alone: json.loads never sees it."""
    big = b" " * (MAX_MANIFEST_BYTES + 1)
    start = time.monotonic()
    with pytest.raises(ManifestError, match="more than the"):
        Manifest.parse(big)
    with pytest.raises(ManifestError, match="more than the"):
        Record.parse(b" " * (MAX_RECORD_BYTES + 1))
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("key", [
    "../records/1.json", "/records/1.json", "records/../../../etc/passwd", "snapshots/0/../../x.safetensors",
    "snapshots/0/sub/model.safetensors", "snapshots/0/.hidden", "snapshots/0/a\x00b", "snapshots/0/a\\b",
    "snapshots/0/" + "x" * 300, "deltas/" + "9" * 30 + "-0.drd", "records/1.json\n", "snapshots/0/",
    "snapshots/0/ model.safetensors", "records/+1.json", "snapshots/0/caf\u00e9.safetensors",
])
def test_object_keys_that_could_escape_are_refused(key):
    assert step_of_key(key) is None
    doc = valid_manifest_doc()
    doc["steps"][1]["record"]["key"] = key
    with pytest.raises(ManifestError, match="is not a deltas/, records/ or snapshots/ key"):
        Manifest.parse(json.dumps(doc).encode())


BAD_SHARDS = ["../../escaped.safetensors", "../../../escaped.safetensors", "/tmp/abs.safetensors", "..", ".",
              "", ".current", ".versions", "relay-state.json", "model.safetensors.index.json",
              "a/b.safetensors", "a\x00b.safetensors", "x" * 300 + ".safetensors", "model.bin",
              ".hidden.safetensors", "a\nb.safetensors", "a b.safetensors", "C:\\x.safetensors"]


@pytest.mark.parametrize("name", BAD_SHARDS)
def test_record_refuses_unsafe_shard_names(name):
    assert not safe_shard_name(name)
    doc = valid_record_doc()
    doc["weight_map"]["w"] = name
    with pytest.raises(ManifestError, match="weight_map"):
        Record.parse(json.dumps(doc).encode())


def test_too_many_signatures():
    doc = valid_manifest_doc(signed=True)
    doc["signatures"] = doc["signatures"] * 17
    with pytest.raises(ManifestError, match="signatures"):
        Manifest.parse(json.dumps(doc).encode())


# -- the watcher writes only inside DEST --------------------------------------------------------------
def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def held_dest(tmp_path, steps=2, ahead=0):
    """A file:// run with `steps` steps and a watcher DEST on the last, then `ahead` more steps published;
    returns (store, manifest, watcher, states)."""
    url = f"file://{tmp_path}/store/run"
    t = Trainer(seed=4)
    states = []
    with Publisher(url, background=False) as pub:
        for step in range(steps):
            states.append(t.state() if step == 0 else t.step())
            pub.publish(states[-1], step)
    w = Watcher(url, tmp_path / "dest", retry_initial=0.01)
    assert w.sync(timeout=10) == steps - 1
    if ahead:
        with Publisher(url, background=False, resume=True) as pub:
            for step in range(steps, steps + ahead):
                states.append(t.step())
                pub.publish(states[-1], step)
    store = open_store(url)
    return store, Manifest.parse(store.read_manifest().data), w, states


@pytest.mark.parametrize("name", ["../../escaped.safetensors", "../../../escaped.safetensors",
                                  "/tmp/deltarelay-abs-escape.safetensors", "relay-state.json", ".current",
                                  "a\x00b.safetensors", "x" * 300 + ".safetensors"])
def test_forged_record_cannot_write_outside_dest(tmp_path, name):
    """An attacker adds step 2 with the real delta but a record whose weight_map points outside DEST
    (tags recomputed, manifest unsigned): the watcher refuses the record and DEST keeps step 1."""
    store, m, w, states = held_dest(tmp_path, steps=2, ahead=1)
    head = m.step(2)
    rec = Record.parse(store.get(head.record.key))
    doc = json.loads(rec.to_bytes())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = name
    forged = json.dumps(doc).encode()
    store.delete([head.record.key])
    store.put_new(head.record.key, forged)
    m.steps[-1] = Step(2, ObjRef.of(head.record.key, forged), head.parent, head.parts)
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    w2 = Watcher(w.url, tmp_path / "dest2", retry_initial=0.01)
    before = files_under(tmp_path)
    for watcher in (w, w2):
        with pytest.raises(SyncError, match="no verified path"):
            watcher.sync(timeout=10)
    # the only new files: dest2's versions, and in the store each watcher's fleet ledger entry (PROTOCOL §9)
    ledger = re.compile(r"store/run/(fleet/hosts/[^/]+\.json|\.cas-fleet%hosts%[^/]+\.json\.lock)")
    assert {f for f in files_under(tmp_path) - before if not ledger.fullmatch(f)} <= {"dest2/.versions"}
    assert not Path("/tmp/deltarelay-abs-escape.safetensors").exists()
    assert w.step == 1
    w.close()  # one watcher per DEST: restart it to read what it holds
    assert same_bits(Watcher(w.url, tmp_path / "dest").tensors, states[1])


def test_persist_refuses_unsafe_names_even_past_the_parser(tmp_path):
    """Defence in depth at the point of writing: a Record built in code (not parsed) is checked again."""
    store, m, w, states = held_dest(tmp_path)
    tensors = states[1]
    rec = Record(m.run, 5, {k: TensorInfo("BF16", tuple(v.shape), "0" * 32) for k, v in tensors.items()},
                 {k: "../../escaped.safetensors" for k in tensors})
    before = files_under(tmp_path)
    with pytest.raises(SyncError, match="refusing to write shard names"):
        w._persist(rec, tensors, Trail(), in_place=False)
    assert files_under(tmp_path) == before


def test_path_like_tensor_names_stay_inside_dest(tmp_path):
    """Tensor names are data, never paths: a state whose names look like paths (carried in payload headers,
    records and safetensors headers) is published, relayed and persisted with only safe file names."""
    url = f"file://{tmp_path}/store/run"
    names = ["../../evil", "/etc/passwd", "a/b/../../c", "..", "name\x00nul", "\u202egnp.exe"]
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(8, 4, generator=gen).to(torch.bfloat16) for n in names}
    with Publisher(url, background=False) as pub:
        pub.publish(state, 0)
        state = {k: v + 0.25 for k, v in state.items()}
        pub.publish(state, 1)
    dest = tmp_path / "dest"
    w = Watcher(url, dest)
    assert w.sync(timeout=10) == 1 and same_bits(w.tensors, state)
    outside = files_under(tmp_path) - {p for p in files_under(tmp_path) if p.startswith(("store", "dest"))}
    assert outside == set()
    visible = sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))
    assert visible == ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "relay-state.json"]
    w.close()  # one watcher per DEST: restart it to read what it holds
    assert same_bits(Watcher(url, dest).tensors, state)


def test_claimed_huge_sizes_do_not_allocate(tmp_path):
    """A manifest may claim any size; the reader compares what it got, it never allocates what was claimed."""
    store, m, w, states = held_dest(tmp_path, steps=2, ahead=1)
    head = m.step(2)
    part = head.parts[0]
    from relay.manifest import Part

    m.steps[-1] = Step(2, head.record, head.parent, (Part(ObjRef(part.ref.key, 1 << 60, part.ref.xxh3)),))
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    with pytest.raises(SyncError, match="no verified path"):
        w.sync(timeout=10)
    assert w.step == 1


def test_an_oversized_object_costs_a_reader_one_byte_past_its_size(tmp_path, caplog):
    """A bucket writer replaces a step's delta and record with 64 MiB objects: the watcher reads one byte past
    the size the manifest gives (the store's get_at_most), refuses them by size, keeps its step, and takes the
    step once the objects are back. It used to read each whole before comparing sizes."""
    store, m, w, states = held_dest(tmp_path, steps=2, ahead=1)
    head = m.step(2)
    keys = [head.record.key] + [p.ref.key for p in head.parts]
    good = {k: store.get(k) for k in keys}
    root = Path(f"{tmp_path}/store/run")
    huge = bytes(64 << 20)
    for k in keys:
        (root / k).write_bytes(huge)
    before = w.bytes_downloaded
    with pytest.raises(SyncError):
        w.sync(timeout=5)
    assert w.step == 1
    read = w.bytes_downloaded - before
    declared = head.record.size + sum(p.ref.size for p in head.parts)
    assert 0 < read <= 2 * (declared + len(keys)), f"read {read} bytes of objects declared {declared} bytes"
    print(f"read {read} bytes for objects declared {declared} bytes")
    assert "more than the manifest's" in caplog.text
    for k, data in good.items():
        (root / k).write_bytes(data)
    w.reader._failures.clear()  # the objects' backoff: an operator's restart forgets it too
    assert w.sync(timeout=10) == 2 and same_bits(w.tensors, states[2])
    w.close()


def test_dest_symlink_planted_by_another_user_is_not_followed(tmp_path):
    """A visible name in DEST that is a regular file (not the watcher's symlink) stops the persist instead of
    writing through it."""
    store, m, w, states = held_dest(tmp_path, steps=2, ahead=1)
    dest = tmp_path / "dest"
    shard = dest / "model-00001-of-00001.safetensors"
    shard.unlink()
    shard.write_bytes(b"planted")
    with pytest.raises(SyncError, match="regular file"):
        w.sync(timeout=10)
    assert shard.read_bytes() == b"planted" and os.readlink(dest / ".current").startswith(".versions/1-")


# -- planning is linear in the manifest ------------------------------------------------------------------
def reference_plan(m: Manifest, held, excluded):
    """The plain definition: every candidate (the held chain, each snapshot and its chain), the cheapest wins."""
    options = []
    if held is not None and m.chain(held) is not None:
        options.append((None, m.chain(held)))
    options += [(snap, m.chain(snap.step)) for snap in m.snapshots if m.chain(snap.step) is not None]
    best = None
    for snap, chain in options:
        refs = [] if snap is None else [snap.index, *snap.files, m.step(snap.step).record]
        refs += [p.ref for s in chain for p in s.parts]
        refs += [chain[-1].record] if chain else []
        if any(r.key in excluded for r in refs):
            continue
        cost = sum(r.size for r in refs)
        if best is None or cost < best[0]:
            best = (cost, snap, [s.step for s in chain])
    return best


@st.composite
def manifests(draw):
    from relay.manifest import Part, Snapshot

    n = draw(st.integers(1, 12))
    nums = sorted(draw(st.sets(st.integers(0, 40), min_size=n, max_size=n)))
    snap_at = {nums[0]} | {x for x in nums if draw(st.booleans())}
    steps, snaps = [], []
    for i, x in enumerate(nums):
        rec = ObjRef(f"records/{x}.json", draw(st.integers(1, 50)), H32)
        linked = i > 0 and (x not in snap_at or draw(st.booleans())) and draw(st.integers(0, 5)) > 0
        parts = tuple(Part(ObjRef(f"deltas/{x}-{j}.drd", draw(st.integers(0, 500)), H32))
                      for j in range(draw(st.integers(1, 2)))) if linked else None
        if not linked:
            snap_at.add(x)
        steps.append(Step(x, rec, nums[i - 1] if linked else None, parts))
        if x in snap_at:
            files = tuple(ObjRef(f"snapshots/{x}/m{j}.safetensors", draw(st.integers(1, 3000)), H32)
                          for j in range(draw(st.integers(1, 2))))
            snaps.append(Snapshot(x, ObjRef(f"snapshots/{x}/model.safetensors.index.json", 5, H32), files))
    m = Manifest("3" * 32, nums[-1], steps, snaps).validate()
    keys = sorted(m.referenced())
    excluded = set(draw(st.lists(st.sampled_from(keys), max_size=3)))
    held = draw(st.none() | st.sampled_from(nums) | st.integers(0, 45))
    return m, held, excluded


@settings(max_examples=400, deadline=None)
@given(case=manifests())
def test_plan_matches_the_definition(case):
    from relay.watcher import plan_path

    m, held, excluded = case
    want = reference_plan(m, held, excluded)
    got = plan_path(m, held, excluded)
    if want is None:
        assert got is None
    else:
        assert (got.cost, got.snapshot, [s.step for s in got.steps]) == want


def test_long_manifest_plans_in_linear_time():
    """10k steps each with a snapshot: trying every snapshot's chain would be 10^8 steps of Python."""
    from relay.manifest import Part, Snapshot
    from relay.watcher import plan_path

    n = 10_000
    steps = [Step(0, ObjRef("records/0.json", 1, H32))] + [
        Step(i, ObjRef(f"records/{i}.json", 1, H32), i - 1, (Part(ObjRef(f"deltas/{i}-0.drd", 1000, H32)),))
        for i in range(1, n)]
    snaps = [Snapshot(i, ObjRef(f"snapshots/{i}/model.safetensors.index.json", 1, H32),
                      (ObjRef(f"snapshots/{i}/m.safetensors", 10**9, H32),)) for i in range(n)]
    m = Manifest("3" * 32, n - 1, steps, snaps)
    start = time.monotonic()
    plan = plan_path(m, 3)
    assert time.monotonic() - start < 5.0
    assert plan.snapshot is None and len(plan.steps) == n - 4


# -- links planted in a file:// store (issue 37) --------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_links_planted_in_a_file_store_are_never_followed(tmp_path, trainer):
    """Issue 37 (suspected, confirmed): whoever can write a file:// store's directory plants links in it: the
    run's deltas/ directory is moved out and linked back, and so is the newest snapshot's shard. `gc` (run by a
    more privileged operator) listed deltas/ through the link and unlinked the old deltas outside the store
    (`unlink` follows directory links in the path); `verify` and a fresh watcher read both objects from outside
    the store. Every key operation should refuse a link anywhere under the root, naming it, and touch nothing
    outside."""
    root = tmp_path / "store" / "run"
    url = f"file://{root}"
    publish_steps(url, trainer, 8)  # snapshots 0, 3, 6; head 7
    m = Manifest.parse((root / "manifest.json").read_bytes())
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(root / "deltas", outside / "deltas")
    os.symlink(outside / "deltas", root / "deltas")
    shard = root / m.snapshots[-1].files[0].key
    os.rename(shard, outside / shard.name)
    os.symlink(outside / shard.name, shard)
    kept, manifest = _contents(outside), (root / "manifest.json").read_bytes()
    assert sorted(kept) == [*(f"deltas/{s}-0.drd" for s in range(1, 8)), shard.name]

    gc = _cli("gc", url, "--keep-snapshots", "1")
    assert gc.returncode == 1, gc.stderr
    assert f"{root / 'deltas'} is a symbolic link to {outside / 'deltas'}: refused" in gc.stderr, gc.stderr
    assert _contents(outside) == kept, "gc deleted files outside the store"
    assert (root / "manifest.json").read_bytes() == manifest  # refused before anything was trimmed

    check = _cli("verify", url)
    assert check.returncode == 1, check.stdout
    assert f"{shard} is a symbolic link to {outside / shard.name}: refused" in check.stdout, check.stdout
    assert f"{root / 'deltas'} is a symbolic link" in check.stdout, check.stdout

    dest = tmp_path / "dest"
    watch = _cli("watch", url, "--dest", str(dest), "--once", "--timeout", "60", "--no-report", "--no-progress")
    assert watch.returncode == 1, watch.stderr
    assert "is a symbolic link to" in watch.stderr and ": refused" in watch.stderr, watch.stderr
    assert not (dest / shard.name).exists()
    assert _contents(outside) == kept


def test_no_key_operation_of_a_file_store_passes_a_planted_link(tmp_path):
    """The store's side of the case above, per operation: reads, create-only writes, compare-and-swap, listing
    and deletion through a directory link, a file link and a lock-file link all refuse, naming the link, and
    leave the outside as it was; a FIFO in place of an object is refused at once, not waited on."""
    root = tmp_path / "run"
    store = open_store(f"file://{root}")
    store.put_new("records/1.json", b"{}")
    store.put_new("snapshots/3/a.safetensors", b"x" * 10)
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "1-0.drd").write_bytes(b"theirs")
    (outside / "f").write_bytes(b"theirs too")
    os.symlink(outside / "d", root / "deltas")
    os.symlink(outside / "f", root / "records" / "2.json")
    os.symlink(outside / "lock", root / ".cas-regional%snapshots.json.lock")
    os.mkfifo(root / "records" / "3.json")
    kept = _contents(outside)
    spool = os.open(tmp_path / "spool", os.O_RDWR | os.O_CREAT)

    refused = {"get": lambda: store.get("deltas/1-0.drd"),
               "get_at_most": lambda: store.get_at_most("records/2.json", 100),
               "iter_chunks": lambda: list(store.iter_chunks("deltas/1-0.drd")),
               "download": lambda: store.download("records/2.json", spool),
               "read_object": lambda: store.read_object("records/2.json"),
               "put_new": lambda: store.put_new("deltas/2-0.drd", b"ours"),
               "put_new_stream": lambda: store.put_new_stream("deltas/2-0.drd", [b"ours"], 4),
               "commit_object (through a link)": lambda: store.commit_object("deltas/x.json", b"{}", None),
               "commit_object (onto a link)": lambda: store.commit_object("records/2.json", b"{}", None),
               "commit_object (lock)": lambda: store.commit_object("regional/snapshots.json", b"{}", None),
               "list": lambda: store.list("deltas/"),
               "list_run": lambda: store.list_run(),
               "delete (through a link)": lambda: store.delete(["deltas/1-0.drd"]),
               "delete (a link)": lambda: store.delete(["records/2.json"])}
    for what, call in refused.items():
        with pytest.raises(UnsafeStorePath, match="is a symbolic link to") as exc:
            call()
        assert str(outside) in str(exc.value), what
    os.close(spool)
    assert _contents(outside) == kept and not (outside / "lock").exists()
    with pytest.raises(UnsafeStorePath, match="records/3.json is neither a directory nor a regular file"):
        store.get("records/3.json")
    assert store.get("snapshots/3/a.safetensors") == b"x" * 10  # what is the store's own still works
    assert store.list("snapshots/") == {"snapshots/3/a.safetensors": 10}
    store.delete(["snapshots/3/a.safetensors"])
    assert not (root / "snapshots").exists()
