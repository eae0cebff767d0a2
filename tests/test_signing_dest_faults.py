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
from relay.watcher import SyncError, Watcher

from conftest import publish_steps, same_bits


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
def test_damaged_held_version_forgets_the_floor_and_a_replayed_manifest_rolls_dest_back(file_run, trainer, keys,
                                                                                         tmp_path):
    """A watcher (trusted key) holds step 5. Between its runs one bit of a shard in its version flips (a disk
    fault). On restart `_recover` proves the version bad and starts as a fresh host: it forgets the step and
    run it held, although its relay-state.json still reads fine (and the version's name carries the step).
    A bucket writer that replays an old genuine signed manifest (head 2) then rolls the host back to step 2:
    'a watcher never moves to an older step than the one it holds, whatever a manifest says' no longer holds.
    Expected: the held (step, run) survives as a floor (as `_floor` already does for a selection mismatch):
    the restarted watcher refuses head 2 and re-fetches step 5 once the genuine manifest is back."""
    store = open_store(file_run.url)
    states, old = _publish_signed(file_run.url, trainer, keys["a"][0], 6, keep_at=2)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]]) as w:
        assert w.sync(timeout=10) == 5
    version = _held_version(dest)
    shard = next(p for p in version.iterdir() if p.name.endswith(".safetensors"))
    _flip_data_byte(shard)
    _write_manifest(store, old)  # a replay: genuine, signed, head 2

    with Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]]) as w:
        try:
            got = w.sync(timeout=10)
        except SyncError:
            return  # refused to move below the step DEST held: what should happen
        assert got >= 5, f"DEST held step 5; after a disk fault and a replayed manifest it moved back to {got}"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_non_regular_file_in_place_of_a_held_shard_wedges_start_up(file_run, trainer, tmp_path, kind):
    """Every file of a version is a regular file the watcher wrote (PROTOCOL §6.1), and a symlink in place of
    one is already treated as proof of damage (ELOOP -> BadVersion). Any other non-regular file is not: a
    directory in place of a shard (a disk fault repaired by fsck, a tool) makes `SafetensorsFile` raise
    IsADirectoryError, an OSError that `_recover` re-raises as "maybe fine", so the watcher refuses to start
    at every start (wedged, although the store could re-seed it); a FIFO there (a local user) makes the
    O_RDONLY open block forever: the watcher hangs in its constructor with no error at all, as would
    `relay.dest.open_head`. Expected: version files are opened with O_NONBLOCK and checked to be regular files
    (fstat S_ISREG); anything else is BadVersion, the version is dropped, and the watcher re-fetches the head."""
    import threading

    publish_steps(file_run.url, trainer, 3)
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest) as w:
        assert w.sync(timeout=10) == 2
    shard = next(p for p in _held_version(dest).iterdir() if p.name.endswith(".safetensors"))
    shard.unlink()
    if kind == "directory":
        shard.mkdir()
    else:
        os.mkfifo(shard)

    out: dict = {}

    def start() -> None:
        try:
            out["watcher"] = Watcher(file_run.url, dest)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(3)
    if thread.is_alive() and kind == "fifo":  # unblock the open so the thread can finish (test hygiene)
        fd = os.open(shard, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(10)
        out.setdefault("hung", True)
    w2 = out.get("watcher")
    try:
        assert not out.get("hung"), "Watcher() blocked for 3 s opening a FIFO in place of a held shard"
        assert "error" not in out, f"start-up refused on a {kind} in place of a shard: {out.get('error')!r}"
        assert w2 is not None and w2.sync(timeout=10) == 2
    finally:
        if w2 is not None:
            w2.close()


def _flip_in_state(version: Path, field: str) -> None:
    """One bit flipped inside the value of `field` of the version's relay-state.json (JSON stays valid)."""
    import json

    path = version / "relay-state.json"
    raw = bytearray(path.read_bytes())
    value = json.loads(raw)[field]
    text = json.dumps(value).encode()
    at = raw.index(f'"{field}": '.encode() + text) + len(f'"{field}": ') + len(text) - 2
    if field == "step":  # "5" -> "7": 0x35 ^ 0x02
        at += 1
        raw[at] ^= 0x02
    else:  # a hex digit of the run id: '0'..'9' ^ 0x01 stays a digit, 'a'..'f' ^ 0x01 stays hex too
        raw[at] ^= 0x01
    json.loads(raw)  # still valid JSON: nothing but the value changed
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("field", ["step", "run"])
def test_a_bit_flip_in_the_held_state_file_is_trusted_on_restart(file_run, trainer, keys, tmp_path, field):
    """relay-state.json is the only file of a full version without any integrity check: its shards are checked
    against its `tensors`, but nothing checks its `step` and `run`. One flipped bit (a disk fault between runs)
    in `step` (5 -> 7, JSON still valid) makes the restarted watcher present step 5's weights as step 7 (DEST's
    state file, `Watcher.step`, the fleet ledger and any engine say 7) and refuse the trainer's real steps 6
    and 7; in `run` (one hex digit) it refuses the real run for good ('refusing to mix runs' at every sync: a
    wedge). The version's own name (`<step>-<nonce>`, the watcher's) already disagrees, and with trusted keys
    the signed manifest still lists the claimed step's record, whose digests differ from the held tensors.
    Expected: a state file inconsistent with its version (name's step; or the signed record of its step) is
    BadVersion (refetched), or the state file carries a checksum; never wrong weights under a step number."""
    store = open_store(file_run.url)
    states, at5 = _publish_signed(file_run.url, trainer, keys["a"][0], 8, keep_at=5)  # steps 0..7
    m7 = store.read_manifest().data
    _write_manifest(store, at5)  # the host synced when the head was 5: the trainer's own manifest of then
    dest = tmp_path / "dest"
    with Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]]) as w:
        assert w.sync(timeout=10) == 5
    _flip_in_state(_held_version(dest), field)
    _write_manifest(store, m7)  # the trainer goes on to step 7

    with Watcher(file_run.url, dest, trusted_keys=[keys["a"][1]]) as w:
        try:
            got = w.sync(timeout=10)
        except SyncError as exc:
            pytest.fail(f"the restarted watcher is wedged by one flipped bit of its state file: {exc}")
        assert same_bits(w.tensors, states[got]), (
            f"DEST and the watcher say step {got}, but hold step 5's weights (one bit of relay-state.json flipped)")


@pytest.mark.parametrize("form", ["utf-16", "utf-8-bom", "duplicate-key"])
def test_manifest_parser_accepts_forms_a_strict_json_parser_refuses(file_run, trainer, keys, tmp_path, form):
    """`relay.manifest._load_json` hands the bytes to `json.loads`, which guesses UTF-16/UTF-32 and strips a
    UTF-8 BOM (RFC 8259 §8.1: JSON between systems is UTF-8, no BOM; SECURITY.md: 'invalid UTF-8 is a
    ManifestError'), and keeps the last of duplicate member names (RFC 8259 §4 leaves that to the parser; Go,
    serde and others differ: error, first, or last). So a bucket writer can re-encode a genuine signed manifest
    as UTF-16, or prepend a duplicate `"head"` member, and every Python reader (and the relay, which then copies
    those bytes byte for byte to every region) accepts it, while any other conforming implementation, or a
    schema validator in front of the bucket, refuses it or reads another head: two parsers disagree on the one
    signed object. Expected: strict UTF-8 (no BOM) and duplicate member names refused (object_pairs_hook), as
    ManifestError naming the manifest."""
    states, _ = _publish_signed(file_run.url, trainer, keys["a"][0], 3)
    store = open_store(file_run.url)
    genuine = store.read_manifest().data
    if form == "utf-16":
        hostile = genuine.decode("utf-8").encode("utf-16")
    elif form == "utf-8-bom":
        hostile = b"\xef\xbb\xbf" + genuine
    else:
        assert genuine.startswith(b"{")
        hostile = b'{"head": 999999,' + genuine[1:]  # a first-wins parser reads head 999999
    _write_manifest(store, hostile)
    from relay.manifest import ManifestError

    with pytest.raises(ManifestError):
        Manifest.parse(hostile)


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
