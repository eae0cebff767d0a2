"""relay/publisher.py in the cases an adversarial review found uncovered (docs/RELIABILITY.md has each finding,
before and after): a failed snapshot's memory, close_publishers, copy-on-write accounting, a state no snapshot
can hold."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import relay
import relay.publisher as publisher_mod
from relay.manifest import Manifest
from relay.store import open_store


def _model(n: int = 4, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"w{i}": (torch.randn(rows, 96, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def _bumped(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    for i, t in enumerate(state.values()):
        flat = t.view(-1).view(torch.int16)
        flat[(step * 7 + i) % 5::37] += 1
    return state


class HeldSnapshots:
    """Wraps a store: streamed puts of snapshot files (not step 0's) wait for `release` (then fail, with `fail`)."""

    fail = False

    def __init__(self, store) -> None:
        self.inner = store
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_immutable_stream(self, key, chunks, size, xxh3):
        if key.startswith("snapshots/") and not key.startswith("snapshots/0/"):
            self.entered.set()
            assert self.release.wait(30), "never released"
            if self.fail:
                raise OSError(f"{key}: injected failure")
        return self.inner.put_immutable_stream(key, chunks, size, xxh3)


class GatedSnapshots(HeldSnapshots):
    """HeldSnapshots whose held puts then fail."""

    fail = True


def test_failed_snapshots_do_not_pin_superseded_tensors(file_run):
    """A background snapshot keeps tensors prev has moved past (copy-on-write); once it fails it "lets go of
    everything it holds" (PROTOCOL §5.1) and `_cow.held` says 0. A trainer that never calls flush() (publish
    does not raise for a failed snapshot) under a store refusing snapshot files: every failed snapshot's
    superseded tensors must be freed, not kept alive by the stored exception until flush()."""
    state = _model()
    pub = relay.Publisher(file_run.url, snapshot_every=2, snapshot_fraction=1e9, snapshot_budget=1.0,
                          snapshot_attempts=1, max_shard_bytes=30_000)
    gate = pub.store = GatedSnapshots(pub.store)
    superseded: list[weakref.ref] = []
    alive_per_cycle = []
    try:
        pub.publish(state, 0)
        pub.publish(_bumped(state, 1), 1)
        step = 2
        for _ in range(4):
            pub.publish(_bumped(state, step), step)  # due: a background snapshot, held in the store
            assert gate.entered.wait(10)
            held_by_job = [weakref.ref(t) for t in pub.prev.values()]
            pub.publish(_bumped(state, step + 1), step + 1)  # every tensor changes: handed to the snapshot
            assert all(r() is not pub.prev[k] for r, k in zip(held_by_job, pub.prev))
            superseded += held_by_job
            gate.release.set()
            pub._wait_background()  # the snapshot failed (reported, kept for flush)
            gate.release.clear()
            gate.entered.clear()
            assert pub._cow.held == 0 and not pub._cow.jobs  # the accounting says: all let go
            gc.collect()
            alive_per_cycle.append(sum(r() is not None for r in superseded))
            step += 2
    finally:
        gate.release.set()
        errors = list(pub._errors)
        try:
            pub.close()
        except OSError:
            pass
    assert len(errors) == 4
    assert alive_per_cycle == [0, 0, 0, 0], (
        f"superseded tensors still alive after each failed snapshot (cumulative): {alive_per_cycle}")


def test_close_publishers_closes_every_publisher_when_one_fails(tmp_path, monkeypatch):
    """close_publishers() ("flush and close every publisher opened by `publish`"): the first publisher's
    failed snapshot must not stop the others from being flushed and closed. It used to raise out of the loop:
    the second publisher, already dropped from the registry, was never closed, its snapshot not waited for."""
    from relay.store import LocalStore

    bad, good = f"file://{tmp_path}/bad", f"file://{tmp_path}/good"
    real = LocalStore.put_new_stream
    slow = threading.Event()

    def put_new_stream(store, key, chunks, size, **kw):
        if key.startswith("snapshots/1/"):
            if "/bad/" in store.url + "/":
                raise OSError(f"{key}: injected failure")
            assert slow.wait(30)
        return real(store, key, chunks, size, **kw)

    monkeypatch.setattr(LocalStore, "put_new_stream", put_new_stream)
    monkeypatch.setattr(publisher_mod, "_PUBLISHERS", {})
    opts = dict(snapshot_every=1, snapshot_fraction=1e9, snapshot_attempts=1)
    for url in (bad, good):
        state = _model(2)
        publisher_mod.publish(state, 0, url=url, **opts)
        publisher_mod.publish(_bumped(state, 1), 1, url=url, **opts)  # a background snapshot of step 1
    pubs = dict(publisher_mod._PUBLISHERS)
    timer = threading.Timer(1.0, slow.set)
    timer.start()
    try:
        with pytest.raises(OSError, match="injected"):
            publisher_mod.close_publishers()
        good_pub = pubs[good]
        snaps = [s.step for s in Manifest.parse(open_store(good).read_manifest().data).snapshots]
        assert good_pub._closed and snaps == [0, 1], (
            f"close_publishers() returned with the second publisher open (closed={good_pub._closed}) and its "
            f"snapshot not landed (snapshots {snaps})")
    finally:
        slow.set()
        timer.cancel()
        for p in pubs.values():
            try:
                p.close()
            except OSError:
                pass




@pytest.mark.parametrize("budget", [1.0, 2.0], ids=["retry-waits", "held-leaks"])
def test_a_failed_apply_does_not_leak_copy_on_write_accounting(file_run, monkeypatch, budget):
    """advance="apply": a tensor a pending snapshot still holds is handed to it (`_cow.take`) before apply_
    runs on a clone. If apply_ then fails (DeltaError, MemoryError), prev keeps the tensor and the snapshot
    still shares it, but the hand-over stayed counted in `_cow.held`; the trainer's retry handed it over again
    and overwrote the job's token, so the first one was never subtracted. `held` must be back to 0 once no
    snapshot is pending (otherwise every later snapshot has less budget, and publish waits for nothing)."""
    import codec

    state = _model(3)
    pub = relay.Publisher(file_run.url, snapshot_every=2, snapshot_fraction=1e9, snapshot_budget=budget,
                          advance="apply")
    held = pub.store = HeldSnapshots(pub.store)
    try:
        pub.publish(state, 0)
        pub.publish(_bumped(state, 1), 1)
        pub.publish(_bumped(state, 2), 2)  # a background snapshot of step 2, held in the store
        assert held.entered.wait(10)
        _bumped(state, 3)
        real = codec.apply_
        fails = {"n": 1}

        def apply_once_failing(*a, **kw):
            if fails["n"]:
                fails["n"] -= 1
                raise MemoryError("injected: no memory for the apply")
            return real(*a, **kw)

        monkeypatch.setattr(codec, "apply_", apply_once_failing)
        with pytest.raises(MemoryError):
            pub.publish(state, 3)
        after_failure = pub._cow.held  # nothing was superseded: prev still holds every tensor the job holds
        retry = threading.Thread(target=pub.publish, args=(state, 3))  # the trainer's retry
        retry.start()
        retry.join(2.0)
        waited = retry.is_alive()  # a budget of the whole model, nothing superseded: it must not wait
        held.release.set()
        retry.join(30)
        pub.flush()
    finally:
        held.release.set()
        pub.close()
    assert not pub._cow.jobs
    assert (after_failure, waited, pub._cow.held) == (0, False, 0), (
        f"held after the failed apply: {after_failure}; retry waited for the snapshot: {waited}; "
        f"held with no snapshot pending: {pub._cow.held}")


def test_a_state_no_snapshot_can_hold_is_refused_before_anything_is_written(file_run):
    """The first step's state holds a tensor safetensors cannot store (a complex128 buffer): publish raises
    ValueError, but it did so only after records/0.json was written. The trainer drops the buffer and retries
    step 0: refused forever ("a publisher died before its first commit"), and so was every new Publisher at
    this prefix, though nothing was ever committed. The snapshot's files are built before the first write."""
    from relay.store import ConflictError

    state = _model(2)
    state["freqs"] = torch.ones(4, dtype=torch.complex128)
    pub = relay.Publisher(file_run.url, background=False)
    with pytest.raises(ValueError, match="C128"):
        pub.publish(state, 0)
    left = sorted(open_store(file_run.url).list_run())
    del state["freqs"]
    try:
        pub.publish(state, 0)
        retried = "ok"
    except ConflictError as exc:
        retried = f"ConflictError: {str(exc)[-90:]}"
    pub.close()
    assert (left, retried) == ([], "ok")


@pytest.mark.parametrize("advance", ["copy", "apply"])
@pytest.mark.parametrize("kind", ["delta", "snapshot"])
@pytest.mark.parametrize("retry", [False, True])
def test_a_commit_that_landed_but_raised_does_not_wedge_the_next_step(file_run, trainer, bits_equal, tmp_path,
                                                                     monkeypatch, advance, kind, retry):
    """The store applies a manifest commit, then the publisher loses the outcome (every re-read fails too, the
    store is down): publish raises. A trainer that logs it and moves on to the next step was refused at that
    step and at every later one ("another publisher extended the run"): the publisher still believed the head
    was the step before. The next publish learns what landed first, and builds on it."""
    t = trainer(seed=31)
    pub = relay.Publisher(file_run.url, background=False, advance=advance, snapshot_every=100)
    real = publisher_mod.update_manifest
    lose = {"n": 0}

    def landed_then_lost(*a, **kw):
        out = real(*a, **kw)
        if lose["n"]:
            lose["n"] -= 1
            raise OSError("injected: the connection dropped after the store applied the commit")
        return out

    monkeypatch.setattr(publisher_mod, "update_manifest", landed_then_lost)
    try:
        pub.publish(t.step(), 0)
        pub.publish(t.step(), 1)
        lose["n"] = 1
        state = t.step()
        if kind == "snapshot":  # a step that changes the tensor set is published as a snapshot
            state = dict(state)
            state["extra"] = torch.zeros(8, dtype=torch.bfloat16)
        with pytest.raises(OSError, match="injected"):
            pub.publish(state, 2)
        assert Manifest.parse(open_store(file_run.url).read_manifest().data).head == 2  # it did land
        if retry:  # the trainer retries the step instead: it is there already, nothing more is written
            before = sorted(open_store(file_run.url).list_run())
            pub.publish(state, 2)
            assert pub.step == 2 and sorted(open_store(file_run.url).list_run()) == before
        for step in (3, 4):
            state = t.step()
            if kind == "snapshot":
                state = dict(state)
                state["extra"] = torch.zeros(8, dtype=torch.bfloat16)
            pub.publish(state, step)
        assert pub.step == 4
    finally:
        pub.close()
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 4
    assert bits_equal(w.tensors, state)
