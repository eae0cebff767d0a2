"""apply_: in place on a mapping or a live module's state_dict, all-or-nothing, undo log only.

Failures are checked by comparing raw bytes (NaN payloads included) before and after, and by
torch's in-place version counters, which show whether a tensor was written at all.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch
from torch import nn

import codec
from codec import container
from relay.manifest import tensor_infos
from codec_cases import (
    FORMAT_VERSIONS,
    assert_bit_exact,
    bf16_from_bits,
    bits_of,
    clone_all,
    edge_pair,
    model_pair,
    random_bf16_weights,
    rl_step,
    snapshot,
)


def _changed_names(base, target) -> list[str]:
    return [k for k in target if not np.array_equal(bits_of(base[k]), bits_of(target[k]))]


def _forge(payload: bytes, name: str, edit) -> bytes:
    parsed = container.unpack(payload)
    for i, e in enumerate(parsed.entries):
        if e.name == name:
            parsed.entries[i] = edit(dataclasses.replace(e, streams=[dataclasses.replace(s) for s in e.streams]))
    return container.pack(parsed)


def _refused_untouched(base, forged: bytes, name: str):
    """apply_ of `forged` on a copy of `base` raises DeltaError naming `name` and leaves every bit
    as it was; returns the copy."""
    live = clone_all(base)
    before = snapshot(live)
    with pytest.raises(codec.DeltaError) as err:
        codec.apply_(live, forged)
    assert name in str(err.value)
    _assert_untouched(live, before)
    return live


def _bad_digest(e):
    return dataclasses.replace(e, target_digest=bytes([e.target_digest[0] ^ 1]) + e.target_digest[1:])


def _bad_stream(e):
    """Tamper with the largest stream's last byte, so it still decompresses in most cases."""
    s = max(e.streams, key=lambda s: len(s.stored))
    raw = bytearray(s.stored)
    raw[-1] ^= 0x5A
    s.stored = bytes(raw)
    return e


def _versions(tensors) -> dict[str, int]:
    return {k: v._version for k, v in tensors.items()}


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_apply_on_a_dict_is_bit_exact_and_in_place(version):
    base, target = edge_pair(seed=3)
    payload = codec.encode(base, target, format_version=version)
    live = clone_all(base)
    objects = {k: v for k, v in live.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    versions = _versions(live)
    assert codec.apply_(live, payload) is None
    assert_bit_exact(live, target)
    assert all(live[k] is objects[k] and live[k].data_ptr() == ptrs[k] for k in live)
    changed = set(_changed_names(base, target))
    for k, v in live.items():  # unchanged tensors are not written at all
        if k not in changed:
            assert v._version == versions[k], k


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_apply_to_a_live_module(version):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.LayerNorm(48), nn.Linear(48, 8), nn.BatchNorm1d(8)).to(torch.bfloat16)
    base = clone_all(model.state_dict())
    rng = np.random.default_rng(0)
    target = {k: rl_step(v, 0.2, rng) if v.dtype is torch.bfloat16 else v.clone() for k, v in base.items()}
    target["3.num_batches_tracked"] = torch.tensor(7)  # an int64 0-d buffer moves too
    params = {k: p for k, p in model.named_parameters()}
    payload = codec.encode(base, target, format_version=version)

    codec.apply_(model.state_dict(), payload)

    assert_bit_exact(model.state_dict(), target)
    assert {k: p for k, p in model.named_parameters()} == params  # same Parameter objects, updated
    assert all(p.requires_grad for p in model.parameters())
    out = model.eval()(torch.ones(2, 24, dtype=torch.bfloat16))
    want = nn.Sequential(nn.Linear(24, 48), nn.LayerNorm(48), nn.Linear(48, 8), nn.BatchNorm1d(8)).to(torch.bfloat16)
    want.load_state_dict(target)
    assert torch.equal(out, want.eval()(torch.ones(2, 24, dtype=torch.bfloat16)))


class _Tied(nn.Module):
    """An LM head tied to the embedding: state_dict() lists one storage under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(16)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_apply_to_a_module_with_tied_weights(version):
    torch.manual_seed(1)
    trainer, rollout = _Tied().to(torch.bfloat16), _Tied().to(torch.bfloat16)
    rollout.load_state_dict(trainer.state_dict())
    base = clone_all(trainer.state_dict())
    rng = np.random.default_rng(1)
    with torch.no_grad():
        trainer.embed.weight.copy_(rl_step(trainer.embed.weight, 0.05, rng))
        trainer.norm.weight.copy_(rl_step(trainer.norm.weight, 0.5, rng))
    target = clone_all(trainer.state_dict())
    payload = codec.encode(base, target, format_version=version)

    codec.apply_(rollout.state_dict(), payload)

    assert_bit_exact(rollout.state_dict(), target)
    assert rollout.head.weight is rollout.embed.weight


# --- all-or-nothing -------------------------------------------------------------------------------

def _assert_untouched(live, before, versions=None):
    assert snapshot(live) == before
    if versions is not None:
        assert _versions(live) == versions


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_wrong_base_restores_everything(version):
    """Refused, naming the tensor; whether the base digest is checked before writing or only on
    failure, every tensor ends with its previous bits."""
    base, target = edge_pair(seed=4)
    payload = codec.encode(base, target, format_version=version)
    live = clone_all(base)
    victim = next(k for k in reversed(list(live)) if live[k].numel() and live[k].dtype is not torch.bool)
    live[victim].reshape(-1).view(torch.uint8)[0] ^= 0x10
    before = snapshot(live)
    with pytest.raises(codec.DeltaError, match=victim.replace(".", r"\.")):
        codec.apply_(live, payload)
    _assert_untouched(live, before)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_corrupt_payload_touches_nothing(version):
    base, target = edge_pair(seed=5)
    payload = bytearray(codec.encode(base, target, format_version=version))
    payload[len(payload) // 2] ^= 0x04
    live = clone_all(base)
    before, versions = snapshot(live), _versions(live)
    with pytest.raises(codec.DeltaError):
        codec.apply_(live, bytes(payload))
    _assert_untouched(live, before, versions)
    with pytest.raises(codec.DeltaError):
        codec.apply_(live, bytes(payload[:-3]))
    _assert_untouched(live, before, versions)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("damage", ["digest", "stream"])
def test_failure_restores_every_tensor_bit_exactly(version, where, damage):
    """A digest mismatch or a tampered stream (checksum recomputed) in one record: every earlier
    write is undone, NaN payloads and -0.0 included, and DeltaError names the record."""
    base, target = edge_pair(seed=6)
    changed = [k for k in _changed_names(base, target) if base[k].numel()]
    name = {"first": changed[0], "middle": changed[len(changed) // 2], "last": changed[-1]}[where]
    payload = codec.encode(base, target, format_version=version)
    forged = _forge(payload, name, _bad_digest if damage == "digest" else _bad_stream)
    live = _refused_untouched(base, forged, name)
    codec.apply_(live, payload)  # the genuine payload still applies afterwards
    assert_bit_exact(live, target)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("keep_data", [True, False])
def test_changed_record_relabelled_same_is_refused(version, keep_data):
    """A forged `same` label on a changed tensor (checksum recomputed) must not leave the base in
    place as if it were the target: apply_ checks `same` records as decode does. (Found by the
    raw-index fuzzer: apply_ used to check only the base digest of `same` records.)"""
    from codec.methods import same

    base, target = edge_pair(seed=8)
    name = next(k for k in _changed_names(base, target) if base[k].numel())
    payload = codec.encode(base, target, format_version=version)

    def relabel(e):
        e = dataclasses.replace(e, method=same.ID)
        return e if keep_data else dataclasses.replace(e, streams=[], params=b"")

    forged = _forge(payload, name, relabel)
    _refused_untouched(base, forged, name)
    with pytest.raises(codec.DeltaError):
        codec.decode(base, forged)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_failure_in_the_last_tensor_of_a_live_module(version):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    with torch.no_grad():  # NaN payloads and signed zeros must survive the undo too
        model[0].weight.view(-1)[:4] = bf16_from_bits([0x7FC1, 0xFF81, 0x8000, 0x0001])
    base = clone_all(model.state_dict())
    rng = np.random.default_rng(2)
    target = {k: rl_step(v, 0.3, rng) for k, v in base.items()}
    names = list(target)
    payload = _forge(codec.encode(base, target, format_version=version), names[-1], _bad_digest)
    with pytest.raises(codec.DeltaError, match=r"2\.bias"):
        codec.apply_(model.state_dict(), payload)
    assert_bit_exact(model.state_dict(), base)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_mapping_with_other_names_is_refused_untouched(change):
    base, target = model_pair(n_tensors=3, shape=(32, 32), fraction=0.05)
    payload = codec.encode(base, target)
    live = clone_all(base)
    if change == "missing":
        del live["layers.1.weight"]
    else:
        live["intruder.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    before, versions = snapshot(live), _versions(live)
    with pytest.raises(codec.DeltaError, match="layers.1.weight" if change == "missing" else "intruder"):
        codec.apply_(live, payload)
    _assert_untouched(live, before, versions)


def test_applying_twice_is_refused_and_harmless():
    base, target = model_pair(n_tensors=3, shape=(32, 32), fraction=0.05)
    payload = codec.encode(base, target)
    live = clone_all(base)
    codec.apply_(live, payload)
    before, versions = snapshot(live), _versions(live)
    with pytest.raises(codec.DeltaError):
        codec.apply_(live, payload)
    _assert_untouched(live, before, versions)


def test_non_contiguous_live_tensor_is_refused_and_restored():
    base, target = model_pair(n_tensors=3, shape=(32, 32), fraction=0.05)
    payload = codec.encode(base, target)
    live = clone_all(base)
    last = list(live)[2]
    live[last] = live[last].t().contiguous().t()  # same values, column-major storage
    before = snapshot(live)
    with pytest.raises(ValueError, match=last.replace(".", r"\.")):
        codec.apply_(live, payload)
    _assert_untouched(live, before)


def test_chain_forward_and_back():
    base, target = model_pair(n_tensors=3, shape=(48, 48), fraction=0.02, seed=3)
    forward, backward = codec.encode(base, target), codec.encode(target, base)
    live = clone_all(base)
    codec.apply_(live, forward)
    assert_bit_exact(live, target)
    codec.apply_(live, memoryview(backward))
    assert_bit_exact(live, base)


def _apply_peak(n_tensors: int) -> tuple[int, int]:
    """(checkpoint bytes, peak traced allocation while applying a 1% step to it)."""
    base, target = model_pair(n_tensors=n_tensors, shape=(128, 128), fraction=0.01, seed=4)
    payload = codec.encode(base, target)
    live = clone_all(base)
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    tracemalloc.start()
    try:
        codec.apply_(live, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_bit_exact(live, target)
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs  # written in place, nothing reallocated
    return sum(v.numel() * v.element_size() for v in live.values()), peak


def test_extra_memory_is_an_undo_log_not_a_copy():
    """Growing the checkpoint 8x grows the peak extra memory of apply_ by a small fraction of the
    added bytes: per-tensor scratch and an undo log of changed elements, never a checkpoint copy.
    (Fixed costs such as shared value tables do not depend on the model, so only growth is compared.)"""
    small_total, small_peak = _apply_peak(4)
    big_total, big_peak = _apply_peak(32)
    assert big_peak - small_peak < (big_total - small_total) / 4, (small_peak, big_peak, big_total - small_total)


# --- chains: UndoLog, workers, only --------------------------------------------------------------------------

def _chain(n_steps: int, seed: int = 5, fraction: float = 0.03):
    """States 0..n_steps of a small BF16 model plus the payloads between consecutive ones."""
    base, _ = model_pair(n_tensors=4, shape=(64, 64), fraction=fraction, seed=seed)
    rng = np.random.default_rng(seed)
    states = [clone_all(base)]
    for _ in range(n_steps):
        states.append({k: rl_step(v, fraction, rng) if v.dtype is torch.bfloat16 else v.clone()
                       for k, v in states[-1].items()})
    payloads = [codec.encode(a, b) for a, b in zip(states, states[1:])]
    return states, payloads


@pytest.mark.parametrize("workers", [1, 2])
def test_undo_log_reverts_three_steps_bit_exactly(workers):
    states, payloads = _chain(3)
    live = clone_all(states[0])
    objects = {k: v for k, v in live.items()}
    undo = codec.UndoLog()
    for p, want in zip(payloads, states[1:]):
        codec.apply_(live, p, workers=workers, undo=undo)
        assert_bit_exact(live, want)
    changes = sum(int((bits_of(a[k]) != bits_of(b[k])).sum()) for a, b in zip(states, states[1:]) for k in a)
    assert len(undo) > 0 and 0 < undo.nbytes <= 6 * changes  # int32 positions and BF16 old values, nothing more
    assert {k: d.hex() for k, d in undo.verified().items()} == {k: v.digest for k, v in tensor_infos(states[3]).items()}
    undo.revert()
    assert_bit_exact(live, states[0])
    assert all(live[k] is objects[k] for k in live) and len(undo) == 0


def test_undo_log_after_a_failed_third_step():
    """Steps 1 and 2 logged, step 3 forged: apply_ restores its own writes and logs nothing; reverting the log
    then gives step 0 exactly."""
    states, payloads = _chain(3, seed=6)
    live = clone_all(states[0])
    undo = codec.UndoLog()
    codec.apply_(live, payloads[0], undo=undo)
    codec.apply_(live, payloads[1], undo=undo)
    logged = len(undo)
    name = _changed_names(states[2], states[3])[-1]
    with pytest.raises(codec.DeltaError, match=name.replace(".", r"\.")):
        codec.apply_(live, _forge(payloads[2], name, _bad_digest), workers=2, undo=undo)
    assert_bit_exact(live, states[2]) and len(undo) == logged
    undo.revert()
    assert_bit_exact(live, states[0])


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_every_dtype_in_place_with_workers_and_undo(version):
    """edge_pair holds every dtype codec knows (NaN payloads, -0.0, empty and 0-d tensors): two workers give
    the same bits, and the undo log takes them back."""
    base, target = edge_pair(seed=9)
    payload = codec.encode(base, target, format_version=version)
    live = clone_all(base)
    undo = codec.UndoLog()
    codec.apply_(live, payload, workers=2, undo=undo)
    assert_bit_exact(live, target)
    undo.revert()
    assert_bit_exact(live, base)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("damage", ["digest", "stream"])
def test_hostile_records_with_two_workers_touch_nothing(version, damage):
    """Every changed record forged in turn, decoded and written on two threads: refused naming it, every bit
    as before (the writes of tensors done on the other thread are undone too)."""
    base, target = edge_pair(seed=10)
    payload = codec.encode(base, target, format_version=version)
    for name in [k for k in _changed_names(base, target) if base[k].numel()][:6]:
        forged = _forge(payload, name, _bad_digest if damage == "digest" else _bad_stream)
        live = clone_all(base)
        before = snapshot(live)
        undo = codec.UndoLog()
        with pytest.raises(codec.DeltaError) as err:
            codec.apply_(live, forged, workers=2, undo=undo)
        assert name in str(err.value) and len(undo) == 0
        _assert_untouched(live, before)


def test_tied_weights_revert_and_revert_copy():
    """Names sharing memory are written one after another; reverting the log gives the old bits through both
    names, and revert_copy rebuilds the old bits of one name in a copy without touching the live tensor."""
    torch.manual_seed(3)
    trainer, rollout = _Tied().to(torch.bfloat16), _Tied().to(torch.bfloat16)
    rollout.load_state_dict(trainer.state_dict())
    base = clone_all(trainer.state_dict())
    rng = np.random.default_rng(3)
    with torch.no_grad():
        trainer.embed.weight.copy_(rl_step(trainer.embed.weight, 0.05, rng))
    target = clone_all(trainer.state_dict())
    payload = codec.encode(base, target)
    live = rollout.state_dict()
    undo = codec.UndoLog()
    codec.apply_(live, payload, workers=2, undo=undo)
    assert_bit_exact(rollout.state_dict(), target)
    copy = live["head.weight"].detach().clone()
    undo.revert_copy("head.weight", copy)
    assert torch.equal(copy.view(torch.int16), base["head.weight"].view(torch.int16))
    assert_bit_exact(rollout.state_dict(), target)  # the live state is untouched by revert_copy
    undo.revert()
    assert_bit_exact(rollout.state_dict(), base)
    assert rollout.head.weight is rollout.embed.weight


def test_tied_names_written_differently_are_refused():
    """A forged payload that moves one of two tied names and says the other is unchanged: the alias no longer
    matches its record once the write is done, so the call is refused and both names restored."""
    torch.manual_seed(4)
    m = _Tied().to(torch.bfloat16)
    base = clone_all(m.state_dict())
    rng = np.random.default_rng(4)
    target = clone_all(base)
    target["embed.weight"] = rl_step(base["embed.weight"], 0.05, rng)  # head.weight stays: impossible if tied
    payload = codec.encode(base, target)
    live = m.state_dict()
    before = snapshot(live)
    with pytest.raises(codec.DeltaError, match="head.weight|embed.weight"):
        codec.apply_(live, payload)
    _assert_untouched(live, before)


def test_only_applies_the_named_records():
    """`only` applies and verifies the named records alone, over a mapping that holds just those tensors
    (streaming a checkpoint); a name the payload lacks is refused."""
    states, payloads = _chain(1, seed=7)
    names = list(states[0])
    one = {names[1]: states[0][names[1]].clone()}
    codec.apply_(one, payloads[0], only=[names[1]])
    assert_bit_exact(one, {names[1]: states[1][names[1]]})
    with pytest.raises(codec.DeltaError, match="does not name"):
        codec.apply_({names[1]: states[0][names[1]].clone()}, payloads[0], only=["nope"])


def _stream_word_flipped(e, word: int):
    """The record with bit 0 of stream word `word` flipped (the decoder reads the words from the end:
    word 0 last, so its damage shows only at the stream's end)."""
    s = e.streams[0]
    raw = bytearray(s.stored)
    raw[4 * word] ^= 1
    s.stored = bytes(raw)
    return e


@pytest.mark.parametrize("word", ["first", "middle"])
def test_in_place_decode_failing_after_its_writes_restores_the_tensor(monkeypatch, word):
    """A conditional record is decoded straight into the live tensor, chunk by chunk (one pass over it, no
    patch decoded beforehand): a stream that fails only near its end, after most chunks were written, or
    halfway, leaves every bit as it was, and the genuine payload then applies."""
    from codec.methods import conditional

    rng = np.random.default_rng(11)
    base = {"w": random_bf16_weights((256, 1024), rng), "b": random_bf16_weights((4096,), rng)}
    target = {k: rl_step(v, 0.02, rng) for k, v in base.items()}
    payload = codec.encode(base, target)
    entry = next(e for e in container.unpack(payload).entries if e.name == "w")
    assert entry.method == conditional.ID and len(entry.streams[0].stored) > 64
    written = []
    real = conditional._decode_in_place

    def spy(b, *args):
        out = real(b, *args)
        written.append((b.size, int(out[2]), int(out[3])))  # elements, changes written before the verdict, status
        return out

    monkeypatch.setattr(conditional, "_decode_in_place", spy)
    monkeypatch.setattr(conditional.Conditional, "decode", lambda *a: pytest.fail("a separate decode pass"))
    words = len(entry.streams[0].stored) // 4 - 2 * conditional.FOUR_STATES
    at = 0 if word == "first" else words // 2
    forged = _forge(payload, "w", lambda e: _stream_word_flipped(e, at))
    live = _refused_untouched(base, forged, "w")
    size, done, status = next(w for w in written if w[0] == base["w"].numel())
    assert status != 0 and done > (entry.changes * 3 // 4 if word == "first" else 0)  # it had written, then failed
    written.clear()
    codec.apply_(live, payload)
    assert_bit_exact(live, target)
    assert {w[0] for w in written} == {base["w"].numel(), base["b"].numel()} and all(w[2] == 0 for w in written)


def test_tied_names_are_decoded_before_any_write():
    """Names sharing memory keep the two-pass path (every patch decoded against the untouched base first):
    a record decoded in place would read its tied partner's writes as its base."""
    from codec.methods import conditional

    rng = np.random.default_rng(12)
    w = random_bf16_weights((64, 64), rng)
    base = {"embed.weight": w, "head.weight": w}
    new = rl_step(w, 0.05, rng)
    target = {"embed.weight": new, "head.weight": new}
    payload = codec.encode(clone_all(base), target)
    shared = w.clone()
    live = {"embed.weight": shared, "head.weight": shared}
    calls = []
    real = conditional.Conditional.decode_in_place

    def spy(self, *a, **k):
        calls.append(a[0].name)
        return real(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conditional.Conditional, "decode_in_place", spy)
        codec.apply_(live, payload)
    assert calls == [] and np.array_equal(bits_of(shared), bits_of(new))
