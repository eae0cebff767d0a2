"""A real TRL GRPOTrainer on a tiny random-init Llama, offline on CPU: what the TRL integration's tests and
scripts/bench_trl_callback.py train with.

Also a script: `python -m torch.distributed.run --nproc_per_node 2 tests/trl_tiny.py --origin URL ...` trains
with the model sharded by FSDP2 across the ranks (transformers' DistributedConfig: DTensor parameters), the
DeltaRelayCallback publishing, and rank 0 checking after every step that a watcher of the relayed store
holds the trainer's full weights bit for bit; it writes what it found to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

PROMPTS = ["the cat", "a dog ran", "hello", "one two", "deltas are", "weights move", "rollouts", "policy step"]


def tokenizer() -> Any:
    """A byte-level BPE with no merges (256 bytes + specials): needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_model(path: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A random-init LlamaForCausalLM in BF16 with its tokenizer, saved to `path` (what from_pretrained loads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    heads = max(4, hidden // 64)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4 if hidden < 256
                      else hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def reward_vowels(completions: list[str], **_: Any) -> list[float]:
    """A reward GRPO can move: the fraction of vowels in the completion."""
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]


def grpo(model: Any, out_dir: Path, steps: int, callbacks: list, seed: int = 0, lr: float = 1e-4,
         batch: int = 8) -> Any:
    """A GRPOTrainer with trainers.md's CPU settings (no vLLM: generation by model.generate)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out_dir), use_cpu=True, per_device_train_batch_size=batch,
                      gradient_accumulation_steps=2, num_generations=4, max_completion_length=16,
                      learning_rate=lr, lr_scheduler_type="constant", activation_checkpointing=False,
                      save_strategy="no", report_to="none", bf16=False, max_steps=steps, logging_steps=1000,
                      seed=seed, disable_tqdm=True)
    data = Dataset.from_dict({"prompt": PROMPTS * 8})
    return GRPOTrainer(model=model, reward_funcs=reward_vowels, args=args, train_dataset=data,
                       processing_class=tokenizer(), callbacks=callbacks)


def checker(cb: Any, check: Callable[[int, dict[str, torch.Tensor]], None], full: Callable[[Any], dict]) -> Any:
    """A callback that, after the publishing callback's hook, waits for its publish and calls
    check(global_step, the trainer's full weights) (`full(model)` gathers them)."""
    from transformers import TrainerCallback

    class Check(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            cb.flush()
            check(state.global_step, full(model))

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            cb.flush()
            check(state.global_step, full(model))

    return Check()


def _sharded_main() -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import relay
    from relay.fanout import Destination, Fanout
    from relay.integrations.trl import DeltaRelayCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--origin", required=True)
    ap.add_argument("--origin-options", default="null")
    ap.add_argument("--dest", required=True)
    ap.add_argument("--dest-options", default="null")
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    origin_opts, dest_opts = json.loads(a.origin_options), json.loads(a.dest_options)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(fsdp_size=2))
    rank = dist.get_rank()
    found: dict[str, Any] = {"rank": rank, "dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
                             "local_fraction": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                                                   for p in model.parameters())
                             / sum(p.numel() for p in model.parameters()), "steps": [], "layout": a.layout}
    cb = DeltaRelayCallback(a.origin, storage_options=origin_opts, layout=a.layout, snapshot_every=3)
    fan = Fanout(a.origin, [Destination("dest", a.dest, dest_opts)], source_options=origin_opts,
                 poll_interval=0.05) if rank == 0 else None
    watcher = relay.Watcher(a.dest, Path(a.out).with_suffix(".dest"), storage_options=dest_opts) if rank == 0 \
        else None

    last: dict[str, dict] = {}

    def full(m: Any) -> dict:
        return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def check(step: int, weights: dict) -> None:
        if rank != 0:
            return
        assert fan is not None and watcher is not None
        synced = fan.sync_once(timeout=60)
        head = watcher.sync(timeout=60)
        same = weights.keys() == watcher.tensors.keys() and all(
            torch.equal(weights[k].view(torch.int16), watcher.tensors[k].view(torch.int16)) for k in weights)
        changed = "w" in last and any(not torch.equal(weights[k], last["w"][k]) for k in weights)
        last["w"] = {k: v.clone() for k, v in weights.items()}
        found["steps"].append({"step": step, "relayed": bool(synced), "head": head, "bit_exact": same,
                               "changed": changed})

    trainer = grpo(model, Path(a.out).with_suffix(".trainer"), a.steps, [cb], seed=1)
    trainer.add_callback(checker(cb, check, full))
    trainer.train()
    if rank == 0:
        Path(a.out).write_text(json.dumps(found))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    _sharded_main()
