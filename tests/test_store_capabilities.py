"""What S3 implementations honour of the conditional writes, and a run on each (issue 44, docs/STORES.md).

moto answers as AWS S3 documents; Ceph RGW 16 (tests/ceph.py) refuses If-Match with the quoted ETag, answers
412 to If-Match on a missing key and completes a multipart upload over an existing object. The store probes
this before its first write and uses what it honours; these tests run a publisher and watchers on each."""

from __future__ import annotations

import json

import pytest

import relay
from relay.verify import verify
from faultproxy import FaultProxy
from relay.cli import main as cli_main
from relay.manifest import Manifest
from relay.s3probe import PROBE_PREFIX
from relay.store import ConflictError, S3Store, StoreCapabilityError, open_store

# Every snapshot object takes the large-object path (multipart, or spooled where a completion is not create-only)
LARGE_PATH = {"transfer": {"multipart_threshold": 0, "part_size": 5 << 20}}


@pytest.mark.parametrize("kind", ["s3", "rgw"])
def test_probe_tells_what_the_store_honours(request, kind, capsys):
    run = request.getfixturevalue(f"{kind}_run")
    assert cli_main(["doctor", run.url, "--storage-options", json.dumps(run.options)]) == 0
    table = capsys.readouterr().out
    print(table)
    caps = open_store(run.url, run.options).capabilities()
    assert caps.table() in table
    assert caps.create_only_put and caps.match_stale.status == 412 and caps.match_stale.unchanged
    if kind == "s3":  # moto: as AWS S3
        assert (caps.if_match_form, caps.match_missing.status, caps.create_only_completion) == ("quoted", 404, True)
    else:  # RGW 16.2: unquoted ETags only, 412 on a missing key, completions replace
        assert (caps.match_quoted.status, caps.match_unquoted.status, caps.match_missing.status) == (412, 200, 412)
        assert caps.if_match_form == "unquoted" and not caps.create_only_completion
        assert caps.complete_exists.status == 200 and caps.complete_exists.unchanged is False
    store = open_store(run.url, run.options)
    assert isinstance(store, S3Store) and store.list("") == {}  # the probe's scratch keys are gone
    assert not store.fs.call_s3("list_multipart_uploads", Bucket=store.bucket, Prefix=store._key(PROBE_PREFIX)
                                ).get("Uploads")


@pytest.mark.parametrize("kind", ["s3", "rgw"])
def test_five_steps_published_and_watched_bit_exact(request, kind, trainer, bits_equal, tmp_path):
    """Steps 0..4, snapshots at 0 and 3 through the large-object path, a watcher following each step and a fresh
    one at the end: bit-exact on moto and on RGW (where every commit after the first failed before)."""
    run = request.getfixturevalue(f"{kind}_run")
    opts = {**run.options, **LARGE_PATH}
    t = trainer(seed=21)
    w = relay.Watcher(run.url, tmp_path / "w", storage_options=opts, retry_initial=0.01, retry_max=0.05)
    with relay.Publisher(run.url, storage_options=opts, snapshot_every=3, background=False) as pub:
        for step in range(5):
            state = t.state() if step == 0 else t.step()
            pub.publish(state, step)
            assert w.sync(timeout=60) == step and bits_equal(w.tensors, state)
    m = Manifest.parse(open_store(run.url, run.options).read_manifest().data)
    assert m.head == 4 and [s.step for s in m.snapshots] == [0, 3]
    fresh = relay.Watcher(run.url, tmp_path / "fresh", storage_options=opts)
    assert fresh.sync(timeout=60) == 4 and bits_equal(fresh.tensors, state)
    with relay.Publisher(run.url, storage_options=opts, snapshot_every=3, background=False, resume=True) as pub:
        pub.publish(t.step(), 5)  # a resumed publisher commits on as well
    assert verify(run.url, run.options, deep=True).problems == []


def test_a_refused_condition_on_an_unchanged_object_is_a_store_problem(s3_run, trainer):
    """A store that refuses a valid If-Match (the object still has that ETag) is named as the cause at once,
    not reported as 20 writes lost to another writer."""
    with FaultProxy(s3_run.region.endpoint) as proxy:
        opts = proxy.options(s3_run.options)
        t = trainer(seed=22)
        with relay.Publisher(s3_run.url, storage_options=opts, background=False) as pub:
            pub.publish(t.state(), 0)
            proxy.add("error", methods=("PUT",), key="/manifest.json$", status=412, code="PreconditionFailed")
            with pytest.raises(StoreCapabilityError, match="not another writer") as info:
                pub.publish(t.step(), 1)
        assert not isinstance(info.value, ConflictError) and s3_run.url in str(info.value)
        assert len(proxy.injected("error")) == 1  # no retry: one refusal told it all


def test_an_object_too_large_for_one_create_only_put_is_refused_on_rgw(rgw_run):
    """Where a completion is not create-only, objects above S3's largest PutObject cannot be created safely:
    refused before any byte is read, naming the store, the capability and the remedy."""
    store = open_store(rgw_run.url, rgw_run.options)

    def never():
        raise AssertionError("the stream was read")
        yield b""

    with pytest.raises(StoreCapabilityError, match=r"CompleteMultipartUpload If-None-Match.*smaller snapshot shards"):
        store.put_new_stream("snapshots/1/model.safetensors", never(), 6 << 30)
    assert store.list("snapshots/") == {}


def test_a_lost_answer_to_a_spooled_create_on_rgw_is_recognised(rgw_run, ceph_rgw, trainer, bits_equal, tmp_path):
    """RGW creates large objects by one create-only PutObject: when the store applies it but the answer is lost
    (the connection reset after the write), the retry's 412 finds the writer's own bytes and carries on."""
    with FaultProxy(ceph_rgw.endpoint, keep_host=True) as proxy:
        opts = {**proxy.options(rgw_run.options), **LARGE_PATH}
        proxy.add("reset_after", methods=("PUT",), key=r"/snapshots/0/.*\.safetensors$", times=1)
        t = trainer(seed=23)
        with relay.Publisher(rgw_run.url, storage_options=opts, snapshot_every=3, background=False) as pub:
            for step in range(2):
                state = t.state() if step == 0 else t.step()
                pub.publish(state, step)
        assert len(proxy.injected("reset_after")) == 1
    w = relay.Watcher(rgw_run.url, tmp_path / "w", storage_options=rgw_run.options)
    assert w.sync(timeout=60) == 1 and bits_equal(w.tensors, state)
    assert verify(rgw_run.url, rgw_run.options, deep=True).problems == []


def test_a_store_that_ignores_conditional_writes_is_refused_before_anything_is_written(s3_run, trainer):
    """A store that drops If-None-Match / If-Match (a gateway that ignores them): the publisher's first write
    probes it and refuses, naming the store, the capability and the remedy; nothing of the run is written."""
    with FaultProxy(s3_run.region.endpoint) as proxy:
        proxy.add("unconditional", methods=("PUT", "POST"))
        with relay.Publisher(s3_run.url, storage_options=proxy.options(s3_run.options), background=False) as pub:
            with pytest.raises(StoreCapabilityError, match=r"does not honour PutObject If-None-Match.*Use an S3"):
                pub.publish(trainer(seed=24).state(), 0)
        assert proxy.injected("unconditional")
        assert cli_main(["doctor", s3_run.url, "--storage-options", json.dumps(proxy.options(s3_run.options))]) == 1
    store = open_store(s3_run.url, s3_run.options)
    assert store.list("") == {} and store.read_manifest() is None
