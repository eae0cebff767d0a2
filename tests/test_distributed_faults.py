"""relay.distributed.ShardedPublisher with ranks that crash, hang or disagree, as an adversarial review found
them uncovered (docs/RELIABILITY.md has each finding, before and after). Every test states the protocol's
promise (docs/PROTOCOL.md §5.4, the module docstring) it checks.

Ranks are forked processes (gloo over loopback), as in tests/test_distributed.py; each rank's fault is a
closure (fork: nothing is pickled) called with (rank, pub, step) before its publish.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

from relay.distributed import ShardedPublisher, ShardedPublishError
from relay.manifest import Manifest
from relay.store import open_store
from relay.watcher import Watcher

from conftest import free_port, same_bits
from faultproxy import FaultProxy
from test_distributed import full_state, rank_state

Hook = Callable[[int, Any, int], None]


def _main(rank: int, world: int, port: int, url: str, steps: int | list[int], layout: str, outdir: str,
          kwargs: Callable[[int], dict], hook: Hook | None, construct_hook: Callable[[int], None] | None,
          keep_going: bool) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {"published": [], "error": None, "constructed": False, "errors": []}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        if construct_hook is not None:
            construct_hook(rank)
        kw = dict(kwargs(rank))
        pub = ShardedPublisher(kw.pop("url", url), **kw)
        result["constructed"] = True
        for step in range(steps) if isinstance(steps, int) else steps:
            if hook is not None:
                hook(rank, pub, step)
            started = time.monotonic()
            try:
                pub.publish(rank_state(step, rank, world, layout), step)
            except ShardedPublishError as exc:
                result["error"] = str(exc)
                result["committed"] = exc.committed
                result["error_step"] = step
                result["error_after"] = time.monotonic() - started
                result["errors"].append({"step": step, "committed": exc.committed, "error": str(exc)})
                if keep_going:  # a trainer that logs the failure and goes on
                    continue
                break
            result["published"].append(step)
    except BaseException:  # noqa: BLE001 - written for the test to read
        result["error"] = traceback.format_exc()
    (Path(outdir) / f"rank-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def ranks(tmp_path: Path, url: str, steps: int | list[int], *, world: int = 2, layout: str = "rows",
          kwargs: Callable[[int], dict] | None = None, hook: Hook | None = None,
          construct_hook: Callable[[int], None] | None = None, join: float = 90, keep_going: bool = False
          ) -> list[dict]:
    """Run `world` ranks publishing steps 0..steps-1 (or the steps listed); each rank's result ({published,
    error, ...}). A rank stops at its first ShardedPublishError unless `keep_going` (then `errors` lists them)."""
    outdir = tmp_path / f"ranks-{time.monotonic_ns()}"
    outdir.mkdir()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    kw = kwargs or (lambda rank: {"timeout": 10, "snapshot_every": 3})
    procs = [ctx.Process(target=_main, args=(r, world, port, url, steps, layout, str(outdir), kw, hook,
                                             construct_hook, keep_going)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [json.loads((outdir / f"rank-{r}.json").read_text()) if (outdir / f"rank-{r}.json").exists()
            else {"error": "no result (killed or hung)", "published": []} for r in range(world)]


def head(url: str) -> int | None:
    got = open_store(url).read_manifest()
    return None if got is None else Manifest.parse(got.data).head


def test_ranks_that_disagree_on_the_snapshot_schedule_are_refused_at_start(file_run, tmp_path):
    """Rank 1 restarted with another snapshot_every (a per-host config): §5.4 step 3 says "every rank deciding
    from the same numbers". Uncompared, at step 2 rank 1 thought a snapshot due and waited in the snapshot-file
    exchange while rank 0 committed the delta and waited in the outcome broadcast: mismatched collectives,
    a committed step both ranks called not committed. The ranks compare their settings at start and refuse."""
    def kw(rank: int) -> dict:
        return {"timeout": 6, "snapshot_every": 100 if rank == 0 else 2, "snapshot_fraction": 100.0}

    results = ranks(tmp_path, file_run.url, 4, kwargs=kw)
    assert all(not r["constructed"] for r in results), [r["error"] for r in results]
    assert all("rank 1 snapshot_every=2, rank 0 100" in r["error"] for r in results), [r["error"] for r in results]
    assert head(file_run.url) is None


def test_a_commit_slower_than_the_timeout_is_reported_committed_on_every_rank(file_run, tmp_path):
    """Rank 0's manifest commit takes longer than the collective timeout (a throttled store, update_manifest's
    conflict retries): it lands, but rank 1 gives up waiting for the outcome. Both used to raise "nothing was
    committed by this rank". A rank that lost the outcome now says what the manifest shows: committed."""
    def slow_commit(rank: int, pub: Any, step: int) -> None:
        if rank == 0 and step == 1:
            commit = pub.store.commit_manifest

            def late(*a: Any, **k: Any) -> Any:
                out = commit(*a, **k)
                time.sleep(pub.timeout + 3)  # the write has landed; the answer is late
                return out

            pub.store.commit_manifest = late

    results = ranks(tmp_path, file_run.url, 3, kwargs=lambda r: {"timeout": 5, "snapshot_every": 10}, hook=slow_commit)
    committed = head(file_run.url)
    raised = [r.get("error_step") for r in results]
    assert committed == 1 and raised == [1, 1], (committed, [r["error"] for r in results])
    # step 1 is in the manifest: every rank says so, and none that it was not committed
    assert all(r["committed"] is True and "step 1 was committed" in r["error"] for r in results), \
        [r["error"] for r in results]
    assert not any("nothing was committed" in r["error"] for r in results)


def test_a_rank_pointed_at_another_store_is_refused_at_start(tmp_path):
    """Rank 1 is configured with another prefix (per-host config, a regional endpoint). Uncompared, rank 0
    committed in its store a manifest naming rank 1's part and snapshot files, which were in another store.
    PROTOCOL §5.4: "a step is visible only once every rank's objects are in the store". Refused at start."""
    a, b = f"file://{tmp_path}/a/run", f"file://{tmp_path}/b/run"
    results = ranks(tmp_path, a, 2, kwargs=lambda r: {"timeout": 10, "url": a if r == 0 else b})
    store = open_store(a)
    assert store.read_manifest() is None and not store.list_run()
    assert all(not r["constructed"] and "rank 1 store=" in r["error"] for r in results), [r["error"] for r in results]


def test_leftovers_of_a_job_that_died_before_its_first_commit_are_named_at_start(file_run, tmp_path):
    """Job 1's rank 0 is killed (preempted) inside its first manifest commit: records/0.json and the snapshot
    files are in the store, no manifest. Job 2 used to be accepted, then fail at step 0 on every retry
    (its records/0.json differs: another run id; only a manifest proves a leftover replaceable), blaming
    "another publisher". Now it is refused at start, naming the leftovers; once they are removed, a job runs."""
    import signal

    def die_in_commit(rank: int, pub: Any, step: int) -> None:
        if rank == 0 and step == 0:
            pub.store.commit_manifest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)

    first = ranks(tmp_path, file_run.url, 1, kwargs=lambda r: {"timeout": 4, "snapshot_every": 3},
                  hook=die_in_commit)
    assert head(file_run.url) is None and first[0]["error"] == "no result (killed or hung)"
    second = ranks(tmp_path, file_run.url, 3)
    assert all(not r["constructed"] and "records/0.json" in r["error"] and "died before its first commit"
               in r["error"] for r in second), [r["error"][-400:] for r in second]
    store = open_store(file_run.url)
    store.delete(sorted(store.list_run()))  # the operator removes what no manifest names
    third = ranks(tmp_path, file_run.url, 3)
    assert head(file_run.url) == 2 and all(r["published"] == [0, 1, 2] for r in third), \
        [r["error"][-400:] for r in third]



@pytest.mark.parametrize("plan, back", [([0, 1, 2, 3], 3), ([0, 1, 1, 2, 3], 3), ([0, 1, 2, 3], 4)],
                         ids=["next-step", "retry", "still-down-at-the-next-step"])
def test_a_commit_that_landed_unanswered_does_not_wedge_the_sharded_run(s3_run, tmp_path, plan, back):
    """Rank 0's manifest commit of step 1 lands, then the store answers 503 to it and to every re-read (an
    outage through update_manifest's retries): the commit's fate is unknown. Every rank used to raise
    committed=False although step 1 was the head, and every later step was refused as "another publisher
    extended the run": sharded runs cannot resume, so the run was stuck. PROTOCOL §5.4 (the rules of §5.1):
    the error says the step may have landed (committed=None), the next publish reads the manifest first, on
    rank 0 for every rank, and carries on from what landed; a retry of the landed step writes nothing. A store
    still down at the next step fails that step on every rank (nothing written), and the one after settles."""
    proxy = FaultProxy(s3_run.region.endpoint, seed=37).start()
    # botocore retries once inside s3fs's five (as in test_faults_store): the outage costs seconds, not minutes
    opts = proxy.options(s3_run.options, retries={"total_max_attempts": 2, "mode": "legacy"})
    gate = tmp_path / "gate"
    gate.mkdir()
    writes = proxy.add("error", methods=("PUT", "POST", "DELETE"), probability=0.0, name="writes")  # counts only
    calls = {"n": 0}

    def outage(rank: int, pub: Any, step: int) -> None:
        """Every rank, before each publish call: the test looks at the store or changes it, then lets them go."""
        n = calls["n"] = calls["n"] + 1
        (gate / f"at-{n}-{rank}").touch()
        deadline = time.monotonic() + 60
        while not (gate / f"go-{n}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    seen: dict[int, tuple[list[str], bytes | None, int]] = {}  # before call n: the objects, manifest, writes
    store = open_store(s3_run.url, s3_run.options)  # straight to moto: the test's own view
    faults = []

    def conduct() -> None:  # a thread of the test's: it polls files only until the ranks are forked
        for n in range(1, 7):
            deadline = time.monotonic() + 80
            while not all((gate / f"at-{n}-{r}").exists() for r in range(2)):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
            got = store.read_manifest()
            seen[n] = (sorted(store.list_run()), None if got is None else got.data, writes.matched)
            if n == 2:  # step 1's commit reads the manifest, writes it (it lands), then every answer is a 503
                faults.append(proxy.add("error_after", methods=("PUT",), key=r"/manifest\.json$", name="commit"))
                faults.append(proxy.add("error", methods=("GET", "HEAD"), key=r"/manifest\.json$", after=1,
                                        name="re-read"))
            elif n == back:  # the store is back before publish call `back` (the writes are still counted)
                for rule in faults:
                    rule.times = rule.fired
            (gate / f"go-{n}").touch()

    conductor = threading.Thread(target=conduct, daemon=True)
    conductor.start()
    try:
        results = ranks(tmp_path, s3_run.url, plan, keep_going=True, hook=outage, join=150,
                        kwargs=lambda r: {"timeout": 90, "snapshot_every": 10, "storage_options": opts})
    finally:
        conductor.join(5)
        proxy.stop()
    outcomes = [[(e["step"], e["committed"]) for e in r.get("errors", [])] for r in results]
    assert proxy.injected("error_after", r"/manifest\.json$") and proxy.injected("error", r"/manifest\.json$")
    m = Manifest.parse(open_store(s3_run.url, s3_run.options).read_manifest().data)
    # step 1 landed unanswered: every rank says its fate is unknown, none that it was not committed (and a
    # step 2 published while the store is still down fails on every rank, not committed: nothing was written)
    failed = [(1, None)] + [(2, False)] * (back == 4)
    assert outcomes == [failed] * 2, (results, m.head, proxy.summary(), sorted(seen))
    assert all("may have landed" in r["errors"][0]["error"] for r in results), [r["errors"] for r in results]
    if back == 4:
        assert all("cannot read the manifest to learn whether step 1" in r["errors"][1]["error"] for r in results)
        assert seen[4][:3] == seen[3][:3]
    # and the run goes on: the later steps are published and committed on the landed step
    assert all(r["published"] == plan[:1] + plan[back - 1:] for r in results), [r["error"] for r in results]
    steps = [0, 1, 2, 3] if back == 3 else [0, 1, 3]
    assert m.head == 3 and [s.step for s in m.steps] == steps and m.step(steps[2]).parent == 1
    if plan.count(1) == 2:  # the retry of step 1 (calls 3 to 4) found it landed: nothing written, the manifest same
        assert seen[4][0] == seen[3][0] and seen[4][1] == seen[3][1] and seen[4][2] == seen[3][2], \
            (set(seen[4][0]) - set(seen[3][0]), seen[4][2] - seen[3][2])
    with Watcher(s3_run.url, tmp_path / "dest", storage_options=s3_run.options) as w:
        assert w.sync(timeout=30) == 3
        assert same_bits(w.tensors, full_state(3))
