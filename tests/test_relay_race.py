"""Conditional writes: the store's commit semantics on every backend, and publishers racing for one step."""

from __future__ import annotations

import threading
import uuid

import pytest

import relay
from relay.manifest import Manifest
from relay.store import NOT_MODIFIED, ConflictError, ObjectExists, ObjectMissing, open_store


@pytest.fixture(params=["file", "s3", "memory"])
def any_store(request, tmp_path):
    if request.param == "memory":
        return open_store(f"memory://race-{uuid.uuid4().hex}/run")
    run = request.getfixturevalue(f"{request.param}_run")
    return open_store(run.url, run.options)


def test_manifest_commit_is_compare_and_swap(any_store):
    assert any_store.read_manifest() is None
    tag1 = any_store.commit_manifest(b'{"v": 1}', None)
    with pytest.raises(ConflictError):
        any_store.commit_manifest(b'{"v": 1, "fork": true}', None)  # If-None-Match: * on an existing manifest
    tag2 = any_store.commit_manifest(b'{"v": 2}', tag1)
    with pytest.raises(ConflictError):
        any_store.commit_manifest(b'{"v": 3}', tag1)  # stale If-Match
    got = any_store.read_manifest()
    assert got.data == b'{"v": 2}' and got.etag == tag2
    assert any_store.read_manifest(if_none_match=tag2) is NOT_MODIFIED
    assert any_store.read_manifest(if_none_match=tag1).data == b'{"v": 2}'


def test_immutable_objects_are_create_only(any_store):
    any_store.put_immutable("deltas/4-0.drd", b"payload")
    any_store.put_immutable("deltas/4-0.drd", b"payload")  # the same bytes again: an idempotent retry
    with pytest.raises(ObjectExists):
        any_store.put_new("deltas/4-0.drd", b"other")
    with pytest.raises(ConflictError, match="deltas/4-0.drd"):
        any_store.put_immutable("deltas/4-0.drd", b"other")
    assert any_store.get("deltas/4-0.drd") == b"payload"
    with pytest.raises(ObjectMissing):
        any_store.get("deltas/5-0.drd")
    any_store.put_new("snapshots/4/model.safetensors.index.json", b"{}")
    assert any_store.list("deltas/") == {"deltas/4-0.drd": 7}
    assert set(any_store.list("snapshots/")) == {"snapshots/4/model.safetensors.index.json"}
    any_store.delete(["deltas/4-0.drd", "deltas/9-0.drd"])  # deleting a missing key is not an error
    assert any_store.list("deltas/") == {}


def _race(url, options, states, step):
    """Two resumed publishers publish different states as the same step at the same moment."""
    pubs = [relay.Publisher(url, storage_options=options, resume=True, background=False) for _ in states]
    gate = threading.Barrier(len(pubs))
    outcome: dict[int, object] = {}

    def go(i):
        gate.wait()
        try:
            pubs[i].publish(states[i], step)
            outcome[i] = "won"
        except ConflictError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(pubs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return outcome


def test_two_publishers_race_for_the_same_step(run_store, trainer, bits_equal, tmp_path):
    a, b = trainer(seed=10), trainer(seed=11)
    with relay.Publisher(run_store.url, storage_options=run_store.options) as pub:
        pub.publish(a.step(), 0)
    w = relay.Watcher(run_store.url, tmp_path / "w", storage_options=run_store.options)
    for step in range(1, 5):
        states = [a.step(), b.step()]
        outcome = _race(run_store.url, run_store.options, states, step)
        winners = [i for i, o in outcome.items() if o == "won"]
        assert len(winners) == 1, outcome
        loser = 1 - winners[0]
        assert isinstance(outcome[loser], ConflictError)
        m = Manifest.parse(open_store(run_store.url, run_store.options).read_manifest().data)
        assert m.head == step and m.step(step).parent == step - 1
        assert w.sync() == step
        assert bits_equal(w.tensors, states[winners[0]])


def test_two_fresh_publishers_cannot_both_start_a_run(run_store, trainer):
    states = [trainer(seed=12).state(), trainer(seed=13).state()]
    pubs = [relay.Publisher(run_store.url, storage_options=run_store.options, background=False) for _ in states]
    gate = threading.Barrier(2)
    results = [None, None]

    def go(i):
        gate.wait()
        try:
            pubs[i].publish(states[i], 0)
            results[i] = "won"
        except ConflictError as exc:
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(r == "won" for r in results) == [False, True], results
    winner = pubs[results.index("won")]
    m = Manifest.parse(open_store(run_store.url, run_store.options).read_manifest().data)
    assert m.run == winner.run and m.head == 0


def test_operators_do_not_break_a_live_publisher(s3_run, trainer):
    """rebase and gc commit between the publisher's steps; the publisher re-reads and carries on."""
    t = trainer(seed=14)
    pub = relay.Publisher(s3_run.url, storage_options=s3_run.options, snapshot_every=3)
    for step in range(5):
        pub.publish(t.step(), step)
    pub.flush()
    assert relay.rebase(s3_run.url, s3_run.options) == 4
    relay.gc(s3_run.url, 1, s3_run.options)
    for step in range(5, 8):
        pub.publish(t.step(), step)
    pub.close()
    m = Manifest.parse(open_store(s3_run.url, s3_run.options).read_manifest().data)
    assert m.head == 7 and m.snapshots[0].step == 4 and m.chain(4) is not None
