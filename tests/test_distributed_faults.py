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
import time
import traceback
from pathlib import Path
from typing import Any, Callable


from relay.distributed import ShardedPublisher, ShardedPublishError
from relay.manifest import Manifest
from relay.store import open_store

from conftest import free_port
from test_distributed import rank_state

Hook = Callable[[int, Any, int], None]


def _main(rank: int, world: int, port: int, url: str, steps: int, layout: str, outdir: str,
          kwargs: Callable[[int], dict], hook: Hook | None, construct_hook: Callable[[int], None] | None) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {"published": [], "error": None, "constructed": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        if construct_hook is not None:
            construct_hook(rank)
        kw = dict(kwargs(rank))
        pub = ShardedPublisher(kw.pop("url", url), **kw)
        result["constructed"] = True
        for step in range(steps):
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
                break
            result["published"].append(step)
    except BaseException:  # noqa: BLE001 - written for the test to read
        result["error"] = traceback.format_exc()
    (Path(outdir) / f"rank-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def ranks(tmp_path: Path, url: str, steps: int, *, world: int = 2, layout: str = "rows",
          kwargs: Callable[[int], dict] | None = None, hook: Hook | None = None,
          construct_hook: Callable[[int], None] | None = None, join: float = 90) -> list[dict]:
    """Run `world` ranks publishing steps 0..steps-1; each rank's result ({published, error, ...})."""
    outdir = tmp_path / f"ranks-{time.monotonic_ns()}"
    outdir.mkdir()
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    kw = kwargs or (lambda rank: {"timeout": 10, "snapshot_every": 3})
    procs = [ctx.Process(target=_main, args=(r, world, port, url, steps, layout, str(outdir), kw, hook,
                                             construct_hook)) for r in range(world)]
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

