"""relay.lab.corpus (scripts/make_corpus.py wraps it) in tiny mode: valid consecutive BF16 (or F16) snapshots
that look like RL steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from relay.lab import corpus as mc


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "fp32"
    paths = mc.make_corpus(out, regime="fp32-lr1e-6", steps=3, tiny=True, seed=1)
    return out, paths


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.int16).numpy().view(np.uint16)


def test_tiny_corpus_writes_consecutive_bf16_snapshots(tiny_corpus):
    out, paths = tiny_corpus
    assert [p.name for p in paths] == [f"step_{i:04d}.safetensors" for i in range(4)]
    snaps = [load_file(str(p)) for p in paths]
    first = snaps[0]
    assert first["position_ids"].dtype == torch.int64  # non-float tensors stay as they are
    assert all(v.dtype == torch.bfloat16 for k, v in first.items() if k != "position_ids")
    for snap in snaps[1:]:
        assert ({k: (v.dtype, tuple(v.shape)) for k, v in snap.items()}
                == {k: (v.dtype, tuple(v.shape)) for k, v in first.items()})
        assert torch.equal(snap["position_ids"], first["position_ids"])


def test_corpus_json_records_settings_and_rl_like_change_statistics(tiny_corpus):
    out, paths = tiny_corpus
    meta = json.loads((out / "corpus.json").read_text())
    assert ((meta["regime"], meta["lr"], meta["weight_decay"], meta["master"], meta["seed"])
            == ("fp32-lr1e-6", 1e-6, 0.0, "fp32", 1))
    assert meta["files"] == [p.name for p in paths] and len(meta["pairs"]) == 3
    snaps = [load_file(str(p)) for p in paths]
    for pair, base, target in zip(meta["pairs"], snaps, snaps[1:]):
        changed = sum(int(np.count_nonzero(_bits(base[k]) != _bits(v)))
                      for k, v in target.items() if v.dtype == torch.bfloat16)
        assert pair["changed"] == changed  # the recorded statistics describe the files
        assert 0.002 < pair["changed_fraction"] < 0.05  # about 1-2% of elements move per step
        assert pair["mantissa_only_share"] > 0.9
        assert abs(pair["mantissa_only_share"] + pair["exponent_share"] + pair["sign_share"] - 1) < 1e-9


def test_pure_bf16_parameters_change_between_snapshots(tmp_path):
    # With BF16 parameters the snapshot cast is a no-op; a snapshot must still be a copy.
    mc.make_corpus(tmp_path, regime="bf16-lr3e-6", steps=1, warmup=1, tiny=True)
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert meta["master"] == "bf16"
    assert meta["pairs"][0]["changed"] > 0
    a, b = (load_file(str(tmp_path / f"step_{i:04d}.safetensors")) for i in range(2))
    assert any(not torch.equal(_bits_t(a[k]), _bits_t(b[k])) for k in a if a[k].dtype == torch.bfloat16)



def test_f16_snapshots_of_the_same_training_change_more_elements(tmp_path):
    # The same seed and updates, snapshotted in F16: three more mantissa bits make smaller updates
    # visible, so more elements change than in the BF16 corpus, and the statistics describe F16 bits.
    for name, regime in (("bf16", "fp32-lr1e-6"), ("f16", "fp32-lr1e-6-f16")):
        mc.make_corpus(tmp_path / name, regime=regime, steps=1, warmup=1, tiny=True, seed=3)
    meta = {n: json.loads((tmp_path / n / "corpus.json").read_text()) for n in ("bf16", "f16")}
    assert meta["f16"]["snapshot"] == "f16" and meta["bf16"]["snapshot"] == "bf16"
    a, b = (load_file(str(tmp_path / "f16" / f"step_{i:04d}.safetensors")) for i in range(2))
    assert all(v.dtype == torch.float16 for k, v in a.items() if k != "position_ids")
    changed = sum(int(np.count_nonzero(_bits(a[k]) != _bits(v))) for k, v in b.items() if v.dtype == torch.float16)
    pair = meta["f16"]["pairs"][0]
    assert pair["changed"] == changed and pair["elements16"] == meta["bf16"]["pairs"][0]["elements16"]
    assert changed > 2 * meta["bf16"]["pairs"][0]["changed"]
    assert abs(pair["mantissa_only_share"] + pair["exponent_share"] + pair["sign_share"] - 1) < 1e-9
    with pytest.raises(ValueError, match="snapshot must be"):
        mc.make_corpus(tmp_path / "x", snapshot="fp8", tiny=True)

def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_same_seed_is_deterministic_and_overrides_apply(tmp_path):
    for name in ("a", "b"):
        mc.make_corpus(tmp_path / name, steps=1, warmup=1, tiny=True, lr=2e-6, weight_decay=0.1, seed=7)
    a, b = (load_file(str(tmp_path / n / "step_0001.safetensors")) for n in ("a", "b"))
    assert all(torch.equal(a[k].view(torch.int16) if a[k].is_floating_point() else a[k],
                           b[k].view(torch.int16) if b[k].is_floating_point() else b[k]) for k in a)
    meta = json.loads((tmp_path / "a" / "corpus.json").read_text())
    assert (meta["lr"], meta["weight_decay"], meta["master"]) == (2e-6, 0.1, "fp32")


def test_refuses_bad_settings_and_occupied_directories(tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match="unknown regime"):
        mc.make_corpus(tmp_path / "x", regime="fp64-lr1", tiny=True)
    with pytest.raises(ValueError, match="master"):
        mc.make_corpus(tmp_path / "y", master="fp8", tiny=True)
    with pytest.raises(FileExistsError, match="already holds"):
        mc.make_corpus(tiny_corpus[0], steps=1, tiny=True)


def test_script_command_line_and_overwrite(tmp_path, capsys):
    out = tmp_path / "c"
    assert mc.main(["--tiny", "--steps", "2", "--warmup", "0", "--batch", "2", "--seq-len", "8",
                    "--out", str(out)]) == 0
    assert "wrote 3 snapshots" in capsys.readouterr().out
    meta = json.loads((out / "corpus.json").read_text())
    assert (meta["batch"], meta["seq_len"], meta["warmup"], meta["tiny"]) == (2, 8, 0, True)
    # regenerating replaces the whole corpus: no snapshot of the older, longer run is left behind
    assert mc.main(["--tiny", "--steps", "1", "--warmup", "0", "--batch", "2", "--seq-len", "8",
                    "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("step_*")) == ["step_0000.safetensors", "step_0001.safetensors"]
    assert json.loads((out / "corpus.json").read_text())["steps"] == 1


def _load(directory, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(directory / f"step_{step:04d}.safetensors"))


def _same_floats(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(_bits_t(a[k]), _bits_t(b[k])) for k in a if a[k].is_floating_point())


def _rows_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((_bits_t(a) != _bits_t(b)).any(1).sum())


def test_stride_snapshots_every_kth_step_of_the_same_run(tmp_path):
    # fp32-lr1e-6-4step's pair t -> t+1 is steps t*4 -> t*4+4 of the fp32-lr1e-6 run with the same seed
    mc.make_corpus(tmp_path / "one", regime="fp32-lr1e-6", steps=4, warmup=1, tiny=True, seed=3)
    mc.make_corpus(tmp_path / "four", regime="fp32-lr1e-6-4step", steps=1, warmup=1, tiny=True, seed=3)
    one, four = _load(tmp_path / "one", 4), _load(tmp_path / "four", 1)
    assert _same_floats(one, four)
    meta = json.loads((tmp_path / "four" / "corpus.json").read_text())
    assert meta["stride"] == 4 and meta["steps"] == 1
    one_step = json.loads((tmp_path / "one" / "corpus.json").read_text())["pairs"][-1]["changed"]
    assert meta["pairs"][0]["changed"] > one_step  # four steps move more elements than one


def test_untied_head_with_a_sub_vocabulary_leaves_most_embedding_rows_unchanged(tmp_path):
    mc.make_corpus(tmp_path, regime="fp32-lr1e-6-untied-subvocab", steps=2, warmup=1, tiny=True)
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert (meta["head"], meta["input_vocab"]) == ("untied", round(0.05 * 512))
    a, b = _load(tmp_path, 0), _load(tmp_path, 2)
    assert "lm_head.weight" in a and a["lm_head.weight"].shape == a["word_embeddings.weight"].shape
    # only rows of input tokens move; the head's softmax gradient reaches rows of every token
    assert 0 < _rows_changed(a["word_embeddings.weight"], b["word_embeddings.weight"]) <= meta["input_vocab"]
    assert _rows_changed(a["lm_head.weight"], b["lm_head.weight"]) > meta["input_vocab"]


def test_grpo_regime_records_its_optimiser_and_loss_and_is_deterministic(tmp_path):
    for name in ("a", "b"):
        mc.make_corpus(tmp_path / name, regime="fp32-lr1e-6-grpo-b95-wd", steps=1, warmup=1, tiny=True, seed=5)
    meta = json.loads((tmp_path / "a" / "corpus.json").read_text())
    assert (meta["loss"], meta["betas"], meta["weight_decay"]) == ("grpo", [0.9, 0.95], 0.1)
    assert meta["pairs"][0]["changed"] > 0
    a, b = _load(tmp_path / "a", 1), _load(tmp_path / "b", 1)
    assert _same_floats(a, b)
    model = mc.TinyPolicy()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="multiple of"):
        mc.policy_gradient_step(model, opt, torch.Generator(), 512, 3, 8, loss="grpo")
    with pytest.raises(ValueError, match="loss must be"):
        mc.policy_gradient_step(model, opt, torch.Generator(), 512, 4, 8, loss="ppo")
