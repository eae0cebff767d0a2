"""Signing, manifest parsing and the watcher's full persist mode and restart path, in the cases an adversarial
review found uncovered (docs/RELIABILITY.md has each finding, before and after). Threat model: a bucket writer
without a signing key; a local fault or attacker changing DEST between a watcher's runs."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest

from relay import ops
from relay.manifest import Manifest
from relay.publisher import Publisher
from relay.signing import SignatureError, TrustedKeys, generate_keypair
from relay.store import open_store

from conftest import publish_steps


@pytest.fixture
def keys(tmp_path):
    return {name: generate_keypair(tmp_path / "keys" / name) for name in ("a", "b")}


def _manifest(store) -> Manifest:
    return Manifest.parse(store.read_manifest().data)


def _write_manifest(store, data: bytes) -> None:
    """What a bucket writer does: put any bytes at manifest.json (a replay of an old genuine one, say)."""
    store.commit_manifest(data, store.read_manifest().etag)


def _held_version(dest: Path) -> Path:
    return dest / ".versions" / os.path.basename(os.readlink(dest / ".current"))


def _flip_data_byte(path: Path) -> None:
    """A disk fault: one bit of tensor data (past the safetensors header) flipped in place."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 5] ^= 0x10
    path.write_bytes(bytes(data))


def _publish_signed(url: str, trainer, key, steps: int, seed: int = 3, keep_at: int | None = None):
    """Publish steps 0..steps-1 signed with `key`; returns (states, manifest bytes right after step keep_at)."""
    store = open_store(url)
    t = trainer(seed=seed)
    states, kept = [], None
    with Publisher(url, snapshot_every=3, background=False, signing_key=key) as pub:
        for step in range(steps):
            state = t.state() if step == 0 else t.step()
            pub.publish(state, step)
            states.append(state)
            if step == keep_at:
                kept = store.read_manifest().data
    return states, kept


# -- (a) writers ------------------------------------------------------------------------------------------------
def test_adoption_signs_sha256_fields_it_never_checked(file_run, trainer, keys):
    """`--adopt-unsigned` is documented to read every object the unsigned manifest names and add the SHA-256
    of the bytes it saw ("it vouches only for bytes it has seen", SECURITY.md). `relay.signing.strengthen`
    instead keeps any `sha256` the unsigned manifest already carries and signs it unread. A bucket writer that
    rewrites the unsigned manifest (after the operator's `verify --deep`) with a sha256 of its own choosing on
    an object (here: of other bytes; with an xxh3 collision: of a forged object it swaps in later) gets the
    operator's gc to sign that SHA-256. Expected: the adopting writer reads and checks every object whose
    reference it is about to vouch for (a sha256 in an unsigned manifest is as unverified as the rest) and
    refuses (SignatureError naming the object) or signs only SHA-256s of the bytes it read."""
    publish_steps(file_run.url, trainer, 7)  # unsigned; snapshots 0, 3 and 6
    store = open_store(file_run.url)
    m = _manifest(store)
    step4 = m.step(4)
    part = step4.parts[0]
    bogus = hashlib.sha256(b"the attacker's chosen bytes").hexdigest()
    forged_step = dataclasses.replace(step4, parts=(dataclasses.replace(part, ref=dataclasses.replace(
        part.ref, sha256=bogus)),) + step4.parts[1:])
    forged = dataclasses.replace(m, steps=[forged_step if s.step == 4 else s for s in m.steps], signatures=())
    _write_manifest(store, forged.to_bytes())

    try:
        ops.gc(file_run.url, 2, signing_key=keys["a"][0], adopt_unsigned=True)  # trims snapshot 0: a commit
    except SignatureError:
        return  # refused, naming the object: what should happen
    signed = _manifest(store)
    TrustedKeys(keys["a"][1]).verify(signed)
    wrong = [r.key for r in signed.refs() if r.sha256 != hashlib.sha256(store.get(r.key)).hexdigest()]
    assert not wrong, f"the adopting gc signed SHA-256s it never checked, for {wrong}"


# -- (b) the watcher's restart path -----------------------------------------------------------------------------
def test_adoption_reads_every_snapshot_file_whole_into_memory(file_run, trainer, keys, monkeypatch):
    """`relay.signing.strengthen` (the first signed commit of an adopted run) reads each object with
    `ObjRef.read` (`get_at_most`: the whole object as one bytes value) to hash it, snapshot files included. A run
    with 5 GB shards holds a whole shard per object at once on the operator's machine (`gc --adopt-unsigned`,
    `rebase`, a resuming publisher), and `verify` had the very same bug fixed (RELIABILITY.md: 'the shallow
    check hashes snapshot files as they stream, ObjRef.matches_chunks'). Expected: objects are hashed as they
    stream (`store.iter_chunks`, `ObjRef.matches_chunks` / `ObjRef.of_chunks(..., strong=True)`), holding a
    chunk at a time, never a whole snapshot file."""
    from relay.store import LocalStore

    publish_steps(file_run.url, trainer, 7)  # unsigned
    store = open_store(file_run.url)
    m = _manifest(store)
    largest = max(f.size for s in m.snapshots for f in s.files)
    held: dict[str, int] = {}
    real = LocalStore.get_at_most

    def get_at_most(self, key, limit):
        data = real(self, key, limit)
        held[key] = max(held.get(key, 0), len(data))
        return data

    monkeypatch.setattr(LocalStore, "get_at_most", get_at_most)
    ops.gc(file_run.url, 2, signing_key=keys["a"][0], adopt_unsigned=True)
    whole = {k: n for k, n in held.items() if k.startswith("snapshots/") and k.endswith(".safetensors")}
    assert not whole, (f"strengthen held whole snapshot files in memory ({max(whole.values())} bytes at once; "
                       f"largest file {largest}): {sorted(whole)[:3]}")
