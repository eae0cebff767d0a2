"""Signed manifests: keys, the signature envelope, publishers that sign, watchers and operators that
check, key rotation, and refusal of unsigned, tampered, wrongly signed or replayed manifests."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch

from relay import ops
from relay.cli import main as cli_main
from relay.manifest import Manifest
from relay.publisher import Publisher
from relay.signing import (KeyFileError, SignatureError, Signer, TrustedKeys, generate_keypair, key_id,
                           load_private_key, load_public_key)
from relay.store import open_store
from relay.watcher import SyncError, Watcher

from conftest import publish_steps, same_bits


@pytest.fixture
def keys(tmp_path):
    """Two key pairs, 'a' and 'b': {name: (key path, pub path, key id)}."""
    return {name: generate_keypair(tmp_path / "keys" / name) for name in ("a", "b")}


def commit_raw(store, data: bytes) -> None:
    store.commit_manifest(data, store.read_manifest().etag)


# -- keys ------------------------------------------------------------------------------------------
def test_keygen_files_modes_and_ids(tmp_path, keys):
    key_path, pub_path, kid = keys["a"]
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert b"BEGIN PRIVATE KEY" in key_path.read_bytes() and b"BEGIN PUBLIC KEY" in pub_path.read_bytes()
    assert key_id(load_public_key(pub_path)) == kid == key_id(load_private_key(key_path).public_key())
    assert kid != keys["b"][2] and len(kid) == 16
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        generate_keypair(tmp_path / "keys" / "a")
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        load_public_key(key_path)  # a reader is never handed the private key by mistake
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(KeyFileError):
        load_public_key(junk)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_public_key(tmp_path / "absent.pub")


def test_keygen_cli(tmp_path, capsys):
    assert cli_main(["keygen", "--out", str(tmp_path / "k" / "trainer")]) == 0
    out = capsys.readouterr().out
    assert "trainer.key" in out and "trainer.pub" in out
    kid = key_id(load_public_key(tmp_path / "k" / "trainer.pub"))
    assert kid in out
    assert cli_main(["keygen", "--out", str(tmp_path / "k" / "trainer")]) == 1  # never overwrites


def test_rsa_key_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    k = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    p = tmp_path / "rsa.pub"
    p.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(KeyFileError, match="expected an Ed25519 key"):
        load_public_key(p)


# -- the envelope ------------------------------------------------------------------------------------
def test_signed_manifest_envelope(file_run, trainer, keys):
    publish_steps(file_run.url, trainer, 4, signing_key=keys["a"][0])
    data = open_store(file_run.url).read_manifest().data
    doc = json.loads(data)
    assert [s["key_id"] for s in doc["signatures"]] == [keys["a"][2]]
    m = Manifest.parse(data)
    assert all(r.sha256 is not None and len(r.sha256) == 64 for r in m.refs())
    assert TrustedKeys(keys["a"][1]).verify(m).key_id == keys["a"][2]
    # the signed payload is canonical: the same after a re-serialisation of the parse
    assert Manifest.parse(m.to_bytes(signer=Signer(keys["a"][0]))).signed_payload() == m.signed_payload()
    # an unsigned to_bytes() of a parsed signed manifest drops the (possibly stale) signatures
    assert "signatures" not in json.loads(m.to_bytes())


@pytest.mark.parametrize("tamper", ["head_record", "delta_tag", "sha256", "drop_sig", "other_key", "sig_bits",
                                    "drop_snapshot"])
def test_tampered_manifest_refused(file_run, trainer, keys, tamper):
    publish_steps(file_run.url, trainer, 4, signing_key=keys["a"][0])
    store = open_store(file_run.url)
    doc = json.loads(store.read_manifest().data)
    if tamper == "head_record":
        doc["steps"][-1]["record"]["size"] += 1
    elif tamper == "delta_tag":
        doc["steps"][-1]["parts"][0]["xxh3"] = "0" * 32
    elif tamper == "sha256":
        doc["steps"][1]["parts"][0]["sha256"] = "f" * 64
    elif tamper == "drop_sig":
        del doc["signatures"]
    elif tamper == "other_key":
        m = Manifest.parse(json.dumps(doc).encode())
        doc = json.loads(m.to_bytes(signer=Signer(keys["b"][0])))
    elif tamper == "sig_bits":
        sig = doc["signatures"][0]["sig"]
        doc["signatures"][0]["sig"] = ("B" if sig[0] != "B" else "C") + sig[1:]
    elif tamper == "drop_snapshot":
        doc["snapshots"] = doc["snapshots"][:1]
        doc["base"] = doc["snapshots"][0]["step"]
    m = Manifest.parse(json.dumps(doc).encode())
    with pytest.raises(SignatureError):
        TrustedKeys(keys["a"][1]).verify(m)


# -- watchers ----------------------------------------------------------------------------------------
def test_signed_run_end_to_end(run_store, trainer, keys, tmp_path):
    states = publish_steps(run_store.url, trainer, 5, run_store.options, signing_key=keys["a"][0])
    w = Watcher(run_store.url, tmp_path / "dest", storage_options=run_store.options, trusted_keys=[keys["a"][1]])
    assert w.sync(timeout=30) == 4
    assert same_bits(w.tensors, states[4])


def test_watcher_with_keys_refuses_unsigned_run(file_run, trainer, keys, tmp_path):
    publish_steps(file_run.url, trainer, 2)
    w = Watcher(file_run.url, tmp_path / "dest", trusted_keys=[keys["a"][1]])
    with pytest.raises(SignatureError, match="unsigned"):
        w.sync(timeout=5)
    assert w.step is None and not [p for p in (tmp_path / "dest").iterdir() if not p.name.startswith(".")]


def test_forged_manifest_never_reaches_dest(file_run, trainer, keys, tmp_path, caplog):
    """An attacker with write access replaces the head's delta and record and re-tags them in the manifest:
    the watcher that trusts the publisher's key refuses it and keeps its step; one without keys is fooled
    only as far as the attacker's own (consistent) objects go, which is why keys exist."""
    states = publish_steps(file_run.url, trainer, 3, signing_key=keys["a"][0])
    dest = tmp_path / "dest"
    w = Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]])
    assert w.sync(timeout=10) == 2
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    evil = {k: torch.zeros_like(v) for k, v in states[2].items()}
    with Publisher(f"file://{tmp_path}/evil", background=False, signing_key=keys["b"][0]) as ev:  # a consistent step 3
        ev.run = m.run
        ev.publish(states[2], 2)
        ev.publish(evil, 3)
    evil_store = open_store(f"file://{tmp_path}/evil")
    em = Manifest.parse(evil_store.read_manifest().data)
    for ref in (em.step(3).record, em.step(3).parts[0].ref):
        store.put_new(ref.key, evil_store.get(ref.key))
    m.steps.append(em.step(3))
    m.head = 3
    commit_raw(store, m.to_bytes(signer=Signer(keys["b"][0])))  # signed, by a key nobody trusts
    with caplog.at_level(logging.ERROR), pytest.raises(SignatureError, match="none of them trusted"):
        w.sync(timeout=5)
    assert w.step == 2
    w.close()  # one watcher per DEST: the restarted one takes over
    w = Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]])
    assert same_bits(w.tensors, states[2])
    commit_raw(store, m.to_bytes())  # unsigned
    with pytest.raises(SignatureError, match="unsigned"):
        w.sync(timeout=5)
    assert w.step == 2


def test_rollback_and_cross_run_refused(file_run, trainer, keys, tmp_path, caplog):
    """Replaying an older signed manifest, or a signed manifest of another run, never moves a watcher."""
    store = open_store(file_run.url)
    states = publish_steps(file_run.url, trainer, 3, signing_key=keys["a"][0])
    old = store.read_manifest().data
    t = trainer(seed=3)
    with Publisher(file_run.url, snapshot_every=3, background=False, resume=True, signing_key=keys["a"][0]) as pub:
        for step in range(3, 5):
            states.append(None)
            pub.publish(t.step(), step)
    w = Watcher(file_run.url, tmp_path / "dest", trusted_keys=[keys["a"][1]])
    assert w.sync(timeout=10) == 4
    held = {k: v.clone() for k, v in w.tensors.items()}
    commit_raw(store, old)  # a genuine, signed, older manifest replayed
    with caplog.at_level(logging.WARNING):
        assert w.sync(timeout=5) == 4
    assert "older than the held step 4" in caplog.text and same_bits(w.tensors, held)
    other = f"file://{tmp_path}/other"
    publish_steps(other, trainer, 6, signing_key=keys["a"][0])  # same key, another run, a higher head
    other_store = open_store(other)
    for prefix in ("records/", "deltas/", "snapshots/"):
        for key in other_store.list(prefix):
            store.delete([key])
            store.put_new(key, other_store.get(key))
    commit_raw(store, other_store.read_manifest().data)
    with pytest.raises(SyncError, match="refusing to mix runs"):
        w.sync(timeout=5)
    assert w.step == 4
    w.close()  # one watcher per DEST: restart it to read what it holds
    assert same_bits(Watcher(file_run.url, tmp_path / "dest").tensors, held)


def test_key_rotation(file_run, trainer, keys, tmp_path):
    """Trust old and new, sign with both, then only the new one; watchers trusting only the old key stop."""
    a_key, a_pub, _ = keys["a"]
    b_key, b_pub, _ = keys["b"]
    t = trainer(seed=5)
    both = Watcher(file_run.url, tmp_path / "both", trusted_keys=[a_pub, b_pub])
    only_a = Watcher(file_run.url, tmp_path / "a", trusted_keys=[a_pub])
    only_b = Watcher(file_run.url, tmp_path / "b", trusted_keys=[b_pub])
    with Publisher(file_run.url, background=False, signing_key=a_key) as pub:
        pub.publish(t.state(), 0)
        pub.publish(t.step(), 1)
    assert both.sync(timeout=5) == 1 and only_a.sync(timeout=5) == 1
    with pytest.raises(SignatureError):
        only_b.sync(timeout=5)
    with Publisher(file_run.url, background=False, resume=True, signing_key=[a_key, b_key]) as pub:  # overlap
        pub.publish(t.step(), 2)
    assert [w.sync(timeout=5) for w in (both, only_a, only_b)] == [2, 2, 2]
    with Publisher(file_run.url, background=False, resume=True, signing_key=b_key) as pub:  # old key retired
        pub.publish(t.step(), 3)
    assert both.sync(timeout=5) == 3 and only_b.sync(timeout=5) == 3
    with pytest.raises(SignatureError, match="none of them trusted"):
        only_a.sync(timeout=5)
    assert only_a.step == 2


def test_unsigned_publisher_cannot_strip_a_signed_run(file_run, trainer, keys):
    publish_steps(file_run.url, trainer, 2, signing_key=keys["a"][0])
    with pytest.raises(ValueError, match="the run is signed"):
        Publisher(file_run.url, background=False, resume=True)  # refused before it reads or writes anything


def test_signing_an_unsigned_run_vouches_for_its_history(file_run, trainer, keys, tmp_path):
    states = publish_steps(file_run.url, trainer, 3)
    t = trainer(seed=3)
    for _ in range(2):
        t.step()
    with Publisher(file_run.url, background=False, resume=True, signing_key=keys["a"][0],
                   adopt_unsigned=True) as pub:  # the operator's explicit choice (see test_keyed_writers_...)
        pub.publish(t.step(), 3)
        states.append(pub.prev)
    m = Manifest.parse(open_store(file_run.url).read_manifest().data)
    TrustedKeys(keys["a"][1]).verify(m)
    w = Watcher(file_run.url, tmp_path / "dest", trusted_keys=keys["a"][1])
    assert w.sync(timeout=5) == 3 and same_bits(w.tensors, states[3])


def test_operators_need_the_key_on_a_signed_run(file_run, trainer, keys, tmp_path):
    publish_steps(file_run.url, trainer, 5, signing_key=keys["a"][0])
    with pytest.raises(ValueError, match="needs the signing key"):
        ops.gc(file_run.url, 1)
    with pytest.raises(ValueError, match="needs the signing key"):  # a dry run says what the real one would
        ops.gc(file_run.url, 1, dry_run=True)
    with pytest.raises(ValueError, match="needs the signing key"):
        ops.rebase(file_run.url, timeout=5)
    assert ops.rebase(file_run.url, timeout=5, signing_key=keys["a"][0]) == 4
    ops.gc(file_run.url, 1, signing_key=keys["a"][0])
    m = Manifest.parse(open_store(file_run.url).read_manifest().data)
    TrustedKeys(keys["a"][1]).verify(m)
    assert m.base == 4 and m.steps[0].step == 4
    with pytest.raises(SignatureError):  # an operator's key that is not the run's is not used to re-sign it
        ops.gc(file_run.url, 1, signing_key=keys["b"][0])
    with pytest.raises(SignatureError):
        ops.gc(file_run.url, 1, signing_key=keys["b"][0], dry_run=True)
    w = Watcher(file_run.url, tmp_path / "dest", trusted_keys=keys["a"][1])
    assert w.sync(timeout=5) == 4


def test_cli_publish_and_watch_with_keys(tmp_path, trainer, keys, capsys):
    from relay import checkpoint

    url = f"file://{tmp_path}/run"
    t = trainer(seed=1)
    for step in range(3):
        state = t.state() if step == 0 else t.step()
        checkpoint.save(state, tmp_path / f"ckpt{step}.safetensors")
        argv = ["publish", url, str(tmp_path / f"ckpt{step}.safetensors"), "--step", str(step),
                "--signing-key", str(keys["a"][0])]
        assert cli_main(argv + (["--resume"] if step else [])) == 0
    dest = tmp_path / "dest"
    assert cli_main(["watch", url, "--dest", str(dest), "--once", "--timeout", "10",
                     "--trusted-key", str(keys["b"][1])]) == 1
    assert "none of them trusted" in capsys.readouterr().err
    assert cli_main(["watch", url, "--dest", str(dest), "--once", "--timeout", "10",
                     "--trusted-key", str(keys["b"][1]), "--trusted-key", str(keys["a"][1])]) == 0
    assert same_bits(checkpoint.load(dest)[0], state)
    assert cli_main(["gc", url, "--keep-snapshots", "1"]) == 1
    assert "signing key" in capsys.readouterr().err
    assert cli_main(["gc", url, "--keep-snapshots", "1", "--signing-key", str(keys["a"][0])]) == 0


# -- the regional relay --------------------------------------------------------------------------------
def test_relay_mirrors_signed_manifests_unchanged(file_run, trainer, keys, tmp_path):
    from relay.fanout import Destination, Fanout

    states = publish_steps(file_run.url, trainer, 5, signing_key=keys["a"][0])
    origin = open_store(file_run.url)
    regions = [Destination("keys", f"file://{tmp_path}/eu/run"), Destination("nokeys", f"file://{tmp_path}/ap/run")]
    assert Fanout(file_run.url, regions[:1], trusted_keys=[keys["a"][1]], poll_interval=0.05).sync_once(timeout=30)
    assert Fanout(file_run.url, regions[1:], poll_interval=0.05).sync_once(timeout=30)  # no keys: still verbatim
    for d in regions:
        assert open_store(d.url).read_manifest().data == origin.read_manifest().data
        w = Watcher(d.url, tmp_path / f"dest-{d.name}", trusted_keys=[keys["a"][1]])
        assert w.sync(timeout=10) == 4 and same_bits(w.tensors, states[4])


def test_relay_with_keys_refuses_forged_or_unsigned_origin(file_run, trainer, keys, tmp_path, caplog):
    from relay.fanout import Destination, Fanout

    publish_steps(file_run.url, trainer, 3, signing_key=keys["a"][0])
    region = Destination("eu", f"file://{tmp_path}/eu/run")
    assert Fanout(file_run.url, [region], trusted_keys=[keys["a"][1]], poll_interval=0.05).sync_once(timeout=30)
    good = open_store(region.url).read_manifest().data
    origin = open_store(file_run.url)
    m = Manifest.parse(origin.read_manifest().data)
    for forged, why in ((m.to_bytes(signer=Signer(keys["b"][0])), "none of them trusted"), (m.to_bytes(), "unsigned")):
        commit_raw(origin, forged)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert not Fanout(file_run.url, [region], trusted_keys=[keys["a"][1]],
                              poll_interval=0.05).sync_once(timeout=0.5)
        assert "refusing the origin manifest" in caplog.text and why in caplog.text
        assert open_store(region.url).read_manifest().data == good


def test_relay_cli_trusted_key(file_run, trainer, keys, tmp_path, capsys):
    publish_steps(file_run.url, trainer, 2, signing_key=keys["a"][0])
    dest = f"file://{tmp_path}/eu/run"
    base = ["relay", "--source", file_run.url, "--dest", dest, "--once", "--poll-interval", "0.05"]
    assert cli_main(base + ["--timeout", "0.5", "--trusted-key", str(keys["b"][1])]) != 0
    assert open_store(dest).read_manifest() is None
    assert cli_main(base + ["--timeout", "30", "--trusted-key", str(keys["a"][1])]) == 0
    assert open_store(dest).read_manifest().data == open_store(file_run.url).read_manifest().data
