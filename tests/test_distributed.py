"""Sharded publish from torch.distributed trainers (relay.distributed) and partial replicas (#15).

Ranks are real processes (forked, gloo over loopback TCP) publishing to a moto S3 server or a
file:// store; every watcher is checked bit-exact against the trainer's whole state.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from relay.distributed import RowSlice, ShardedPublisher, ShardedPublishError
from relay.manifest import DestState, Manifest, ManifestError, Record
from relay.publisher import Publisher
from relay.store import open_store
from relay.watcher import SyncError, Watcher

from conftest import free_port, same_bits

SHAPES = {"embed.weight": (50, 24), "layer.0.weight": (40, 24), "layer.0.bias": (40,), "layer.1.weight": (12, 40),
          "norm.scale": (3,), "head.weight": (9, 12)}


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The trainer's whole state at `step`: seeded BF16 tensors (one F32), ~2% of elements nudged per step."""
    g = torch.Generator().manual_seed(7)
    state = {k: torch.randn(s, generator=g).to(torch.float32 if k == "norm.scale" else torch.bfloat16)
             for k, s in SHAPES.items()}
    for _ in range(step):
        for t in state.values():
            mask = torch.rand(t.shape, generator=g) < 0.02
            t[mask] = (t.float()[mask] * 1.05 + 0.01).to(t.dtype)
    return state


def rank_state(step: int, rank: int, world: int, layout: str) -> dict[str, Any]:
    """What rank `rank` holds: whole tensors round-robin ("whole"), or row slices of every tensor with at
    least `world` rows, the rest whole on rank 0 ("rows")."""
    state = full_state(step)
    if layout == "dtensor":  # torch's own form of layout (b): Shard(0) DTensors, Replicate for the small ones
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        return {k: distribute_tensor(v, _MESH[0], [Shard(0) if v.shape[0] >= world else Replicate()],
                                     src_data_rank=None) for k, v in state.items()}
    if layout == "whole":
        return {k: v for i, (k, v) in enumerate(state.items()) if i % world == rank}
    out: dict[str, Any] = {}
    for k, v in state.items():
        if v.shape[0] < world:
            if rank == 0:
                out[k] = v
            continue
        chunks = torch.tensor_split(v, world)  # uneven: 50 rows over 4 ranks are 13, 13, 12, 12
        start = sum(c.shape[0] for c in chunks[:rank])
        out[k] = RowSlice(chunks[rank].clone(), start, v.shape[0])
    return out


_MESH: list[Any] = []  # a rank's device mesh, for the dtensor layout


def _rank_main(rank: int, world: int, port: int, url: str, options: dict | None, steps: int, layout: str,
               outdir: str, fault: str | None, kw: dict) -> None:
    """One rank: publish steps 0..steps-1 (rank 0 waits for the test's go-<step> file after each), and write
    what happened to <outdir>/rank-<rank>.json."""
    import torch.distributed as dist

    result: dict[str, Any] = {"published": [], "error": None}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        if layout == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh

            _MESH.append(init_device_mesh("cpu", (world,)))
        warm = None
        if fault is not None and fault.startswith("compiling@"):  # a fresh host: kernels ready from step N on
            import codec

            ready = int(fault.split("@")[1])
            warm = type("Compiling", (), {"step": 0, "done": lambda self: self.step >= ready})()
            codec.warm_up = lambda paths=None, **_: warm
        pub = ShardedPublisher(url, storage_options=options, snapshot_every=kw.pop("snapshot_every", 3),
                               timeout=kw.pop("timeout", 20), **kw)
        retried = False
        for step in range(steps):
            state = rank_state(step, rank, world, layout)
            if warm is not None:
                warm.step = step
            if fault == f"raise@{step}":
                if rank == 1:
                    state["broken"] = "not a tensor"  # rank 1 fails before its part
                else:  # the others upload other bytes than the retry will: replaced then, never named
                    state = rank_state(step + 10, rank, world, layout)
            if fault == f"kill@{step}" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == f"late@{step}" and rank == 1:
                time.sleep(pub.timeout + 3)  # alive, but past the others' timeout
            started = time.monotonic()
            try:
                pub.publish(state, step)
            except ShardedPublishError as exc:
                result["error"] = str(exc)
                result["error_after"] = time.monotonic() - started
                if fault != f"raise@{step}" or retried:
                    break
                retried = True  # every rank saw the error; all retry the step with the right tensors
                result["head_after_error"] = Manifest.parse(pub.store.read_manifest().data).head
                pub.publish(rank_state(step, rank, world, layout), step)
            result["published"].append(step)
            if rank == 0:
                go = Path(outdir) / f"go-{step}"
                deadline = time.monotonic() + 60
                while not go.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
    except BaseException:  # noqa: BLE001 - written for the test to read
        result["error"] = traceback.format_exc()
    (Path(outdir) / f"rank-{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip atexit (the forked parent's handlers)


def run_ranks(world: int, url: str, options: dict | None, steps: int, layout: str, tmp_path: Path,
              fault: str | None = None, each_step: Callable[[int], None] | None = None, **kw: Any) -> list[dict]:
    """Start `world` rank processes, call each_step(step) once each step is committed, join them."""
    outdir = tmp_path / f"ranks-{time.monotonic_ns()}"
    outdir.mkdir()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, url, options, steps, layout, str(outdir), fault,
                                                 dict(kw)))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        store = open_store(url, options)
        for step in range(steps):
            deadline = time.monotonic() + 60
            while True:
                got = store.read_manifest()
                if got is not None and Manifest.parse(got.data).head >= step:
                    break
                if all(not p.is_alive() for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            else:  # pragma: no cover - the loop always breaks
                pass
            if got is None or Manifest.parse(got.data).head < step:
                break
            if each_step is not None:
                each_step(step)
            (outdir / f"go-{step}").touch()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [json.loads((outdir / f"rank-{r}.json").read_text()) if (outdir / f"rank-{r}.json").exists()
            else {"error": "no result (killed)", "published": []} for r in range(world)]


@pytest.mark.parametrize("world, layout", [(2, "whole"), (2, "rows"), (2, "dtensor"),
                                           pytest.param(4, "whole", marks=pytest.mark.slow),
                                           pytest.param(4, "rows", marks=pytest.mark.slow)])
def test_sharded_run_bit_exact_at_every_watcher(s3_run, tmp_path, world, layout):
    """Steps 0-4 (snapshots at 0 and 3): a watcher following every step and a fresh one at the end (snapshot
    files of every rank assembled, then a sliced delta) hold exactly the trainer's whole state."""
    seen = []
    follower = Watcher(s3_run.url, tmp_path / "follow", storage_options=s3_run.options, poll_interval=0.05)

    def check(step: int) -> None:
        assert follower.sync(timeout=20) == step
        assert same_bits(follower.tensors, full_state(step)), step
        seen.append(step)

    results = run_ranks(world, s3_run.url, s3_run.options, 5, layout, tmp_path, each_step=check,
                        max_shard_bytes=3000 // world, snapshot_fraction=100.0)  # snapshots by step count only
    follower.close()
    assert all(r["error"] is None and r["published"] == list(range(5)) for r in results), results
    assert seen == list(range(5))
    m = Manifest.parse(open_store(s3_run.url, s3_run.options).read_manifest().data)
    assert [s.step for s in m.snapshots] == [0, 3]
    head = m.step(4)
    assert len(head.parts) == world and {p.ref.key for p in head.parts} == {f"deltas/4-{r}.drd" for r in range(world)}
    assert all((p.rows is not None) == (layout != "whole") for p in head.parts)
    assert len(m.snapshots[-1].files) > world  # the small cap: several files on some ranks
    with Watcher(s3_run.url, tmp_path / "fresh", storage_options=s3_run.options) as w:
        assert w.sync(timeout=20) == 4
        assert same_bits(w.tensors, full_state(4))
    # DEST verifies on restart against its state file (sliced digests included)
    with Watcher(s3_run.url, tmp_path / "fresh", storage_options=s3_run.options) as w:
        assert w.step == 4 and same_bits(w.tensors, full_state(4))
    rec = Record.parse(open_store(s3_run.url, s3_run.options).get(head.record.key))
    assert set(rec.tensors) == set(SHAPES) and set(rec.weight_map) == set(SHAPES)
    assert all((rec.tensors[k].slices is not None) == (layout != "whole" and SHAPES[k][0] >= world) for k in SHAPES)


def test_sharded_deltas_while_the_encoder_compiles_need_no_kernel(file_run, tmp_path):
    """A fresh host's ranks code their parts without compiled kernels until the warm-up is done (steps 1-2 here:
    sparse-split records, the same format), then with them; a watcher holds every step bit-exact, and the records'
    digests (read from the payloads, not hashed again) are the trainer's."""
    from codec import container
    from codec.methods import conditional, sparse

    follower = Watcher(file_run.url, tmp_path / "follow", poll_interval=0.05)

    def check(step: int) -> None:
        assert follower.sync(timeout=20) == step and same_bits(follower.tensors, full_state(step)), step

    results = run_ranks(2, file_run.url, None, 5, "rows", tmp_path, fault="compiling@3", each_step=check,
                        snapshot_every=100, snapshot_fraction=100.0)
    follower.close()
    assert all(r["error"] is None and r["published"] == list(range(5)) for r in results), results
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    assert [s.step for s in m.snapshots] == [0]
    methods = {s.step: {e.method for p in s.parts for e in container.unpack(store.get(p.ref.key)).entries
                        if e.changes and e.dtype.name == "BF16"} for s in m.steps[1:]}
    assert methods[1] == methods[2] == {sparse.ID} and methods[3] == methods[4] == {conditional.ID}, methods


def test_a_rank_that_raises_fails_the_step_on_every_rank(file_run, tmp_path):
    """Rank 1 raises before its part at step 2: the step is not committed and every rank raises, naming the
    step and the rank; the manifest stays at step 1 until the ranks retry step 2 (rank 0's leftover part
    of other bytes is replaced), and the run goes on bit-exact."""
    heads = []

    def at(step: int) -> None:
        heads.append(Manifest.parse(open_store(file_run.url).read_manifest().data).head)
        with Watcher(file_run.url, tmp_path / f"dest-{step}") as w:
            assert w.sync(timeout=10) == step and same_bits(w.tensors, full_state(step))

    results = run_ranks(2, file_run.url, None, 4, "rows", tmp_path, fault="raise@2", each_step=at)
    for r in results:
        assert r["published"] == [0, 1, 2, 3]
        assert "step 2 not published" in r["error"] and "rank 1: TypeError" in r["error"], r["error"]
    assert [r["head_after_error"] for r in results] == [1, 1]  # step 2 was not visible
    assert heads == [0, 1, 2, 3]
    m = Manifest.parse(open_store(file_run.url).read_manifest().data)
    assert m.head == 3 and m.step(2).parts is not None


def test_a_killed_rank_fails_the_others_within_the_timeout(file_run, tmp_path):
    results = run_ranks(2, file_run.url, None, 4, "whole", tmp_path, fault="kill@2", timeout=8)
    assert results[1]["error"] == "no result (killed)"
    r0 = results[0]
    assert r0["published"] == [0, 1]
    assert "step 2" in r0["error"] and "rank 0 of 2 lost the other ranks" in r0["error"], r0["error"]
    assert r0["error_after"] < 8 + 5
    assert Manifest.parse(open_store(file_run.url).read_manifest().data).head == 1


def test_a_late_rank_fails_the_step_after_the_timeout(file_run, tmp_path):
    """A rank that is alive but later than the timeout: the others give up after the timeout, naming the
    step and their rank; the late one then fails too; the step never becomes visible."""
    results = run_ranks(2, file_run.url, None, 3, "whole", tmp_path, fault="late@1", timeout=4)
    for r in results:
        assert r["published"] == [0] and "step 1" in r["error"], r
    assert 3 < results[0]["error_after"] < 4 + 5
    assert Manifest.parse(open_store(file_run.url).read_manifest().data).head == 0


def _forge(url: str, change: Callable[[dict], None]) -> None:
    store = open_store(url)
    doc = json.loads(store.read_manifest().data)
    change(doc)
    path = Path(url.removeprefix("file://")) / "manifest.json"
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["overlap", "gap", "out-of-range"])
def test_forged_rows_are_refused(file_run, tmp_path, how):
    """A bucket writer who rewrites the head step's parts to overlap, leave a gap or run past a tensor's rows
    never gets a reader to apply them: refused, DEST stays on its verified step."""
    w = Watcher(file_run.url, tmp_path / "dest", failure_backoff_initial=30)

    def at(step: int) -> None:
        if step == 1:
            assert w.sync(timeout=10) == 1

    try:
        results = run_ranks(2, file_run.url, None, 3, "rows", tmp_path, each_step=at)
        assert all(r["error"] is None for r in results), results

        def forge(doc: dict) -> None:
            rows = doc["steps"][-1]["parts"][1]["rows"]
            a, b = rows["embed.weight"]
            rows["embed.weight"] = {"overlap": [a - 1, b], "gap": [a + 1, b], "out-of-range": [a, b + 5]}[how]

        _forge(file_run.url, forge)
        if how == "overlap":  # refused when the manifest is parsed
            with pytest.raises(ManifestError, match="overlap"):
                w.sync(timeout=10)
        else:  # refused by the tiling check, twice, then planned around: no other path to step 2
            with pytest.raises(SyncError, match="no verified path"):
                w.sync(timeout=10)
        assert w.step == 1 and same_bits(w.tensors, full_state(1))
        state = DestState.parse((tmp_path / "dest" / "relay-state.json").read_bytes())
        assert state.step == 1
    finally:
        w.close()


def test_partial_replica_of_a_sharded_run(s3_run, tmp_path):
    """A host serving one tensor downloads the one rank's part and snapshot file that hold it, verifies
    exactly that tensor, and its DEST says it is partial; a full watcher never takes that DEST as its own."""
    results = run_ranks(2, s3_run.url, s3_run.options, 5, "whole", tmp_path, max_shard_bytes=1500)
    assert all(r["error"] is None for r in results), results
    store = open_store(s3_run.url, s3_run.options)
    m = Manifest.parse(store.read_manifest().data)
    wanted = "layer.1.weight"  # index 3: rank 1's
    with Watcher(s3_run.url, tmp_path / "part", storage_options=s3_run.options, tensors=[wanted]) as w:
        fetched: list[str] = []
        get = w.reader.store.get
        download = w.reader.store.download  # snapshot files are spooled to disk, not read with get
        w.reader.store.get = lambda key: fetched.append(key) or get(key)  # type: ignore[method-assign]
        get_at_most = w.reader.store.get_at_most  # records and deltas: read no further than their size
        w.reader.store.get_at_most = (  # type: ignore[method-assign]
            lambda key, limit: fetched.append(key) or get_at_most(key, limit))
        w.reader.store.download = (  # type: ignore[method-assign]
            lambda key, fd, size=None: fetched.append(key) or download(key, fd, size))
        assert w.sync(timeout=20) == 4
        assert set(w.tensors) == {wanted} and same_bits(w.tensors, {wanted: full_state(4)[wanted]})
    snap = m.snapshots[-1]
    files = [k for k in fetched if k.startswith("snapshots/3/") and k.endswith(".safetensors")]
    assert len(files) == 1 and files[0].startswith("snapshots/3/rank-00001-of-00002-")
    assert [k for k in fetched if k.startswith("deltas/")] == ["deltas/4-1.drd"]
    needed = sum(r.size for r in m.refs() if r.key in set(fetched))
    assert w.bytes_downloaded == needed < snap.bytes
    state = DestState.parse((tmp_path / "part" / "relay-state.json").read_bytes())
    assert state.partial and set(state.tensors) == {wanted}
    with Watcher(s3_run.url, tmp_path / "part", storage_options=s3_run.options) as full:
        assert full.step is None  # a partial DEST does not pass for a full one
        assert full.sync(timeout=20) == 4 and same_bits(full.tensors, full_state(4))
    assert not DestState.parse((tmp_path / "part" / "relay-state.json").read_bytes()).partial


def test_partial_replica_of_a_single_process_run(s3_run, tmp_path):
    """A single-process run's snapshot is in the record's weight_map layout: a partial replica fetches only
    the files holding its tensors (the delta has one part covering everything, so that one comes whole)."""
    with Publisher(s3_run.url, storage_options=s3_run.options, snapshot_every=3, background=False,
                   max_shard_bytes=2500) as pub:
        for step in range(5):
            pub.publish(full_state(step), step)
    wanted = ["layer.0.weight", "layer.0.bias"]
    store = open_store(s3_run.url, s3_run.options)
    m = Manifest.parse(store.read_manifest().data)
    rec = Record.parse(store.get(m.step(3).record.key))
    holding = {f"snapshots/3/{rec.weight_map[k]}" for k in wanted}
    with Watcher(s3_run.url, tmp_path / "dest", storage_options=s3_run.options, tensors=lambda k: k in wanted) as w:
        fetched: list[str] = []
        get = w.reader.store.get
        download = w.reader.store.download  # snapshot files are spooled to disk, not read with get
        w.reader.store.get = lambda key: fetched.append(key) or get(key)  # type: ignore[method-assign]
        get_at_most = w.reader.store.get_at_most  # records and deltas: read no further than their size
        w.reader.store.get_at_most = (  # type: ignore[method-assign]
            lambda key, limit: fetched.append(key) or get_at_most(key, limit))
        w.reader.store.download = (  # type: ignore[method-assign]
            lambda key, fd, size=None: fetched.append(key) or download(key, fd, size))
        assert w.sync(timeout=20) == 4
        assert same_bits(w.tensors, {k: full_state(4)[k] for k in wanted})
    assert {k for k in fetched if k.endswith(".safetensors")} == holding
    assert len(m.snapshots[-1].files) > len(holding)
    # one delta part per snapshot file: only the parts listing a selected tensor are downloaded
    head = Manifest.parse(store.read_manifest().data).step(4)
    needed = {p.ref.key for p in head.delta_parts if p.tensors is None or set(p.tensors) & set(wanted)}
    assert needed and {k for k in fetched if k.startswith("deltas/")} == needed


def test_partial_replica_restarts_on_its_own_dest(file_run, tmp_path):
    """A partial watcher restarted on its DEST holds its step again and follows the chain from it (parts
    applied to its tensors only); one with another selection starts from a snapshot instead."""
    wanted = ["head.weight"]
    with Publisher(file_run.url, snapshot_every=10, background=False) as pub:
        for step in range(3):
            pub.publish(full_state(step), step)
        with Watcher(file_run.url, tmp_path / "dest", tensors=wanted) as w:
            assert w.sync(timeout=10) == 2
        for step in range(3, 5):
            pub.publish(full_state(step), step)
    with Watcher(file_run.url, tmp_path / "dest", tensors=wanted) as w:
        assert w.step == 2
        fetched: list[str] = []
        get = w.reader.store.get
        w.reader.store.get = lambda key: fetched.append(key) or get(key)  # type: ignore[method-assign]
        get_at_most = w.reader.store.get_at_most  # records and deltas: read no further than their size
        w.reader.store.get_at_most = (  # type: ignore[method-assign]
            lambda key, limit: fetched.append(key) or get_at_most(key, limit))
        assert w.sync(timeout=10) == 4 and same_bits(w.tensors, {k: full_state(4)[k] for k in wanted})
        # the chain from the held step: no snapshot file (snapshot indexes are read once each, to plan)
        assert not any(k.endswith(".safetensors") for k in fetched), fetched
        assert [k for k in fetched if k.startswith("deltas/")] == ["deltas/3-0.drd", "deltas/4-0.drd"]
    with Watcher(file_run.url, tmp_path / "dest", tensors=["layer.0.bias"]) as w:
        assert w.step is None  # holds a tensor this selection does not take
        assert w.sync(timeout=10) == 4 and same_bits(w.tensors, {"layer.0.bias": full_state(4)["layer.0.bias"]})


def test_unknown_selected_tensor_is_a_clear_error(file_run, tmp_path):
    with Publisher(file_run.url, background=False) as pub:
        pub.publish(full_state(0), 0)
    with Watcher(file_run.url, tmp_path / "dest", tensors=["nope"]) as w:
        with pytest.raises(SyncError, match="no tensor.*nope"):
            w.sync(timeout=5)
        assert w.step is None


@pytest.fixture(scope="module")
def sharded_docs(tmp_path_factory) -> dict:
    """The documents of a 2-rank row-sliced run: its manifest, head record and a partial DEST's state file."""
    tmp = tmp_path_factory.mktemp("sharded")
    url = f"file://{tmp}/store/run"
    results = run_ranks(2, url, None, 2, "rows", tmp)
    assert all(r["error"] is None for r in results), results
    store = open_store(url)
    m = Manifest.parse(store.read_manifest().data)
    with Watcher(url, tmp / "dest", tensors=["embed.weight"]) as w:
        w.sync(timeout=10)
    return {"manifest": json.loads(store.read_manifest().data), "record": json.loads(store.get(m.step(1).record.key)),
            "state": json.loads((tmp / "dest" / "relay-state.json").read_bytes()), "url": url, "tmp": tmp}


def test_verify_and_rebase_know_sharded_runs(sharded_docs):
    """verify --deep rebuilds every step of a sliced run (snapshot slices assembled, row parts applied), and
    rebase writes its head as an ordinary snapshot that a fresh watcher starts from."""
    from relay import ops
    from relay.verify import verify

    url, tmp = sharded_docs["url"], sharded_docs["tmp"]
    report = verify(url, deep=True)
    assert report.problems == [] and report.steps_rebuilt == 2
    assert ops.rebase(url) == 1
    with Watcher(url, tmp / "after-rebase") as w:
        assert w.sync(timeout=10) == 1 and same_bits(w.tensors, full_state(1))
    assert verify(url, deep=True).problems == []


def test_sharded_run_documents_follow_the_schemas(sharded_docs):
    from test_schemas import validator

    validator("manifest").validate(sharded_docs["manifest"])
    validator("record").validate(sharded_docs["record"])
    validator("relay-state").validate(sharded_docs["state"])
    assert sharded_docs["state"]["partial"] is True
    assert "rows" in sharded_docs["manifest"]["steps"][1]["parts"][0]
    assert "slices" in sharded_docs["record"]["tensors"]["embed.weight"]


def _rows(d: dict) -> dict:
    return d["steps"][1]["parts"][0]["rows"]


def _slices(r: dict) -> list:
    return r["tensors"]["embed.weight"]["slices"]


# (document, parser, mutation, whether JSON Schema can say it too)
SHARDED_MUTATIONS = [
    ("manifest", Manifest.parse, lambda d: _rows(d).update({"embed.weight": [5, 5]}), False),
    ("manifest", Manifest.parse, lambda d: _rows(d).update({"embed.weight": [-1, 5]}), True),
    ("manifest", Manifest.parse, lambda d: _rows(d).update({"embed.weight": [0, 1, 2]}), True),
    ("manifest", Manifest.parse, lambda d: _rows(d).update({"embed.weight": ["0", 5]}), True),
    ("manifest", Manifest.parse, lambda d: d["steps"][1]["parts"][0].update(rows={}), True),
    ("manifest", Manifest.parse, lambda d: _rows(d).update({"not.listed": [0, 1]}), False),
    ("manifest", Manifest.parse, lambda d: d["steps"][1]["parts"][1]["rows"].update(
        {"embed.weight": [0, 30]}), False),  # overlaps part 0's rows
    ("manifest", Manifest.parse, lambda d: d["steps"][1]["parts"][0].update(tensors=None), False),
    ("record", Record.parse, lambda r: _slices(r)[0].__setitem__(2, "xyz"), True),
    ("record", Record.parse, lambda r: _slices(r).pop(), False),  # a gap at the end
    ("record", Record.parse, lambda r: _slices(r)[0].__setitem__(0, 1), False),  # does not start at 0
    ("record", Record.parse, lambda r: _slices(r)[0].__setitem__(2, "0" * 32), False),  # whole digest no longer fits
    ("record", Record.parse, lambda r: r["tensors"]["embed.weight"].update(slices=[]), True),
    ("record", Record.parse, lambda r: r["tensors"]["embed.weight"].update(shape=[]), False),
    ("state", DestState.parse, lambda s: s.update(partial=False), True),
]


@pytest.mark.parametrize("which, parse, mutate, schema_too", SHARDED_MUTATIONS,
                         ids=[f"{w}-{i}" for i, (w, *_) in enumerate(SHARDED_MUTATIONS)])
def test_sharded_documents_are_parsed_strictly(sharded_docs, which, parse, mutate, schema_too):
    """What the parsers refuse in rows, slices and partial; the field-level rules the schemas refuse too."""
    from test_schemas import validator

    doc = json.loads(json.dumps(sharded_docs[which]))
    doc.pop("check", None)  # a state file's checksum would refuse any edit: the rule itself is under test
    mutate(doc)
    with pytest.raises(ManifestError):
        parse(json.dumps(doc).encode())
    schema = {"state": "relay-state"}.get(which, which)
    assert validator(schema).is_valid(doc) is not schema_too


def test_signed_sharded_run(s3_run, tmp_path):
    """Rank 0 signs every commit and every rank's objects carry their SHA-256: a watcher that trusts only the
    trainer's key follows the run bit-exact."""
    from relay.signing import generate_keypair

    key, pub, _ = generate_keypair(tmp_path / "trainer")
    results = run_ranks(2, s3_run.url, s3_run.options, 3, "rows", tmp_path, signing_key=str(key))
    assert all(r["error"] is None for r in results), results
    m = Manifest.parse(open_store(s3_run.url, s3_run.options).read_manifest().data)
    assert m.signatures and all(r.sha256 is not None for r in m.refs())
    with Watcher(s3_run.url, tmp_path / "dest", storage_options=s3_run.options, trusted_keys=[pub]) as w:
        assert w.sync(timeout=20) == 2 and same_bits(w.tensors, full_state(2))
    # every record carries BLAKE3 (#16): each rank hashed what it holds, sliced tensors per slice
    store = open_store(s3_run.url, s3_run.options)
    from relay.manifest import with_blake3

    for s in m.steps:
        rec = Record.parse(store.get(s.record.key))
        state = full_state(s.step)
        assert any(info.slice_blake3 is not None for info in rec.tensors.values())
        assert all(info.blake3 is not None and with_blake3(info, state[k]) == info for k, info in rec.tensors.items())


def test_sliced_digest_is_the_protocols():
    """PROTOCOL §3.1, computed from its text: xxh3-128 of the prefix, the header, then per slice start and stop
    (8-byte big-endian) and the slice digest's 16 bytes; a whole tensor verifies against it on those rows."""
    import xxhash

    from codec.hashing import digest_elements
    from codec.tensors import element_view
    from relay.manifest import TensorInfo, mismatches, sliced_digest

    t = full_state(1)["embed.weight"]
    bounds = [(0, 20), (20, 50)]
    slices = tuple((a, b, digest_elements("BF16", (b - a, 24), element_view(t[a:b])).hex()) for a, b in bounds)
    raw = b"deltarelay.sliced-digest v1\n" + b"BF16[50, 24]" + b"".join(
        a.to_bytes(8, "big") + b.to_bytes(8, "big") + bytes.fromhex(d) for a, b, d in slices)
    assert sliced_digest("BF16", (50, 24), slices) == xxhash.xxh3_128_hexdigest(raw)
    info = TensorInfo("BF16", (50, 24), xxhash.xxh3_128_hexdigest(raw), slices)
    assert mismatches({"embed.weight": t}, {"embed.weight": info}) == []
    other = t.clone()
    other[30, 3] = other[30, 3] + 1
    assert mismatches({"embed.weight": other}, {"embed.weight": info}) == ["embed.weight"]


def test_apply_only_updates_only_the_tensors_held():
    """codec.apply_(only=...): a partial replica applies a part covering more tensors than it holds."""
    import codec

    base, target = full_state(0), full_state(1)
    payload = codec.encode(base, target)
    held = {"layer.0.weight": base["layer.0.weight"].clone()}
    with pytest.raises(codec.DeltaError):
        codec.apply_(dict(held), payload)
    codec.apply_(held, payload, only=held)
    assert same_bits(held, {"layer.0.weight": target["layer.0.weight"]})
    with pytest.raises(codec.DeltaError):  # a tensor the payload does not name is still an error
        codec.apply_({"nope": torch.zeros(3)}, payload, only={"nope"})


def test_whole_infos_refuses_ranks_that_do_not_tile():
    """The record is built from the ranks' reports only when they tile every tensor (checked on every rank)."""
    from relay.distributed import whole_infos

    d = "0" * 32

    def rep(**infos: Any) -> dict:
        return {"infos": infos}

    ok = whole_infos(3, [rep(a=("BF16", (4, 2), d, (0, 2)), b=("F32", (3,), d, None)),
                         rep(a=("BF16", (4, 2), d, (2, 4)))])
    assert ok["a"].slices == ((0, 2, d), (2, 4, d)) and ok["b"].slices is None
    cases = [([rep(a=("BF16", (4, 2), d, (0, 2))), rep(a=("BF16", (4, 2), d, (1, 4)))], "overlap"),
             ([rep(a=("BF16", (4, 2), d, (0, 2))), rep(a=("BF16", (4, 2), d, (3, 4)))], "gap"),
             ([rep(a=("BF16", (4, 2), d, (0, 2))), rep()], "rows 0-2"),
             ([rep(a=("BF16", (4, 2), d, None)), rep(a=("BF16", (4, 2), d, None))], "another rank"),
             ([rep(a=("BF16", (4, 2), d, (0, 2))), rep(a=("F32", (4, 2), d, (2, 4)))], "another as"),
             ([rep(), rep()], "no rank holds")]
    for reports, message in cases:
        with pytest.raises(ShardedPublishError, match=message):
            whole_infos(3, reports)


def test_compressed_snapshot_files_may_not_decode_past_the_record():
    """shards.assemble: compressed snapshot files may hold, all together, at most the tensor bytes the
    step's record lists (checked before each tensor is read: zstd frames of a few KB can declare GBs)."""
    import codec
    from relay import shards
    from relay.manifest import ObjRef, TensorInfo

    d = "0" * 32
    infos = {"a": TensorInfo("BF16", (1 << 20,), d), "b": TensorInfo("F32", (4,), d)}
    honest = b"".join(codec.encode_snapshot([("a", torch.zeros(1 << 20, dtype=torch.bfloat16))]))
    rest = b"".join(codec.encode_snapshot([("b", torch.ones(4))]))
    got = shards.assemble([(ObjRef("s/0", len(honest), d), honest), (ObjRef("s/1", len(rest), d), rest)], infos)
    assert set(got) == {"a", "b"}
    bomb = b"".join(codec.encode_snapshot([("a", torch.zeros(1 << 24, dtype=torch.bfloat16))]))  # 16x the record
    with pytest.raises(shards.ShardError, match="past the"):
        shards.assemble([(ObjRef("s/0", len(bomb), d), bomb)], infos)
    with pytest.raises(shards.ShardError, match="past the"):  # the budget is shared by the files
        shards.assemble([(ObjRef("s/0", len(honest), d), honest), (ObjRef("s/1", len(honest), d), honest)], infos)
