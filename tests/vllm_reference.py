"""Reference outputs for tests/test_engine_vllm.py: a fresh vLLM engine per checkpoint directory.

Run as `python tests/vllm_reference.py OUT.json DIR...`: for each DIR in turn a new `vllm.LLM` is
started from that checkpoint (never one engine reloaded), the fixed prompts are generated greedily,
the weights it computes with are hashed (tests/vllm_faults.py, the test extension, idle until asked),
and the engine is shut down; OUT.json gets {DIR: {"outputs": ..., "digest": ..., "start_s": ...}}. The helpers are
shared with the test so both sides build engines and read outputs the same way.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

PROMPTS = [[1, 2, 3, 4, 5], [100, 7, 42], [300, 301, 302, 303, 304, 305, 306], [9]]
MAX_TOKENS = 6
ENGINE_ARGS: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 64,
                               "enforce_eager": True, "seed": 0, "kv_cache_memory_bytes": 32 << 20,
                               "max_num_seqs": 8}


def generate(llm: Any) -> list[dict]:
    """Greedy tokens and their logprobs (exact floats) for PROMPTS."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                       "weight_versions": sorted({v.version for v in c.weight_versions or ()})})
    return result


def main(out: str, dirs: list[str]) -> None:
    from vllm import LLM

    results = {}
    for d in dirs:
        t0 = time.perf_counter()
        llm = LLM(model=d, worker_extension_cls="vllm_faults.FaultyExtension", **ENGINE_ARGS)
        start = time.perf_counter() - t0
        results[d] = {"outputs": generate(llm), "digest": llm.collective_rpc("deltarelay_test_digest")[0],
                      "start_s": start}
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
