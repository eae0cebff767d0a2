"""Publishers racing for one step (the stores' own commit semantics: tests/test_store_conformance.py)."""

from __future__ import annotations

import threading


import relay
from relay.manifest import Manifest
from relay.store import ConflictError, open_store


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


def test_two_publishers_race_for_the_same_step(every_store, trainer, bits_equal, tmp_path):
    a, b = trainer(seed=10), trainer(seed=11)
    with relay.Publisher(every_store.url, storage_options=every_store.options) as pub:
        pub.publish(a.step(), 0)
    w = relay.Watcher(every_store.url, tmp_path / "w", storage_options=every_store.options)
    for step in range(1, 5):
        states = [a.step(), b.step()]
        outcome = _race(every_store.url, every_store.options, states, step)
        winners = [i for i, o in outcome.items() if o == "won"]
        assert len(winners) == 1, outcome
        loser = 1 - winners[0]
        assert isinstance(outcome[loser], ConflictError)
        m = Manifest.parse(open_store(every_store.url, every_store.options).read_manifest().data)
        assert m.head == step and m.step(step).parent == step - 1
        assert w.sync() == step
        assert bits_equal(w.tensors, states[winners[0]])


def test_two_fresh_publishers_cannot_both_start_a_run(every_store, trainer):
    states = [trainer(seed=12).state(), trainer(seed=13).state()]
    pubs = [relay.Publisher(every_store.url, storage_options=every_store.options, background=False) for _ in states]
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
    m = Manifest.parse(open_store(every_store.url, every_store.options).read_manifest().data)
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
