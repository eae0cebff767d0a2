"""Codec v2 (`conditional` method): compression behaviour, format stability, device path, rANS."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

import codec
from codec import container, rans, tensors, wire
from codec.device import analyze_on_device
from codec.methods import conditional, exponent_classes as ec

from codec_cases import assert_bit_exact, bf16_from_bits, bits_of


def rl_step(w: torch.Tensor, lr: float, seed: int) -> torch.Tensor:
    """An AdamW-like update of ~lr per element on FP32 master weights, cast to BF16."""
    g = torch.Generator().manual_seed(seed)
    return (w.float() + lr * torch.sign(torch.randn(w.shape, generator=g))).to(torch.bfloat16)


@pytest.fixture(scope="module")
def rl_pair() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    base = {
        "w1": (0.05 * torch.randn(256, 512, generator=g)).to(torch.bfloat16),
        "w2": (0.02 * torch.randn(512, 128, generator=g)).to(torch.bfloat16),
        "norm": torch.ones(128, dtype=torch.float32),
    }
    target = {"w1": rl_step(base["w1"], 3e-4, 1), "w2": rl_step(base["w2"], 3e-4, 2), "norm": base["norm"] + 1e-3}
    return base, target


def test_conditional_is_picked_and_beats_v1(rl_pair):
    base, target = rl_pair
    v2 = codec.encode(base, target)
    v1 = codec.encode(base, target, format_version=1)
    methods = {t["name"]: t["method"] for t in codec.describe(v2)["tensors"]}
    assert methods["w1"] == "conditional" and methods["w2"] == "conditional"
    assert len(v2) < 0.75 * len(v1)
    for payload in (v1, v2):
        out = codec.decode(base, payload)
        assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)


def test_mask_cost_follows_base_exponent(rl_pair):
    """Small weights change more often: the classes split the exponent axis, and the mask level of
    the smallest-exponent class says likelier (lower level) than the largest one's."""
    base, target = rl_pair
    a = conditional.analyze(tensors.element_view(base["w1"]), tensors.element_view(target["w1"]))
    assert a.nclass > 1 and np.all(np.diff(a.thresholds) > 0)
    assert a.class_sizes.sum() == base["w1"].numel()
    levels = conditional._choose_levels(a.class_sizes[: a.nclass].astype(float), a.class_changes().astype(float))
    assert levels[0] < levels[-1]


def test_ranks_count_class_members_before_each_change():
    """Against a direct numpy computation, on sizes that are and are not whole 64-element blocks."""
    rng = np.random.default_rng(5)
    for n in (1, 63, 64, 1000, 4096 + 17):
        b = (rng.normal(0, 0.05, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        t = b.copy()
        flip = rng.random(n) < 0.1
        t[flip] ^= 1
        a = conditional.analyze(b, t)
        lut = conditional.ec.class_lut(a.thresholds)
        cls = lut[(b >> 7) & 0xFF]
        index = np.flatnonzero(flip)
        assert np.array_equal(a.pairs, (b[index].astype(np.uint32) << 16) | t[index])
        assert np.array_equal(a.class_sizes[: a.nclass], np.bincount(cls, minlength=a.nclass))
        for j, q in enumerate(index):
            assert a.classes[j] == cls[q] and a.ranks[j] == np.count_nonzero(cls[:q] == cls[q])


def test_v2_payload_records_bits_per_change(rl_pair):
    base, target = rl_pair
    info = codec.describe(codec.encode(base, target))
    row = next(t for t in info["tensors"] if t["name"] == "w1")
    assert 0 < row["bits_per_change"] < 16
    assert info["format_version"] == codec.FORMAT_VERSION == 4


def test_mask_tables_are_pinned():
    """The tables are part of the format: any drift would break payloads across versions/machines."""
    freq, cum, slots = conditional.mask_tables()
    assert freq.shape == (256, conditional.GAP_TOKENS)
    assert (freq.sum(axis=1) == 1 << conditional.MASK_SCALE).all()
    assert (freq >= 1).all() and (freq < 1 << conditional.MASK_SCALE).all()
    assert xxhash.xxh3_64_hexdigest(freq.astype("<i8").tobytes()) == "c09a7db0bfc89982"


def test_every_transition_between_special_patterns():
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F,
                         0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80], np.uint16)
    b = np.repeat(specials, specials.size)
    t = np.tile(specials, specials.size)
    base = {"x": bf16_from_bits(b)}
    target = {"x": bf16_from_bits(t)}
    payload = codec.encode(base, target, effort="fast")
    out = codec.decode(base, payload)
    assert np.array_equal(bits_of(out["x"]), bits_of(target["x"]))


def test_device_path_matches_host_analysis():
    rng = np.random.default_rng(3)
    b = rng.integers(0, 1 << 16, 50_000, dtype=np.uint16)
    t = b.copy()
    flip = rng.random(b.size) < 0.05
    t[flip] = rng.integers(0, 1 << 16, int(flip.sum()), dtype=np.uint16)
    bt, tt = bf16_from_bits(b), bf16_from_bits(t)
    host = conditional.analyze(b, t)
    dev = analyze_on_device(bt, tt)
    for field in ("thresholds", "class_sizes", "pairs", "keys", "classes", "ranks", "zig"):
        assert np.array_equal(getattr(host, field), getattr(dev, field)), field
    assert np.array_equal(dev.index, np.flatnonzero(flip))
    model = conditional.ValueModel.fit([dev])
    params, streams = conditional.encode(dev, model)
    assert (params, bytes(streams[0].stored)) == tuple(
        (p, bytes(s[0].stored)) for p, s in [conditional.encode(host, model)])[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_encode_on_cuda_round_trips(rl_pair):
    base, target = rl_pair
    cb = {k: v.cuda() for k, v in base.items()}
    ct = {k: v.cuda() for k, v in target.items()}
    payload = codec.encode(cb, ct)
    assert payload == codec.encode(base, target)
    out = codec.decode(base, payload)
    assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)


def test_forged_entropy_stream_is_refused(rl_pair):
    base, target = rl_pair
    parsed = container.unpack(codec.encode(base, target))
    rng = np.random.default_rng(0)
    for entry in parsed.entries:
        if entry.method != conditional.ID:
            continue
        original = bytes(entry.streams[0].stored)
        for _trial in range(20):
            junk = bytearray(original)
            junk[rng.integers(0, len(junk))] ^= 1 << int(rng.integers(0, 8))
            entry.streams[0] = container.Stream(0, len(junk), bytes(junk))
            forged = container.pack(parsed)  # valid container, recomputed checksum
            with pytest.raises(codec.DeltaError) as err:
                codec.decode(base, forged)
            assert err.value.tensor == entry.name
        entry.streams[0] = container.Stream(0, len(original), original)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1 << 21), st.integers(0, 2 * 0x3F80 - 1)),
                min_size=1, max_size=64), st.booleans())
def test_entropy_kernels_round_trip(changes, four):
    """The encoder and decoder kernels on extreme symbols: gaps up to 2**21 (19 raw bits: more
    than one chunk), every value token, every class, two or four interleaved states; the stream
    ends exactly (every state back to L). (Larger gaps code the same way; the decoder's class
    bitmaps would not fit a test.)"""
    cls = np.array([c for c, _, _ in changes], np.uint8)
    gaps = np.array([g for _, g, _ in changes], np.int64)
    zig = np.array([z for _, _, z in changes], np.int64)
    ranks = np.empty_like(gaps)
    last = np.full(8, -1, np.int64)
    for j, (c, g) in enumerate(zip(cls, gaps)):
        last[c] += g + 1
        ranks[j] = last[c]
    # base 1.0 (exponent 0x7F): a step of < 0x3F80 stays among positive values, where the
    # order-preserving map is bits ^ 0x8000
    steps = np.where(zig % 2 == 0, (zig + 2) // 2, -((zig + 1) // 2))
    pairs = (np.uint32(0x3F80) << np.uint32(16)) | (((0x3F80 ^ 0x8000) + steps) ^ 0x8000).astype(np.uint32)
    analysis = conditional.Analysis(np.zeros(0, np.int64), np.zeros(8, np.int64), pairs, cls, ranks)
    assert np.array_equal(analysis.zig, zig)
    hist = np.ones(conditional.VALUE_TOKENS)
    model = conditional.ValueModel(rans.normalize(hist, conditional.VALUE_SCALE, floor_all=True)[None, :],
                                   np.array([0x7F]))
    levels = np.array([0, 10, 40, 80, 120, 160, 200, 255], np.int64)
    mfreq, mcum, mslot = conditional.mask_tables()
    mrcp, mrsh = conditional.mask_reciprocals()
    words, nw, *final = conditional._encode(pairs, conditional._value_symbols(pairs), cls, ranks,
                                            np.bincount(cls, minlength=8), levels, mcum, mfreq, mrcp, mrsh, model.cum,
                                            model.freq, model.rcp, model.rsh, model.row_of_key, four)
    n = 4 if four else 2
    assert four or final[2] == final[3] == rans.RANS_L  # two states: 2 and 3 unused
    w, xs = rans.bytes_to_words(rans.words_to_bytes(words, nw, tuple(int(x) for x in final[:n])), n)
    xs = [np.int64(x) for x in xs + (rans.RANS_L,) * (4 - n)]
    counts = np.bincount(cls, minlength=8)
    # a tensor just large enough: its classes hold every rank
    padded = -(-int(sum(last[c] + 1 for c in range(8) if last[c] >= 0)) // 64) * 64
    bits, start, lim, *state, status = conditional._decode_gaps(padded, padded, w, *xs, four, levels, counts, mcum,
                                                                mfreq, mslot)
    assert status == 0
    order = np.lexsort((ranks, cls))
    first = np.searchsorted(cls[order], np.arange(9)).astype(np.int64)
    want = ec.rank_bitmaps(ranks[order], first, padded)
    assert want[3] == 0
    for got_part, want_part in zip((bits, start, lim), want[:3]):
        assert np.array_equal(got_part, want_part)
    base = np.full(len(changes), 0x3F80, np.uint16)
    out = base.copy()
    values = np.empty(len(changes), np.uint16)
    at = np.arange(len(changes))
    *xs, pos = state
    *end, status = conditional._decode_values(base, at, 0, len(changes), w, *xs, four, pos, model.cum, model.freq,
                                              model.slots, model.row_of_key, values, np.empty(0, np.uint16))
    assert status == 0
    assert end == [rans.RANS_L] * 4 + [-1]  # the stream ends exactly: every state at L, every word consumed
    assert np.array_equal(values.astype(np.int64), 0x3F80 + steps)
    # building a target instead: the values land in it
    *end, status = conditional._decode_values(base, at, 0, len(changes), w, *xs, four, pos, model.cum, model.freq,
                                              model.slots, model.row_of_key, np.empty(0, np.uint16), out)
    assert status == 0 and end == [rans.RANS_L] * 4 + [-1]
    assert np.array_equal(out, values)


def test_workers_give_the_same_payload_and_target(rl_pair):
    base, target = rl_pair
    one = codec.encode(base, target)
    assert codec.encode(base, target, workers=3) == one
    out = codec.decode(base, one, workers=3)
    assert list(out) == list(target)
    assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)


def test_worker_pool_is_shared_by_concurrent_callers_and_renewed_after_fork(rl_pair):
    """Calls with workers > 1 share one thread pool per process: callers on several threads at
    once each get their own exact result, and a forked child (whose copy of the pool has no
    threads) gets a working pool of its own instead of waiting forever."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor
    base, target = rl_pair
    one = codec.encode(base, target)
    with ThreadPoolExecutor(3) as callers:
        payloads = list(callers.map(lambda _: codec.encode(base, target, workers=2), range(3)))
        outs = list(callers.map(lambda p: codec.decode(base, p, workers=2), payloads))
    assert payloads == [one] * 3
    assert all(np.array_equal(bits_of(o[k]), bits_of(target[k])) for o in outs for k in target)
    child = multiprocessing.get_context("fork").Process(target=_encode_with_workers_and_check, args=(base, target, one))
    child.start()
    child.join(120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0, (alive, child.exitcode)


def _encode_with_workers_and_check(base, target, expected) -> None:
    import os
    ok = codec.encode(base, target, workers=2) == expected
    os._exit(0 if ok else 3)


def test_batch_analyses_are_those_of_one_tensor_at_a_time():
    """A Batch (tensors read in place through their addresses, changes back to back) gives each
    tensor the analysis `analyze` gives it alone, value symbols included, with or without
    buffers lent to it (grown here: they start empty)."""
    rng = np.random.default_rng(5)
    bs, ts = [], []
    for n, p in [(64 * 300, 0.03), (1000, 0.5), (64, 0.0), (70000, 0.01)]:
        b = (rng.normal(0, 0.05, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        t = b.copy()
        flip = rng.random(n) < p
        t[flip] += 1
        bs.append(b)
        ts.append(t)
    padded = [ec.blocks(a) for a in bs + ts]  # readable in whole blocks, as analyze_at requires
    where = np.array([[padded[i].ctypes.data, padded[len(bs) + i].ctypes.data] for i in range(len(bs))], np.uintp)
    sizes = np.array([b.size for b in bs], np.int64)
    for buffers in (None, ec.ScanBuffers()):
        batch = conditional.analyze_at(where, sizes, buffers=buffers)
        assert list(batch.changes()) == [int((b != t).sum()) for b, t in zip(bs, ts)]
        _ = batch.value_symbols  # computed for the whole batch first: each analysis then holds a view
        for i, (b, t) in enumerate(zip(bs, ts)):
            got, want = batch.analysis(i), conditional.analyze(b, t)
            for field in ("thresholds", "class_sizes", "pairs", "classes", "ranks", "value_symbols"):
                assert np.array_equal(getattr(got, field), getattr(want, field)), (i, field)
            assert np.array_equal(got.class_changes(), want.class_changes())


def test_reused_scan_buffers_give_the_payloads_of_fresh_ones(rl_pair, monkeypatch):
    """Encode lends its batches scan buffers kept from earlier calls (api._BUFFERS): a payload
    made after a larger or a denser one, on one thread or several, is the one fresh buffers give,
    and the buffers come back to the pool."""
    from codec import api
    base, target = rl_pair
    small = {"w2": base["w2"]}, {"w2": target["w2"]}
    dense = {"w1": base["w1"]}, {"w1": rl_step(base["w1"], 5e-2, 3)}  # most elements change: buffers grow
    fresh = {}
    for name, (b, t) in {"pair": rl_pair, "small": small, "dense": dense}.items():
        monkeypatch.setattr(api, "_BUFFERS", api._BufferPool())
        fresh[name] = codec.encode(b, t)
    pool = api._BufferPool()
    monkeypatch.setattr(api, "_BUFFERS", pool)
    for workers in (1, 2, 1):
        for name, (b, t) in {"dense": dense, "pair": rl_pair, "small": small, "pair again": rl_pair}.items():
            assert codec.encode(b, t, workers=workers) == fresh[name.split()[0]], (name, workers)
    free = pool._free[conditional.ID]  # the pool keeps each method's scratch (`Method.scratch`) apart
    assert 1 <= len(free) <= api._BufferPool.SETS
    assert max(buffers.pairs.size for buffers in free) >= 256 * 512 // 2  # grown for the dense pair


def test_decode_builds_the_target_in_place_for_every_size():
    """The decoder writes the target during its scan when the base is whole 64-element blocks,
    and copies first otherwise; both must equal the target bit for bit, and the base stays put."""
    g = torch.Generator().manual_seed(7)
    base = {f"t{n}": (0.05 * torch.randn(n, generator=g)).to(torch.bfloat16)
            for n in (1, 63, 64, 65, 1000, 4096, 70_000)}
    target = {k: rl_step(v, 3e-3, i) for i, (k, v) in enumerate(base.items())}
    before = {k: bits_of(v).copy() for k, v in base.items()}
    payload = codec.encode(base, target)
    assert {t["method"] for t in codec.describe(payload)["tensors"]} >= {"conditional"}
    out = codec.decode(base, payload)
    for k in target:
        assert np.array_equal(bits_of(out[k]), bits_of(target[k])), k
        assert np.array_equal(bits_of(base[k]), before[k]), k


def test_value_tables_normalise_all_rows_like_one_row():
    """The bulk normaliser behind the value tables equals the one-row rule exactly (the tables are
    part of the payload: any difference would change bytes)."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        rows, cols = int(rng.integers(1, 30)), conditional.VALUE_TOKENS
        top = 10 ** int(rng.integers(1, 7))
        counts = (rng.random((rows, cols)) < rng.random()) * rng.integers(0, top, (rows, cols))
        counts[counts.sum(axis=1) == 0, int(rng.integers(0, cols))] = 1  # every row has a count
        bulk = rans.normalize_rows(counts, conditional.VALUE_SCALE)
        one = np.stack([rans.normalize(row, conditional.VALUE_SCALE, floor_all=False) for row in counts])
        assert np.array_equal(bulk, one)


@pytest.mark.parametrize("native", [True, False], ids=["kernels-hash", "python-hashes"])
def test_digests_fed_by_the_kernels_match_whole_tensor_digests(native, monkeypatch):
    """The scan feeds both digests part by part, the decoder the target's chunk by chunk (where
    the xxhash build lets kernels hash, `hashing.KERNEL_DIGESTS`; else Python hashes whole tensors): the
    same digests as hashing each whole tensor, the same payload either way, and it decodes."""
    from codec import hashing
    from codec.hashing import digest_elements
    if native and not hashing.KERNEL_DIGESTS:
        pytest.skip("this xxhash build or platform does not let kernels hash")
    if not native:
        monkeypatch.setattr(hashing, "NATIVE", None)
        monkeypatch.setattr(hashing, "KERNEL_DIGESTS", False)
    n = 3 * ec.HASH_PART + 1000  # parts of the scan and chunks of the decoder, and a partial one
    rng = np.random.default_rng(11)
    base = {"big": torch.randn(n).to(torch.bfloat16), "small": torch.randn(300).to(torch.bfloat16)}
    target = {k: v.clone() for k, v in base.items()}
    for v in target.values():
        bits = v.view(torch.int16)
        idx = torch.from_numpy(rng.choice(v.numel(), v.numel() // 50, replace=False))
        bits[idx] ^= 1
    payload = codec.encode(base, target)
    if native:
        with monkeypatch.context() as m:
            m.setattr(hashing, "NATIVE", None)
            m.setattr(hashing, "KERNEL_DIGESTS", False)
            assert codec.encode(base, target) == payload
    for entry in container.unpack(payload).entries:
        assert entry.method == conditional.ID
        assert entry.base_digest == digest_elements(tensors.BF16.name, entry.shape, bits_of(base[entry.name]))
        assert entry.target_digest == digest_elements(tensors.BF16.name, entry.shape, bits_of(target[entry.name]))
    out = codec.decode(base, payload)
    assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)
    # a corrupted stream of the large tensor, decoded chunk by chunk, is refused naming it
    parsed = container.unpack(payload)
    entry = next(e for e in parsed.entries if e.name == "big")
    junk = bytearray(entry.streams[0].stored)
    junk[len(junk) // 2] ^= 0x10
    entry.streams[0] = container.Stream(0, len(junk), bytes(junk))
    with pytest.raises(codec.DeltaError) as err:
        codec.decode(base, container.pack(parsed))
    assert err.value.tensor == "big"


def _interleave_pair() -> tuple[dict, dict]:
    """Tensors on each side of the v3 interleave rule: many changes (four states), a few (two),
    and small ones (the batched decoder)."""
    g = torch.Generator().manual_seed(7)
    base = {"many": (0.05 * torch.randn(512, 256, generator=g)).to(torch.bfloat16),
            "few": (0.05 * torch.randn(512, 256, generator=g)).to(torch.bfloat16),
            "small": (0.05 * torch.randn(384, generator=g)).to(torch.bfloat16)}
    target = {"many": rl_step(base["many"], 3e-4, 1), "small": rl_step(base["small"], 3e-4, 3)}
    few = base["few"].clone().view(-1)
    few[::400] = -few[::400]  # ~330 sign flips
    target["few"] = few.view(512, 256)
    return base, target


def test_v3_records_with_many_changes_use_four_states():
    """v3 states its rule (records with >= FOUR_STATES_FROM changes use four interleaved states,
    8 more bytes of final state); v2 payloads of the same pair use two everywhere; both decode."""
    base, target = _interleave_pair()
    for version in (2, 3):
        payload = codec.encode(base, target, format_version=version)
        parsed = container.unpack(payload)
        assert (conditional.SHARED_INTERLEAVE in parsed.shared) == (version == 3)
        entries = {e.name: e for e in parsed.entries}
        assert entries["many"].changes >= conditional.FOUR_STATES_FROM > entries["few"].changes > 0
        for name, e in entries.items():
            assert e.method == conditional.ID
            four = version == 3 and e.changes >= conditional.FOUR_STATES_FROM
            assert four == (version == 3 and name == "many")
            words, states = conditional._stream(e, four)
            assert len(e.streams[0].stored) == 4 * words.size + 8 * (4 if four else 2)
        out = codec.decode(base, payload)
        assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)


@pytest.mark.parametrize("rule", [b"", b"\x80", b"\x01\x02", b"\x00", b"\xff\xff\xff\xff\xff\xff\xff\xff\x7f"])
def test_forged_interleave_rule_is_refused(rule):
    """A rule that does not parse, or that tells the decoder to read other state counts than the
    encoder wrote, is refused with DeltaError naming a tensor; nothing crashes."""
    base, target = _interleave_pair()
    parsed = container.unpack(codec.encode(base, target))
    parsed.shared[conditional.SHARED_INTERLEAVE] = rule
    with pytest.raises(codec.DeltaError) as err:
        codec.decode(base, container.pack(parsed))
    assert err.value.tensor in target


def test_v2_payload_with_a_v3_rule_is_refused():
    base, target = _interleave_pair()
    parsed = container.unpack(codec.encode(base, target, format_version=2))
    parsed.shared[conditional.SHARED_INTERLEAVE] = conditional.interleave_rule(conditional.FOUR_STATES_FROM)
    with pytest.raises(codec.DeltaError, match="v3 field"):
        codec.decode(base, container.pack(parsed))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 255), unique=True, max_size=40).map(sorted), st.data())
def test_value_tables_block_round_trips_in_the_documented_layout(keys, data):
    """ValueModel.pack writes docs/FORMAT.md's kind-1 block (checked field by field here) and
    unpack reads it back exactly."""
    hist = np.array([[data.draw(st.integers(0, 1000)) if data.draw(st.booleans()) else 0
                      for _ in range(conditional.VALUE_TOKENS)] for _ in keys],
                    np.int64).reshape(-1, conditional.VALUE_TOKENS)
    if keys:
        hist[:, 0] += 1
    freq = rans.normalize_rows(hist, conditional.VALUE_SCALE) if keys else np.zeros((0, conditional.VALUE_TOKENS))
    model = conditional.ValueModel(freq, np.array(keys, np.int64))
    block = model.pack()
    want = [len(keys)]
    prev = -1
    for key, row in zip(keys, model.freq):
        nz = np.flatnonzero(row)
        want += [key - prev - 1, nz.size]
        prev = key
        last = -1
        for t in nz:
            want += [int(t) - last - 1, int(row[t])]
            last = int(t)
    assert block == wire.uvarints(np.array(want, np.int64))
    back = conditional.ValueModel.unpack(block)
    assert np.array_equal(back.keys, keys) and np.array_equal(back.freq, model.freq)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), vote=st.booleans())
def test_value_tables_fast_parse_accepts_exactly_what_the_checked_parse_accepts(data, vote):
    """Value-table blocks (and v4's vote tables, keyed by context), valid or mutated (varints
    changed, dropped, added), parse the same in the compiled pass as field by field: the same
    model, or both refuse (the checked parse then names the fault)."""
    n_keys = conditional.N_CONTEXTS if vote else conditional.N_KEYS
    keys = sorted(data.draw(st.sets(st.integers(0, n_keys - 1), max_size=4)))
    hist = np.zeros((len(keys), conditional.VALUE_TOKENS), np.int64)
    for row in hist:
        for t in data.draw(st.sets(st.integers(0, conditional.VALUE_TOKENS - 1), min_size=1, max_size=5)):
            row[t] = data.draw(st.integers(1, 500))
    freq = rans.normalize_rows(hist, conditional.VALUE_SCALE) if keys else np.zeros((0, conditional.VALUE_TOKENS))
    vals = wire.read_uvarints(conditional.ValueModel(freq, np.array(keys, np.int64), vote).pack(), "tables")
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(vals)))
        choice = data.draw(st.sampled_from(["set", "drop", "insert"]))
        if choice == "set" and i < len(vals):
            vals[i] = data.draw(st.sampled_from([0, 1, 2, 63, 64, 65, 255, 256, 257, 1279, 1280, 1281, 4095, 4096, 4097,
                                                 1 << 40]))
        elif choice == "drop" and i < len(vals):
            del vals[i]
        else:
            vals.insert(i, data.draw(st.integers(0, 5000)))
    block = wire.uvarints(np.array(vals, np.int64))
    try:
        want = conditional.ValueModel.unpack_checked(block, vote)
    except codec.DeltaError:
        want = None
    status, keys_fast, freq_fast = conditional._unpack_tables(np.array(vals, np.int64), n_keys)
    assert (status == 0) == (want is not None)
    if want is not None:
        got = conditional.ValueModel.unpack(block, vote)
        assert got.vote == want.vote == vote
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.freq, want.freq)
        assert np.array_equal(keys_fast, want.keys) and np.array_equal(freq_fast, want.freq)
    else:
        with pytest.raises(codec.DeltaError):
            conditional.ValueModel.unpack(block, vote)


def test_value_symbols_are_key_and_token_of_every_step():
    """The value symbols (computed branch-free, vectorised) are each change's base exponent and
    its step's token, for every base and target bit pattern class: zero, subnormal, normal,
    Inf, NaN, both signs, steps of every size."""
    rng = np.random.default_rng(5)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80,
                         0xFF80, 0x7FC0, 0xFFFF], np.uint32)
    b = np.concatenate([np.repeat(specials, specials.size), rng.integers(0, 1 << 16, 5000)]).astype(np.uint32)
    t = np.concatenate([np.tile(specials, specials.size), rng.integers(0, 1 << 16, 5000)]).astype(np.uint32)
    keep = b != t
    pairs = (b[keep] << np.uint32(16)) | t[keep]
    a = conditional.Analysis(np.zeros(0, np.int64), np.zeros(8, np.int64), pairs, np.zeros(pairs.size, np.uint8),
                             np.arange(pairs.size))
    symbols = conditional._value_symbols(pairs)
    assert np.array_equal(symbols >> 6, a.keys)
    assert np.array_equal(symbols & 63, conditional._tokens(a.zig))


def test_level_walk_finds_the_exhaustive_searchs_level():
    """The mask level chosen by walking from the estimate is the first level of least cost, as
    trying all 256 finds it: for every class size and change count seen in practice and at the
    edges (no change, every element changed, one element)."""
    rng = np.random.default_rng(3)
    n = np.concatenate([rng.integers(1, 1 << 24, 20000), [1, 1, 2, 64, 1 << 40, 5, 1000]]).astype(np.float64)
    k = np.floor(n * rng.random(n.size) ** rng.integers(1, 12, n.size)).astype(np.float64)
    k[-7:] = [0, 1, 2, 64, 1 << 20, 0, 1000]
    k[:2000] = 0
    k[2000:4000] = n[2000:4000]
    logs = conditional._level_logs()
    assert np.array_equal(conditional._argmin_levels(n, k, logs), conditional._argmin_levels_exhaustive(n, k, logs))


def _leaning_pair() -> tuple[dict, dict]:
    """Steps whose direction leans per column (as an update's sign is shared along a weight's
    input axis), on a 2-D and a 3-D tensor, and a 1-D one (a single column)."""
    rng = np.random.default_rng(11)
    base, target = {}, {}
    for name, shape in (("w", (1024, 512)), ("cube", (8, 32, 64)), ("bias", (4000,))):
        b = (0.03 * np.exp(0.3 * rng.standard_normal(shape)) * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)
        cols = shape[-1] if len(shape) > 1 else 1
        lean = rng.choice([-1.0, 1.0], size=cols)
        step = np.where(rng.random(shape) < 0.97, lean, -lean) * np.abs(b) * 2.0 ** -8 * (rng.random(shape) < 0.05)
        base[name] = torch.from_numpy(b).to(torch.bfloat16)
        target[name] = torch.from_numpy(b + 1.5 * step).to(torch.bfloat16)
    return base, target


def test_v4_codes_values_with_column_votes():
    """v4 writes the vote tables (kind 3) and no value tables (kind 1); where columns lean, its
    values cost less than v3's, with the same mask; every record round-trips, through decode,
    apply_ and the patch path. Where votes would cost more (a tiny payload: five times the
    tables), v4 codes values as v3 does (kind 1) and is no larger."""
    tiny = {k: v[:4] for k, v in _leaning_pair()[0].items()}, {k: v[:4] for k, v in _leaning_pair()[1].items()}
    small = codec.encode(*tiny, format_version=4)
    assert conditional.SHARED_VOTE_TABLES not in container.unpack(small).shared
    assert len(small) <= len(codec.encode(*tiny, format_version=3)) + 2  # the version is all that differs
    out = codec.decode(tiny[0], small)
    assert all(np.array_equal(bits_of(out[k]), bits_of(tiny[1][k])) for k in tiny[1])
    base, target = _leaning_pair()
    v3 = codec.encode(base, target, format_version=3)
    v4 = codec.encode(base, target, format_version=4)
    p3, p4 = container.unpack(v3), container.unpack(v4)
    assert conditional.SHARED_VOTE_TABLES in p4.shared and conditional.SHARED_VALUE_TABLES not in p4.shared
    assert conditional.SHARED_VOTE_TABLES not in p3.shared
    for e3, e4 in zip(p3.entries, p4.entries):
        assert e3.method == e4.method == conditional.ID and e3.params == e4.params  # the mask is v3's
    assert len(v4) < 0.97 * len(v3)
    for payload in (v3, v4):
        out = codec.decode(base, payload)
        assert all(np.array_equal(bits_of(out[k]), bits_of(target[k])) for k in target)
        held = {k: v.clone() for k, v in base.items()}
        codec.apply_(held, payload)
        assert all(np.array_equal(bits_of(held[k]), bits_of(target[k])) for k in target)
    for e in p4.entries:
        b = bits_of(base[e.name]).view(np.uint16)
        patch = conditional.decode(e, b, p4.shared)
        t = bits_of(target[e.name]).view(np.uint16)
        assert np.array_equal(patch.index, np.flatnonzero(b != t)) and np.array_equal(patch.values, t[b != t])


def _leaning_and_not() -> tuple[dict, dict]:
    """`_leaning_pair` and a tensor whose steps go either way whatever their column (a dense
    layer's, on MiniLM): enough changes that only its lack of lean makes it still."""
    base, target = _leaning_pair()
    rng = np.random.default_rng(12)
    b = (0.03 * np.exp(0.3 * rng.standard_normal((512, 384))) * rng.choice([-1.0, 1.0], size=(512, 384)))
    step = rng.choice([-1.0, 1.0], size=b.shape) * np.abs(b) * 2.0 ** -8 * (rng.random(b.shape) < 0.05)
    base["dense"] = torch.from_numpy(b.astype(np.float32)).to(torch.bfloat16)
    target["dense"] = torch.from_numpy((b + 1.5 * step).astype(np.float32)).to(torch.bfloat16)
    return base, target


def _with_params(payload: bytes, edit) -> bytes:
    p = container.unpack(payload)
    p.entries = [dataclasses.replace(e, params=edit(e)) for e in p.entries]
    return container.pack(p)


def test_v4_records_whose_columns_do_not_lean_are_still():
    """A v4 record whose changes do not follow their columns' counters is still (its params'
    STILL bit): its values are coded with the counter-0 tables, unflipped, and it decodes on every
    path (the batched decode, one record alone, apply_, the patch); a leaning one keeps its votes.
    Still records make the payload smaller (their changes no longer blur the leaning ones'
    contexts). Without vote tables (v3) the bit is refused as a class count."""
    base, target = _leaning_and_not()
    v4 = codec.encode(base, target, format_version=4)
    p4 = container.unpack(v4)
    still = {e.name: bool(e.params[0] & conditional.STILL) for e in p4.entries}
    assert still == {"w": False, "cube": False, "bias": False, "dense": True}, still
    assert_bit_exact(codec.decode(base, v4), target)
    held = {k: v.clone() for k, v in base.items()}
    codec.apply_(held, v4)
    assert_bit_exact(held, target)
    for e in p4.entries:
        b, t = bits_of(base[e.name]).view(np.uint16), bits_of(target[e.name]).view(np.uint16)
        patch = conditional.decode(e, b, p4.shared)
        assert np.array_equal(patch.index, np.flatnonzero(b != t)) and np.array_equal(patch.values, t[b != t])
        assert np.array_equal(conditional.decode_target(e, b, p4.shared)[1], t.reshape(-1))
        elems = b.copy().reshape(-1)
        conditional.decode_in_place(e, elems, p4.shared)
        assert np.array_equal(elems, t.reshape(-1))
    # every record voting (the encoder's choice undone) is larger
    all_vote = conditional.ValueModel.fit_symbols(
        [conditional.analyze(bits_of(base[n]).view(np.uint16), bits_of(target[n]).view(np.uint16),
                             conditional.vote_columns(tuple(target[n].shape))).vote_symbols() for n in target],
        vote=True)
    assert conditional.ValueModel.unpack(p4.shared[conditional.SHARED_VOTE_TABLES], vote=True).keys.size > 0
    mixed = conditional.ValueModel.fit_symbols(
        [a.coded_symbols(True) for a in _settled(base, target)], vote=True)
    assert mixed.fitted_bits < all_vote.fitted_bits
    few = _settled({"w": base["w"][:2]}, {"w": target["w"][:2]})[0]  # leaning, but too few changes met a vote
    assert 0 < few.changes < conditional.STILL_MIN_VOTED and few.still
    # the bit flipped either way: never the target (a stream that no longer decodes, or a digest)
    for name in ("w", "dense"):
        forged = _with_params(v4, lambda e, name=name: (bytes([e.params[0] ^ conditional.STILL]) + e.params[1:]
                                                        if e.name == name else e.params))
        with pytest.raises(codec.DeltaError):
            codec.decode(base, forged)
    v3 = codec.encode(base, target, format_version=3)
    forged = _with_params(v3, lambda e: bytes([e.params[0] | conditional.STILL]) + e.params[1:])
    with pytest.raises(codec.DeltaError, match="still bit"):
        codec.decode(base, forged)


def _settled(base: dict, target: dict) -> list:
    out = []
    for n in target:
        a = conditional.analyze(bits_of(base[n]).view(np.uint16), bits_of(target[n]).view(np.uint16),
                                conditional.vote_columns(tuple(target[n].shape)))
        a.settle()
        out.append(a)
    return out


def test_inspect_costs_v4_values_under_their_vote_tables():
    """`inspect` with the base splits each record's bits into mask and values under the payload's
    own tables: for v4, each change's vote-table row and flipped token (a key table's row gives
    nonsense, or log2(0)); the split accounts for the whole stream, and v4's values cost less."""
    from codec.inspect import describe

    base, target = _leaning_pair()
    split = {}
    for version in (3, 4):
        rows = describe(codec.encode(base, target, format_version=version), base)["tensors"]
        for r in rows:
            parts = r["mask_bits_per_change"] + r["value_bits_per_change"]
            left = (r["bits_per_change"] - parts) * r["changed"]  # the final rANS states, a last word
            assert np.isfinite(parts) and -1e-6 <= left <= 8 * (8 * conditional.FOUR_STATES + 8), r
        split[version] = {r["name"]: r for r in rows}
    for name, r4 in split[4].items():
        assert r4["mask_bits_per_change"] == pytest.approx(split[3][name]["mask_bits_per_change"])
    w3, w4 = split[3]["w"], split[4]["w"]
    assert w4["value_bits_per_change"] < 0.8 * w3["value_bits_per_change"]


def test_vote_symbols_of_a_batch_are_those_of_each_tensor_alone():
    """`Batch.vote_symbols` (made by the scan of a v4 batch, part by part) gives each tensor the
    symbols its own analysis gives from its positions; a v3 batch's scan makes none."""
    base, target = _leaning_pair()
    names = list(target)
    method = conditional.METHOD
    with pytest.raises(ValueError, match="without columns"):
        method.analyse_batch([base[n] for n in names], [target[n] for n in names], None, version=3).vote_symbols()
    batch = method.analyse_batch([base[n] for n in names], [target[n] for n in names], None, version=4)
    votes = batch.vote_symbols()
    for i, n in enumerate(names):
        alone = conditional.analyze(bits_of(base[n]).view(np.uint16), bits_of(target[n]).view(np.uint16),
                                    conditional.vote_columns(tuple(target[n].shape)))
        assert np.array_equal(votes[batch.first[i]:batch.first[i + 1]], alone.vote_symbols()), n


def test_encoder_refuses_class_counts_that_disagree_with_the_changes():
    """The coder lays out each class's gaps from the analysis's per-class counts: counts with the right total
    but the wrong split (an internal inconsistency, never payload bytes) are refused before anything is written,
    where they used to write past the coder's buffers."""
    rng = np.random.default_rng(11)
    x = rng.normal(0, 0.05, 20_000).astype(np.float32)
    b = (x.view(np.uint32) >> 16).astype(np.uint16)
    t = b.copy()
    flip = rng.random(b.size) < np.where(np.abs(x) < 0.01, 0.5, 0.01)  # small weights change more often
    t[flip] ^= 1
    a = conditional.analyze(b, t)
    assert a.nclass > 1  # premise: counts to move between classes
    model = conditional.ValueModel.fit([a])
    conditional.encode(a, model)  # premise: the honest analysis encodes
    counts = a.class_changes().copy()
    moved = min(counts[0], 3)
    assert moved > 0
    counts[0] -= moved
    counts[1] += moved
    a._class_changes = counts  # same total, another split
    with pytest.raises(ValueError, match="per-class change counts disagree"):
        conditional.encode(a, model)
    a._class_changes = None
    a.classes = a.classes.copy()
    a.classes[0] = a.nclass  # a class past the tensor's
    a._class_changes = np.bincount(np.minimum(a.classes, a.nclass - 1), minlength=conditional.MAX_CLASSES)[: a.nclass]
    with pytest.raises(ValueError, match="past the tensor's classes"):
        conditional.encode(a, model)
