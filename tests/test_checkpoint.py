"""relay/checkpoint.py: single files and Hugging Face shard directories, layout kept, atomic writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import save_file

from codec_cases import OTHER_DTYPES, assert_bit_exact, edge_pair, model_pair
from relay import checkpoint
from relay.checkpoint import INDEX_NAME, SINGLE_NAME, Layout


def _leftovers(directory) -> list[str]:
    """Temporary files or directories a writer forgot (its temp names start with a dot)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_single_file_round_trip_every_dtype(tmp_path):
    _, target = edge_pair()
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(target, path, Layout(metadata={"step": "7"}))
    loaded, layout = checkpoint.load(path)
    assert_bit_exact(loaded, target)
    assert not layout.sharded and layout.metadata == {"step": "7"}
    assert _leftovers(tmp_path) == []


def test_save_without_layout_writes_one_file(tmp_path):
    base, _ = model_pair(n_tensors=2)
    path = tmp_path / "deep" / "dir" / "x.safetensors"
    checkpoint.save(base, path)
    assert path.is_file()
    assert_bit_exact(checkpoint.load(path)[0], base)


def test_shard_plan_respects_the_limit_and_keeps_order():
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate([100, 300, 50, 2000, 10, 10])}
    plan = checkpoint.shard_plan(tensors, max_shard_bytes=800)
    shards = sorted(set(plan.values()))
    assert list(plan) == list(tensors)
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    for shard in shards:
        members = [k for k, s in plan.items() if s == shard]
        size = sum(tensors[k].numel() * 2 for k in members)
        assert size <= 800 or len(members) == 1  # a lone larger tensor gets its own shard
    assert plan["t3"] not in {plan[k] for k in plan if k != "t3"}
    order = [shards.index(plan[k]) for k in tensors]
    assert order == sorted(order)


def test_sharded_directory_round_trip_keeps_layout(tmp_path):
    _, target = edge_pair()
    plan = checkpoint.shard_plan(target, max_shard_bytes=4096)
    assert len(set(plan.values())) >= 3
    out = tmp_path / "model"
    checkpoint.save(target, out, Layout(True, plan, {"format": "pt"}))
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["weight_map"] == plan
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in target.values())
    assert sorted(p.name for p in out.iterdir()) == sorted({*plan.values(), INDEX_NAME})

    loaded, layout = checkpoint.load(out)
    assert_bit_exact(loaded, target)
    assert layout.sharded and layout.weight_map == plan and layout.metadata == {"format": "pt"}

    again = tmp_path / "copy"  # what decode does: write the result in the base's layout
    checkpoint.save(loaded, again, layout)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in out.iterdir())
    assert_bit_exact(checkpoint.load(again)[0], target)
    assert _leftovers(tmp_path) == []


def test_layout_for_new_tensors_falls_back_to_a_plan(tmp_path):
    base, _ = model_pair(n_tensors=3)
    layout = Layout(True, {"layers.0.weight": "a.safetensors"})
    checkpoint.save(base, tmp_path / "m", layout)
    loaded, got = checkpoint.load(tmp_path / "m")
    assert_bit_exact(loaded, base)
    assert set(got.weight_map) == set(base)


def test_directory_holding_model_safetensors(tmp_path):
    base, _ = model_pair(n_tensors=2)
    save_file(base, str(tmp_path / SINGLE_NAME))
    loaded, layout = checkpoint.load(tmp_path)
    assert_bit_exact(loaded, base)
    assert not layout.sharded


def test_directory_of_unindexed_shards(tmp_path):
    base, _ = model_pair(n_tensors=4)
    names = list(base)
    save_file({k: base[k] for k in names[:2]}, str(tmp_path / "part-a.safetensors"))
    save_file({k: base[k] for k in names[2:]}, str(tmp_path / "part-b.safetensors"))
    loaded, layout = checkpoint.load(tmp_path)
    assert_bit_exact(loaded, base)
    assert layout.sharded and layout.weight_map == {**{k: "part-a.safetensors" for k in names[:2]},
                                                    **{k: "part-b.safetensors" for k in names[2:]}}


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        checkpoint.load(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        checkpoint.load(tmp_path / "empty")


def test_index_naming_a_tensor_no_shard_holds(tmp_path):
    base, _ = model_pair(n_tensors=2)
    checkpoint.save(base, tmp_path / "m", Layout(True, checkpoint.shard_plan(base, 1 << 20)))
    index = json.loads((tmp_path / "m" / INDEX_NAME).read_text())
    index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
    (tmp_path / "m" / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="ghost.weight"):
        checkpoint.load(tmp_path / "m")


def test_overwrite_is_atomic_and_clean(tmp_path):
    first, second = model_pair(n_tensors=3, seed=1)
    path = tmp_path / "c.safetensors"
    checkpoint.save(first, path)
    checkpoint.save(second, path)
    assert_bit_exact(checkpoint.load(path)[0], second)
    shard_dir = tmp_path / "sharded"
    plan = checkpoint.shard_plan(first, 10_000)
    checkpoint.save(first, shard_dir, Layout(True, plan))
    inode = os.stat(shard_dir).st_ino
    checkpoint.save(second, shard_dir, Layout(True, plan))
    assert os.stat(shard_dir).st_ino != inode  # replaced by rename, not rewritten in place
    assert_bit_exact(checkpoint.load(shard_dir)[0], second)
    assert _leftovers(tmp_path) == []


def test_shard_directory_replaces_a_single_file(tmp_path):
    first, second = model_pair(n_tensors=3, seed=2)
    path = tmp_path / "ckpt"
    checkpoint.save(first, path)
    assert path.is_file()
    checkpoint.save(second, path, Layout(True, checkpoint.shard_plan(second, 10_000)))
    assert path.is_dir()
    assert_bit_exact(checkpoint.load(path)[0], second)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("sharded", [False, True])
def test_failed_write_leaves_the_old_checkpoint_and_no_temp(tmp_path, sharded):
    good, _ = model_pair(n_tensors=2)
    path = tmp_path / ("m" if sharded else "m.safetensors")
    layout = Layout(True, checkpoint.shard_plan(good, 1 << 20)) if sharded else Layout()
    checkpoint.save(good, path, layout)
    bad = dict(good, broken="not a tensor")
    with pytest.raises(Exception):  # noqa: B017 - whatever save raises: the old checkpoint must survive
        checkpoint.save(bad, path, layout)
    assert_bit_exact(checkpoint.load(path)[0], good)
    assert _leftovers(tmp_path) == []


def test_every_other_dtype_survives_a_shard_directory(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {str(dt): torch.from_numpy(rng.integers(0, 2, size=64, dtype=np.uint8)).to(dt) for dt in OTHER_DTYPES}
    checkpoint.save(tensors, tmp_path / "d", Layout(True, checkpoint.shard_plan(tensors, 128)))
    assert_bit_exact(checkpoint.load(tmp_path / "d")[0], tensors)


@pytest.mark.parametrize("sharded", [False, True])
def test_tied_weights_from_a_live_state_dict(tmp_path, sharded):
    """A module whose LM head shares the embedding's storage (and a fused tensor's views) saves:
    each name is written with its own bytes and loads back bit-exactly."""
    embed = torch.nn.Embedding(12, 8).to(torch.bfloat16)
    fused = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {"embed.weight": embed.weight, "head.weight": embed.weight, "q": fused[:3], "k": fused[3:]}
    want = {k: v.detach().clone() for k, v in state.items()}
    layout = Layout(True, checkpoint.shard_plan(want, 200)) if sharded else Layout()
    path = tmp_path / ("m" if sharded else "m.safetensors")
    checkpoint.save(state, path, layout)
    assert_bit_exact(checkpoint.load(path)[0], want)
    assert _leftovers(tmp_path) == []


# --- the strict reader the watcher loads snapshots and DEST with (no mmap) -----------------------------------

def _st_file(tmp_path, header: dict, data: bytes, name: str = "x.safetensors", raw_len: int | None = None):
    import json as _json

    raw = _json.dumps(header).encode()
    p = tmp_path / name
    p.write_bytes((raw_len if raw_len is not None else len(raw)).to_bytes(8, "little") + raw + data)
    return p


def test_read_file_into_matches_safetensors_for_every_dtype(tmp_path):
    from codec_cases import edge_pair
    from safetensors.torch import save_file as st_save_file

    base, _ = edge_pair(seed=2)
    st_save_file(base, str(tmp_path / "e.safetensors"), metadata={"step": "4"})
    got, meta = checkpoint.read_file_into(tmp_path / "e.safetensors")
    assert meta == {"step": "4"}
    assert_bit_exact(got, base)


@pytest.mark.parametrize("case", ["unknown-dtype", "overlap", "gap", "past-end", "short-span", "header-too-big",
                                  "not-json", "duplicate", "negative-shape", "trailing-bytes", "truncated"])
def test_read_file_into_refuses_malformed_headers(tmp_path, case):
    t = {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}
    u = {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]}
    header, data, raw_len = {"a": t, "b": u}, bytes(16), None
    if case == "unknown-dtype":
        header["a"] = {**t, "dtype": "F4"}
    elif case == "overlap":
        header["b"] = {**u, "data_offsets": [4, 12]}
    elif case == "gap":
        header["b"] = {**u, "data_offsets": [10, 18]}
        data = bytes(18)
    elif case == "past-end":
        header["b"] = {**u, "data_offsets": [8, 24], "shape": [8]}
    elif case == "short-span":
        header["a"] = {**t, "data_offsets": [0, 6]}
    elif case == "header-too-big":
        raw_len = checkpoint.MAX_HEADER_BYTES + 1
    elif case == "negative-shape":
        header["a"] = {**t, "shape": [-4]}
    elif case == "trailing-bytes":
        data = bytes(20)
    if case == "not-json":
        p = tmp_path / "x.safetensors"
        p.write_bytes((5).to_bytes(8, "little") + b"{nope" + bytes(16))
    elif case == "duplicate":
        raw = b'{"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}, ' \
              b'"a": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]}}'
        p = tmp_path / "x.safetensors"
        p.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(16))
    elif case == "truncated":
        p = _st_file(tmp_path, header, data)
        p.write_bytes(p.read_bytes()[:-3])
    else:
        p = _st_file(tmp_path, header, data, raw_len=raw_len)
    with pytest.raises(checkpoint.SafetensorsError, match="x.safetensors"):
        checkpoint.read_file_into(p)


def test_streamed_writer_round_trips(tmp_path):
    from codec_cases import edge_pair
    from safetensors.torch import save_file as st_save_file

    base, _ = edge_pair(seed=3)
    st_save_file(base, str(tmp_path / "src.safetensors"))
    with checkpoint.SafetensorsFile(tmp_path / "src.safetensors") as src, \
            checkpoint.StreamedWriter(tmp_path / "out.safetensors", src.spans, {"step": "9"}) as out:
        for s in src.spans:
            out.write(src.read(s))
    got, meta = checkpoint.read_file_into(tmp_path / "out.safetensors")
    assert meta == {"step": "9"}
    assert_bit_exact(got, base)
    assert_bit_exact(checkpoint.load(tmp_path / "out.safetensors")[0], base)  # safetensors reads it too


# --- snapshot files in either format (relay.checkpoint.read_snapshot_file / spool_compressed_snapshot) ---

def test_snapshot_files_of_either_format_read_the_same(tmp_path):
    from relay.checkpoint import (SafetensorsError, read_snapshot_file, snapshot_file_format,
                                  spool_compressed_snapshot)

    g = torch.Generator().manual_seed(7)
    tensors = {"w": (torch.randn(300, 70, generator=g) * 0.02).to(torch.bfloat16),
               "b": torch.randn(70, generator=g), "n": torch.arange(5)}
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))
    with spool_compressed_snapshot(tensors, tmp_path) as spooled:
        data = b"".join(spooled.chunks(1000))
        assert len(data) == spooled.size and xxhash.xxh3_128_hexdigest(data) == spooled.xxh3
        assert spooled.size < 0.75 * sum(t.numel() * t.element_size() for t in tensors.values())
        packed = tmp_path / "packed.drsn"
        packed.write_bytes(data)
    assert not spooled.path.exists()
    assert (snapshot_file_format(plain), snapshot_file_format(packed)) == ("safetensors", "compressed")
    for path in (plain, packed):
        got, _ = read_snapshot_file(path, "snap")
        assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
        only, _ = read_snapshot_file(path, "snap", only={"b"})
        assert list(only) == ["b"] and torch.equal(only["b"], tensors["b"])
    broken = tmp_path / "broken.drsn"
    broken.write_bytes(data[:-40])
    with pytest.raises(SafetensorsError, match="snapshots/3/model.drsn: trailer"):
        read_snapshot_file(broken, "snapshots/3/model.drsn", only={"w"})
    with pytest.raises(SafetensorsError, match="snapshots/3/model.drsn"):
        read_snapshot_file(broken, "snapshots/3/model.drsn")
