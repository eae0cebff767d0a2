"""The codec's decoders (payloads, snapshot objects) and UndoLog in the cases an adversarial review found
uncovered (docs/RELIABILITY.md has each finding, before and after): C128 change counts, revert_copy through
row views, an empty shape whose strides overflow, a record of many tiny zstd blocks; and from a review of the
encode and round-trip paths: revert_copy with overlapping views, shapes and names the format cannot hold,
lazy conjugate views."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard

import codec
from codec import hashing, snapshot, wire



def _bits(t: torch.Tensor) -> np.ndarray:
    return codec.tensors.element_view(t).copy()


def _snapshot_object(records: list[tuple[str, str, tuple[int, ...], int, list[bytes], bytes]]) -> bytes:
    """A DRSN v4 object from hand-made records (name, dtype name, shape, block_elems, blocks, digest),
    every checksum, offset and index entry correct, so only what a record declares is hostile."""
    out = [snapshot.PREFIX.pack(snapshot.MAGIC, 4, 0)]
    entries = []
    offset = snapshot.PREFIX.size
    for name, dtype, shape, block_elems, blocks, digest in records:
        w = wire.Writer()
        snapshot._tensor_fields(w, name, codec.tensors.BY_NAME[dtype].code, shape)
        w.uvarint(block_elems)
        w.uvarint(len(blocks))
        for b in blocks:
            w.uvarint(len(b))
        w.raw(digest)
        fields = w.getvalue()
        head = fields + xxhash.xxh3_64_digest(fields)
        rec = struct.pack("<BI", snapshot.TAG_RECORD, len(head)) + head + b"".join(blocks)
        entries.append(snapshot.SnapshotEntry(name, dtype, shape, digest, offset, len(rec)))
        out.append(rec)
        offset += len(rec)
    body = snapshot._index_body(entries)
    out.append(struct.pack("<BI", snapshot.TAG_INDEX, len(body)) + body)
    out.append(snapshot.TRAILER.pack(offset, len(body), 0, xxhash.xxh3_64_digest(body), snapshot.TAIL_MAGIC))
    return b"".join(out)


# --- payloads ----------------------------------------------------------------------------------------


def test_c128_tensor_with_both_halves_of_every_item_changed_round_trips():
    """A C128 tensor's elements are two u64 per item (FORMAT.md: "C128 as two u64, so it has 2 * numel
    elements"), and the encoder writes `changes` = the number of changed u64 elements, up to 2 * numel.
    But the index parsers (container._scan_index and container._entries_checked, container.py, the
    `changes` uvarint read with limit `numel`) cap `changes` at the product of the dims. So an honest payload
    in which more than half of a C128 tensor's u64 halves changed (e.g. every item's real and imaginary part)
    is refused by every decoder ("value 128 in index exceeds its limit 64"): a trainer publishing such a step
    wedges every watcher on its last step. The limit must be numel * elements_per_item (and FORMAT.md say so),
    and this payload must decode to its target."""
    base = {"c": torch.zeros(64, dtype=torch.complex128)}
    target = {"c": base["c"] + (1 + 1j)}
    payload = codec.encode(base, target)
    out = codec.decode(base, payload)
    assert np.array_equal(_bits(out["c"]), _bits(target["c"]))
    live = {"c": base["c"].clone()}
    codec.apply_(live, payload)
    assert np.array_equal(_bits(live["c"]), _bits(target["c"]))


# --- UndoLog ------------------------------------------------------------------------------------------


def test_revert_copy_of_a_tensor_written_through_row_views_restores_it_exactly():
    """The watcher applies a sharded step's row-range parts to views of its held tensors
    (relay/shards.part_targets: tensors[name][start:stop], under the tensor's own name) with one UndoLog,
    and rebuilds the module's previous step with `undo.revert_copy(name, full_copy)` when a hot-load copy
    fails (relay/watcher.py `_module_previous`). UndoLog keeps one alias per name (`_aliases[name]`, the last
    view logged, codec/api.py `_extend`), and revert_copy (codec/api.py, `UndoLog.revert_copy`) applies only
    the writes made through that alias, with positions relative to that view: the writes through the other
    row views are skipped, and the last view's old elements land in the first rows of the full tensor. Here
    two parts (rows 0:2 and 2:4) are applied to a (4, 64) tensor: revert_copy leaves rows 0-1's changes in
    place, writes rows 2-3's old elements into rows 0-1 and never restores rows 2-3, so the module would be
    "restored" to bits of neither step. revert_copy must give the tensor's exact bits before the first call
    (translating each write's positions by its view's offset in the named tensor), or refuse when a name was
    logged through more than one view."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 64, generator=g) * 0.02).to(torch.bfloat16)
    target = base.clone()
    target[0, 3] += 0.5
    target[1, 7] -= 0.25
    target[2, 5] += 0.125
    target[3, 60] -= 1.0
    first = codec.encode({"w": base[0:2]}, {"w": target[0:2]})
    second = codec.encode({"w": base[2:4]}, {"w": target[2:4]})
    live = base.clone()
    log = codec.UndoLog()
    codec.apply_({"w": live[0:2]}, first, undo=log)
    codec.apply_({"w": live[2:4]}, second, undo=log)
    assert np.array_equal(_bits(live), _bits(target))
    copy = live.clone()
    with pytest.raises(ValueError, match="views"):  # where each view lies is not known without the live tensor
        log.revert_copy("w", copy)
    log.revert_copy("w", copy, source=live)
    wrong = np.flatnonzero(_bits(copy) != _bits(base))
    assert wrong.size == 0, f"revert_copy left {wrong.size} elements that are not the base's: {wrong.tolist()}"


# --- snapshot objects ---------------------------------------------------------------------------------


def test_empty_record_whose_shape_torch_cannot_make_is_a_snapshot_error():
    """Both head parsers accept a record of shape (0, 2**48, 2**48): its product is 0 (<= 2**48, FORMAT.md),
    so snapshot_rans._name_dtype_shape and snapshot._shape let it through, the record has no blocks and its
    digest verifies. `_decode_record` (codec/snapshot.py) then makes the tensor with
    tensors.tensor_from_elements -> torch.empty((0, 2**48, 2**48)), which raises RuntimeError ("Stride
    calculation overflowed"): a 100-byte forged object escapes decode_snapshot (walking and seeking alike) as
    a RuntimeError instead of a SnapshotError naming the object and tensor, so callers that catch DeltaError
    (relay/checkpoint.py) do not blame the object. A shape whose strides overflow int64 (any dim product past
    2**63 ignoring zeros, or simply each dim and the product of the non-zero dims <= 2**48) must be refused
    when the head is parsed."""
    shape = (0, 1 << 48, 1 << 48)
    digest = hashing.digest_elements("BF16", shape, np.zeros(0, np.uint16))
    obj = _snapshot_object([("t", "BF16", shape, 1, [], digest)])
    for only in (None, {"t"}):
        try:
            got = dict(codec.decode_snapshot(obj, only=only, where="forged"))
        except codec.SnapshotError as exc:
            assert "forged" in str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - the defect: anything else escapes
            raise AssertionError(f"only={only}: {type(exc).__name__} escaped decode_snapshot: {exc}") from None
        raise AssertionError(f"only={only}: decoded {got!r}")


def test_record_of_many_tiny_zstd_blocks_is_refused_and_legal_blocks_cost_linear_time():
    """A record may declare any block_elems >= 1, and every zstd-coded block sends the record's kernel
    (snapshot_rans.decode_record) back to Python for one zstandard call, after which the kernel was called
    again and first re-summed the sizes of every block before it: ~30 us of Python per block plus O(n**2). A
    bucket writer's file of 2**18 zstd blocks of eight F32 zeros (5 MB, an 8 MiB tensor) took ~13 s, and a
    300 MB one would have held a reader for hours. Now a zstd-coded block other than a record's last must
    cover MIN_ZSTD_BLOCK_BYTES of tensor (FORMAT.md; the encoder's blocks are 1 MiB), and the kernel resumes
    at the offset it stopped at: the tiny-block file is refused at once, naming the record; one of legal
    1 KiB zstd blocks decodes exactly."""
    n, per = 1 << 18, 8
    frame = b"\x01" + zstandard.ZstdCompressor(level=1).compress(bytes(4 * per))
    digest = hashing.digest_elements("F32", (n * per,), np.zeros(n * per, np.uint32))
    obj = _snapshot_object([("t", "F32", (n * per,), per, [frame] * n, digest)])
    with pytest.raises(codec.SnapshotError, match="zstd-coded, but covers 32 bytes"):
        dict(codec.decode_snapshot(obj, max_bytes=4 * n * per, where="forged"))
    n, per = 1 << 12, snapshot.MIN_ZSTD_BLOCK_BYTES // 4  # legal: 1 KiB of F32 per zstd block
    g = np.random.default_rng(3)
    blocks = [g.integers(0, 4, per, dtype=np.uint32) for _ in range(n)]
    frames = [b"\x01" + zstandard.ZstdCompressor(level=1).compress(b.tobytes()) for b in blocks]
    whole = np.concatenate(blocks)
    obj = _snapshot_object([("t", "F32", (n * per,), per, frames,
                             hashing.digest_elements("F32", (n * per,), whole))])
    out = dict(codec.decode_snapshot(obj, max_bytes=4 * n * per))
    assert np.array_equal(out["t"].view(torch.int32).numpy().view(np.uint32), whole)


# --- from the review of the encode and round-trip paths -------------------------------------------------


def _bits16(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy().copy()


def _views(x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """A (4, 8) tensor under the name "buf" and its row views "row0" (rows 0-1) and "row1" (rows 2-3)."""
    whole = {"buf": x, "row0": x[:2], "row1": x[2:]}
    return {n: whole[n] for n in names}


def _applied_with_views(names: list[str]):
    """A state of one buffer logged under three names (whole and two row views), one payload applied
    with an UndoLog that changes element 0 and element 31 (the last). Returns (base, live, log)."""
    base = torch.arange(32, dtype=torch.float32).to(torch.bfloat16).reshape(4, 8)
    target = base.clone()
    target[0, 0] = 100
    target[3, 7] = 200
    payload = codec.encode(_views(base, names), _views(target, names))
    held = base.clone()
    live = _views(held, names)
    log = codec.UndoLog()
    codec.apply_(live, payload, undo=log)
    assert np.array_equal(_bits16(held), _bits16(target))
    return base, live, log


def test_revert_copy_with_source_never_writes_past_the_copy():
    """UndoLog.revert_copy(name, tensor, source=) (codec/api.py, the `source is not None` loop of
    `revert_copy`) undoes every logged write whose view *starts* inside `source` (`start <=
    t.data_ptr() < end`) at `w.index + offset` with patching.put, which checks no bound. A write
    logged through a view that starts inside `source` but is longer (here the whole buffer "buf",
    which starts where its row view "row0" does) puts its positions 16..31 into a 16-element copy:
    a heap write past the end of `tensor` (here caught in a guard region behind it; with a
    free-standing copy, as relay/watcher.py `_module_previous` makes, it corrupts the heap: a
    segfault in the review's scan). Expected: only the positions that fall inside `source` are
    written (translate each write, keep 0 <= index < tensor's elements), nothing outside `tensor`."""
    base, live, log = _applied_with_views(["buf", "row0", "row1"])
    guard = torch.full((48,), 7.0, dtype=torch.bfloat16)
    copy = guard[:16].view(2, 8)  # contiguous, as revert_copy requires; 32 guard elements behind it
    copy.copy_(live["row0"])
    log.revert_copy("row0", copy, source=live["row0"])
    touched = np.flatnonzero(_bits16(guard[16:]) != _bits16(torch.tensor(7.0, dtype=torch.bfloat16))[0])
    assert touched.size == 0, f"revert_copy wrote {touched.size} elements past the end of its tensor: {touched + 16}"
    assert np.array_equal(_bits16(copy), _bits16(base[:2]))


def test_revert_copy_with_source_undoes_writes_through_a_view_that_starts_before_it():
    """The other half of the same test (codec/api.py `revert_copy`, `not start <= t.data_ptr() < end`):
    a logged write through a view that starts *before* `source` but covers part of it (the whole buffer
    "buf" covering its row view "row1") is skipped entirely, though its docstring promises "every logged
    write into its memory is undone at its place in it, whatever view it went through". "buf" is written
    first, so "row1"'s own log holds the target's bits as its "old" elements: the copy of "row1" keeps
    the target's element 31 (200) instead of the base's (31). Expected: the copy holds row1's exact
    bits before the call (each overlapping write translated by its view's offset, negative ones too,
    and clipped to the source's range)."""
    base, live, log = _applied_with_views(["buf", "row0", "row1"])
    copy = live["row1"].clone()
    log.revert_copy("row1", copy, source=live["row1"])
    wrong = np.flatnonzero(_bits16(copy) != _bits16(base[2:]))
    assert wrong.size == 0, f"revert_copy left {wrong.size} elements of row1 at the newer step: {wrong.tolist()}"


def _refused_at_encode_or_round_trips(base, target, **kw):
    try:
        payload = codec.encode(base, target, **kw)
    except (ValueError, codec.CheckpointMismatchError):
        return  # refused at encode: fine
    codec.decode(base, payload)  # a payload the encoder wrote must decode (DeltaError here is the defect)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("case", ["33-dims", "empty-with-a-dim-over-2**48", "name-over-65536-bytes"])
def test_encoder_never_writes_a_payload_every_decoder_refuses(case, compiled):
    """codec.encode (codec/api.py `encode` / `_check_structure`, and container.pack, which checks only
    the index size: "never write what a decoder refuses") writes whatever torch holds into the index,
    but the decoders refuse ndim > 32, a dim > 2**48 and a name over 65536 bytes (container.py
    MAX_NDIM, MAX_NUMEL, MAX_NAME_BYTES; FORMAT.md limits). A tensor of 33 dims of 1, an empty
    (0, 2**49) tensor, or a name of 70000 bytes is encoded without complaint and every decode/apply_
    of the payload raises DeltaError ("value 33 in index exceeds its limit 32"): a publisher would
    commit a step no watcher can reach. Expected: encode refuses such a checkpoint (ValueError or
    CheckpointMismatchError naming the tensor and the limit), as encode_snapshot already does for
    long names."""
    if case == "33-dims":
        b = torch.zeros((1,) * 33)
        t = b.clone()
        t.view(-1)[0] = 1
        base, target = {"w": b}, {"w": t}
    elif case == "empty-with-a-dim-over-2**48":
        b = torch.empty((0, 2 ** 49))
        base, target = {"w": b}, {"w": b.clone()}
    else:
        name = "n" * 70000
        base, target = {name: torch.zeros(2)}, {name: torch.ones(2)}
    _refused_at_encode_or_round_trips(base, target, compiled=compiled)


@pytest.mark.parametrize("case", ["33-dims", "empty-with-a-dim-over-2**48"])
def test_snapshot_encoder_never_writes_a_record_its_decoder_refuses(case):
    """codec.encode_snapshot (codec/snapshot.py `_encode_tensor`/`_tensor_fields`) checks names against
    MAX_NAME but writes any rank and dims, while decode_snapshot refuses ndim > 32 and a dim > 2**48
    ("value 33 in record head exceeds its limit 32"): the snapshot is written, uploaded and unreadable.
    Expected: encode_snapshot raises ValueError for such a tensor before writing its record."""
    t = torch.zeros((1,) * 33) if case == "33-dims" else torch.empty((0, 2 ** 49))
    try:
        data = b"".join(codec.encode_snapshot([("w", t)]))
    except ValueError:
        return
    dict(codec.decode_snapshot(data))


def test_lazy_conjugate_views_are_encoded_or_refused_cleanly():
    """A complex tensor's `.conj()` is a lazy view (its conj bit set, the memory unchanged):
    codec/tensors.py `element_view` calls `t.view(int dtype)` on it, which torch refuses,
    so encode, encode_snapshot, decode and apply_ raise a bare RuntimeError ("torch.Tensor.view is not
    supported for conjugate view tensors ...") on a tensor of a supported dtype and shape, neither a
    CheckpointMismatchError nor a DeltaError. Expected: element_view resolves the view first
    (`t.resolve_conj().resolve_neg()`, a copy, as for strided tensors) and the tensor round-trips its
    materialised bits; or the codec refuses it with CheckpointMismatchError naming the tensor.
    (A contiguous negative-bit float view, torch._neg_view, fails the same way; a strided one,
    `.conj().imag`, takes element_view's copy path and round-trips.)"""
    g = torch.Generator().manual_seed(1)
    b = torch.randn(16, dtype=torch.complex64, generator=g)
    lazy = (b * 2).conj()
    assert lazy.is_conj() and lazy.is_contiguous()
    try:
        payload = codec.encode({"w": b}, {"w": lazy})
    except codec.CheckpointMismatchError:
        return
    out = codec.decode({"w": b}, payload)["w"]
    assert torch.equal(out.view(torch.uint8), lazy.resolve_conj().view(torch.uint8))
