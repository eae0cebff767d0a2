"""Hot-loading a live vLLM engine: pause per step and publish-to-serving time, against vLLM's own full reload.

For each model size (a seeded Llama built from a config, BF16): start `vllm.LLM` with the worker
extension, publish --steps steps with the real Publisher to a file:// store (each step moves
--changed of the tensors), follow them with a Watcher(engine=VLLMEngine(llm)), and time
  publish-to-serving: from publish() to the engine serving the step (sync() returned),
  pause: the engine's commit (apply of the changed layers, prefix-cache reset, weight version),
against the baseline measured in the same run: vLLM's `collective_rpc("reload_weights",
kwargs={"weights_path": DEST})`, a full reload of the same step from the watcher's directory.
Medians over the steps. Needs the vllm extra (make venv-vllm); runs above ~3 GB take the big-memory
lock: `flock /tmp/deltarelay-bigmem.lock .venv-vllm/bin/python scripts/bench_engine.py --sizes tiny,300m`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (2 cores)

import torch

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (128, 256, 2, 2, 1, 512),
    "100m": (768, 2048, 8, 12, 4, 32000),
    "300m": (1024, 2816, 16, 16, 4, 32000),
    "1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B's shape: ~2.2 GB in BF16, the bigmem lock's size
}


def build(path: Path, size: str) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, i, n, heads, kv, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def step_of(state: dict[str, torch.Tensor], step: int, fraction: float) -> dict[str, torch.Tensor]:
    names = sorted(state)
    g = torch.Generator().manual_seed(step)
    count = max(1, round(fraction * len(names)))
    picked = {names[j] for j in torch.randperm(len(names), generator=g)[:count].tolist()}
    out = dict(state)
    for k in picked:
        t = state[k].float()
        out[k] = (t + 1e-3 * t.abs().mean() * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
    return out


def bench(size: str, steps: int, fraction: float, root: Path) -> dict:
    from vllm import LLM

    from relay import Publisher
    from relay.engines.vllm import VLLMEngine
    from relay.watcher import Watcher

    state = build(root / "model", size)
    params = sum(t.numel() for t in state.values())
    t0 = time.perf_counter()
    llm = LLM(model=str(root / "model"), worker_extension_cls="relay.engines.vllm.WorkerExtension",
              skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    start_s = time.perf_counter() - t0
    engine = VLLMEngine(llm)
    url = (root / "store").as_uri()
    serve, pause, full, moved = [], [], [], []
    try:
        with Publisher(url, background=False, snapshot_every=10_000) as pub, \
                Watcher(url, root / "dest", engine=engine) as w:
            pub.publish(state, 0)
            w.sync()  # the first step moves whole
            for k in range(1, steps + 1):
                state = step_of(state, k, fraction)
                t0 = time.perf_counter()
                pub.publish(state, k)
                w.sync()
                serve.append(time.perf_counter() - t0)
                st = engine.state()
                pause.append(st["last_pause_s"])
                moved.append(st["last_stage"]["tensors"] / st["last_stage"]["of_tensors"])
                t0 = time.perf_counter()  # the baseline: vLLM's full reload of the same step from DEST
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(root / "dest")})
                llm.reset_prefix_cache()
                full.append(time.perf_counter() - t0)
    finally:
        llm.llm_engine.engine_core.shutdown()
    med = statistics.median
    return {"size": size, "params_m": params / 1e6, "start_s": start_s, "serve_s": med(serve), "pause_s": med(pause),
            "full_reload_s": med(full), "moved": med(moved), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--changed", type=float, default=0.1, help="fraction of the tensors each step moves")
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-engine-{size}-") as tmp:
            rows.append(bench(size, args.steps, args.changed, Path(tmp)))
    print(f"\n{'model':>6} {'params':>8} {'start':>7} {'moved':>6} {'publish->serving':>17} {'pause':>9} "
          f"{'full reload':>12} {'pause vs full':>14}")
    for r in rows:
        ratio = r["full_reload_s"] / r["pause_s"]
        print(f"{r['size']:>6} {r['params_m']:>7.1f}M {r['start_s']:>6.1f}s {r['moved']:>6.0%} {r['serve_s']:>16.3f}s "
              f"{r['pause_s'] * 1e3:>7.1f}ms {r['full_reload_s'] * 1e3:>10.1f}ms {ratio:>13.1f}x")
    print(f"(medians of {args.steps} steps each; 'moved': tensors staged of the checkpoint's, whole layers)")


if __name__ == "__main__":
    main()
