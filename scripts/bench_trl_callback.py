"""What DeltaRelayCallback adds to a TRL GRPOTrainer step on CPU: whole training runs with and without it.

For each model size, runs of GRPO (tests/trl_tiny.py's settings, one torch thread, random-init BF16 Llama,
--lr 1e-5 by default) are repeated alternately without the callback and with it in each --modes: "background"
(the default), "inline" (background=False), "background-fast" (the codec's "fast" effort). It publishes to a
local file:// store with one encode thread (workers=1: the trainer has the other core). A step's time is the
wall time between consecutive on_step_end hooks (a timing callback after the publisher's), so it includes
everything the callback blocks on and any CPU its thread takes from training; the first step of each run
(the initial snapshot, compilation, warm caches) is left out. Prints, per size and mode, the median step time,
the median overhead against the runs without, as a fraction of the step, and the median time in the hook.

    python scripts/bench_trl_callback.py --sizes tiny,200m --steps 4 --repeats 2 --modes none,background,inline
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

SIZES = {"tiny": (2, 64), "64m": (12, 768), "200m": (16, 1024)}  # layers, hidden


MODES = {"none": None, "background": {"background": True}, "inline": {"background": False},
         "background-fast": {"background": True, "effort": "fast"}}


def cpu_seconds() -> float:
    """This process's CPU time, every thread (training and the publishing thread alike)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(model_dir: Path, work: Path, steps: int, mode: str, lr: float) -> tuple[list[float], list[float], list[float]]:
    """One training run: (step times, times inside the callback's on_step_end, CPU seconds per step), first step
    left out."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    import trl_tiny
    from relay.integrations.trl import DeltaRelayCallback

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    callbacks: list[Any] = []
    hook: list[float] = []
    options = MODES[mode]
    if options is not None:
        cb = DeltaRelayCallback(f"file://{work}/store-{time.monotonic_ns()}/run", workers=1, **options)
        inner = cb.on_step_end

        def timed(*a: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            inner(*a, **kw)
            hook.append(time.perf_counter() - t0)

        cb.on_step_end = timed  # type: ignore[method-assign]
        callbacks.append(cb)
    ends: list[float] = []
    cpus: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())
            cpus.append(cpu_seconds())

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())
            cpus.append(cpu_seconds())

    trainer = trl_tiny.grpo(model, work / "out", steps, callbacks, seed=3, lr=lr)
    trainer.add_callback(Clock())
    trainer.train()
    times = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [b - a for a, b in zip(cpus, cpus[1:])]
    return times[1:], hook[1:], cpu[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,200m", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="none,background,inline", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--lr", type=float, default=1e-5, help="GRPO's learning rate (sets how many elements change)")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import trl_tiny

    out: dict[str, Any] = {}
    for size in a.sizes.split(","):
        layers, hidden = SIZES[size]
        with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
            work = Path(tmp)
            model_dir = trl_tiny.save_model(work / "model", layers=layers, hidden=hidden)
            from transformers import AutoModelForCausalLM

            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
            steps: dict[str, list[float]] = {}
            hooks: dict[str, list[float]] = {}
            cpu: dict[str, list[float]] = {}
            modes = a.modes.split(",")
            for _ in range(a.repeats):
                for mode in modes:
                    t, h, c = run(model_dir, work, a.steps, mode, a.lr)
                    steps.setdefault(mode, []).extend(t)
                    cpu.setdefault(mode, []).extend(c)
                    hooks.setdefault(mode, []).extend(h)
            base = statistics.median(steps["none"]) if "none" in steps else float("nan")
            base_cpu = statistics.median(cpu["none"]) if "none" in cpu else float("nan")
            row = {"params": params, "base_step_s": base, "base_cpu_s": base_cpu, "modes": {}}
            print(f"{size}: {params / 1e6:.1f}M params, {layers} x {hidden}; median step without the callback "
                  f"{base:.3f} s, {base_cpu:.3f} CPU-s ({len(steps.get('none', []))} steps)")
            for mode in modes:
                if mode == "none":
                    continue
                med = statistics.median(steps[mode])
                hook = statistics.median(hooks[mode]) if hooks[mode] else float("nan")
                mcpu = statistics.median(cpu[mode])
                row["modes"][mode] = {"step_s": med, "overhead_s": med - base, "fraction": (med - base) / base,
                                      "hook_s": hook, "steps": steps[mode], "cpu_s": mcpu, "cpu": cpu[mode]}
                print(f"  {mode:15s} median step {med:.3f} s, overhead {med - base:+.3f} s "
                      f"({(med - base) / base:+.1%} of the step), in the hook {hook:.3f} s "
                      f"({hook / base:.1%}); CPU {mcpu:.3f} s/step ({(mcpu - base_cpu) / base_cpu:+.1%})")
            row["none_steps"], row["none_cpu"] = steps.get("none", []), cpu.get("none", [])
            out[size] = row
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
