#!/usr/bin/env python
"""Scale benchmark (issue #15): publisher and watcher on synthetic BF16 checkpoints of 1-8 GB,
against every host pulling the full checkpoint and TRL-style sparse patches, with a cost model.

    PYTHONPATH=. python scripts/bench_scale.py                      # quick: 1 GB, 4 delta steps
    flock /tmp/deltarelay-bigmem.lock python scripts/bench_scale.py --sizes 4.3 --steps 6

A checkpoint of S GB is ceil(S GiB / --tensor-mib) BF16 tensors (4.3 = 16 x 256 MiB), weights
~N(0, 0.02), written once under --workdir (one safetensors file per tensor) and reused. Each step
changes ~--changed of the elements by +-1 ULP, chosen where an update would be visible (an
update dw ~ N(0, s) shows when |dw| > |w|/256, so small |w| change more often), in place, one
tensor at a time. Each role runs in its own process (peak RSS = VmHWM, disk writes =
/proc/self/io write_bytes, both its own):

  publisher   loads the checkpoint (the trainer's copy), publishes step 0 (snapshot) and
              --steps deltas into a file:// store (--s3: a moto server), then the watchers' steps
  resume      a new process holding the head's tensors takes the run over (resume=True) and
              publishes one step
  watcher     per persist mode the Watcher offers ("full", "journal"; found by inspect): cold sync
              (snapshot + chain), then --follow steps one at a time (sync time, disk writes,
              bytes downloaded per step); the publisher and each watcher take turns (marker files)
  full        baseline (a): per step a host copies the full checkpoint from the store and loads it
  trl         baseline (b): int32 index + BF16 value per change in safetensors (codec.lab.baselines),
              size, encode and apply time, against codec.encode / codec.apply_ on the same pair

Timings on a shared 2-core machine are noisy: steps are medians. Writes out/bench_scale.json,
out/bench_scale.png (roles) and out/bench_scale_model.png (cost model); prints the tables.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9
MIB = 1 << 20
# The "done when" targets (ratios are to the model's size in bytes)
TARGETS = {"publisher_rss_x": 2.3, "publisher_step_s": 2.5, "watcher_cold_rss_x": 1.3, "watcher_step_s": 2.5,
           "watcher_disk_x_delta": 4.0, "watcher_disk_slack_bytes": 64 * MIB}
# Cost-model hosts: cores, memory bandwidth (GB/s) and NIC (GB/s) assumed per host class
HOSTS = {32: {"mem_gbps": 100.0, "nic_gbps": 25 / 8}, 128: {"mem_gbps": 300.0, "nic_gbps": 100 / 8}}
MODELS = {"70B": 140e9, "1T": 2e12}


# ---------------------------------------------------------------- measurement helpers (in a role's process)

def peak_rss() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now() -> int:
    """This process's resident set now (VmRSS), bytes: taken at a role's start, the interpreter's
    and libraries' share, which does not grow with the model."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def disk_writes() -> int:
    """Bytes this process caused to be written to storage so far (/proc/self/io; 0 if unavailable)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _wait_for(path: Path, timeout: float = 3600.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.02)


# ---------------------------------------------------------------- the synthetic checkpoint

def layout(size_gb: float, tensor_mib: int) -> list[tuple[str, int]]:
    """(name, elements) of a checkpoint of about size_gb GiB of BF16 tensors of tensor_mib MiB."""
    count = max(1, math.ceil(size_gb * 1024 / tensor_mib))
    return [(f"layers.{i}.weight", tensor_mib * MIB // 2) for i in range(count)]


def checkpoint_dir(workdir: Path, size_gb: float, tensor_mib: int) -> Path:
    """The checkpoint's directory (one safetensors file per tensor), written on first use."""
    import torch
    from safetensors.torch import save_file

    d = workdir / f"ckpt-{size_gb:g}gb-{tensor_mib}mib"
    if (d / "done").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    for i, (name, n) in enumerate(layout(size_gb, tensor_mib)):
        g = torch.Generator().manual_seed(1000 + i)
        t = torch.empty(n, dtype=torch.bfloat16)
        chunk = 1 << 24
        for o in range(0, n, chunk):  # chunked: never a float32 copy of the whole tensor
            t[o:o + chunk] = torch.randn(min(chunk, n - o), generator=g) * 0.02
        rows = 4096 if n % 4096 == 0 else 1
        save_file({name: t.view(rows, -1)}, str(d / f"{i:04d}.safetensors"))
        del t
    (d / "done").write_text("")
    return d


def load_checkpoint(d: Path) -> dict:
    """A private in-RAM copy (a trainer's weights live in its memory, not in a mapped file)."""
    from safetensors.torch import load

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load(f.read_bytes()))
    return out


def mutate_(tensors: dict, step: int, changed: float) -> int:
    """One RL-like step in place: ~changed of the elements move by +-1 ULP, more often where |w|
    is small (visible when |dw| > |w|/256, dw ~ N(0, s)); deterministic per step. Candidates are
    drawn uniformly (8x the target count) and kept with the visibility probability, rescaled to
    the target: no per-element pass over the tensor. Returns the elements changed."""
    import torch

    total = 0
    for i, (_, t) in enumerate(sorted(tensors.items())):
        flat = t.view(-1)
        n = flat.numel()
        g = torch.Generator().manual_seed(step * 100003 + i)
        m = max(1, int(8 * changed * n))
        idx = torch.randint(0, n, (m,), generator=g)
        w = flat[idx].float().abs()
        s = 0.005 / 256  # the update's scale: visible at |w| = 0.001 with p ~0.84, 0.005 ~0.32, 0.02 ~6e-5
        p = torch.special.erfc(w / (256 * s * math.sqrt(2)))
        p = (p * (changed * n / max(float(p.sum()), 1e-12))).clamp_(max=1.0)
        keep = torch.unique(idx[torch.rand(m, generator=g) < p])  # a position drawn twice moves once
        bits = flat.view(torch.int16)
        old = bits[keep]
        sign = torch.where(torch.rand(keep.numel(), generator=g) < 0.5, -1, 1).to(torch.int16)
        mag = old & 0x7FFF
        sign = torch.where(mag == 0, torch.ones_like(sign), sign)  # never below zero magnitude (-0 / NaN)
        sign = torch.where(mag >= 0x7F7F, -torch.ones_like(sign), sign)  # never up to inf
        bits[keep] = old + sign
        total += int(keep.numel())
    return total


# ---------------------------------------------------------------- roles (each in its own process)

def _publisher_kwargs(extra: dict) -> dict:
    import relay
    params = inspect.signature(relay.Publisher.__init__).parameters
    return {k: v for k, v in extra.items() if k in params}


def role_publisher(cfg: dict) -> dict:
    import relay

    sync = Path(cfg["sync_dir"])
    t0 = time.perf_counter()
    tensors = load_checkpoint(Path(cfg["ckpt"]))
    load_s = time.perf_counter() - t0
    model = sum(t.numel() * t.element_size() for t in tensors.values())
    pub = relay.Publisher(cfg["url"], snapshot_every=10**6, storage_options=cfg.get("storage_options"),
                          **_publisher_kwargs({"snapshot_fraction": 10.0}))
    s = time.perf_counter()
    pub.publish(tensors, 0)
    pub.flush()
    snapshot_s = time.perf_counter() - s
    steps, changes = [], []
    step = 0
    for _ in range(cfg["steps"]):
        step += 1
        changes.append(mutate_(tensors, step, cfg["changed"]))
        s = time.perf_counter()
        pub.publish(tensors, step)
        pub.flush()
        steps.append(time.perf_counter() - s)
    (sync / "ready").write_text(str(step))
    # the watchers' turns: publish one step, wait until the watcher (one at a time) has it
    for mode in cfg["watchers"]:
        _wait_for(sync / f"cold-{mode}")
        for _ in range(cfg["follow"]):
            step += 1
            changes.append(mutate_(tensors, step, cfg["changed"]))
            s = time.perf_counter()
            pub.publish(tensors, step)
            pub.flush()
            steps.append(time.perf_counter() - s)
            (sync / f"pub-{step}").write_text("")
            _wait_for(sync / f"synced-{mode}-{step}")
    pub.close()
    return {"model_bytes": model, "load_s": load_s, "snapshot_s": snapshot_s, "step_s": steps,
            "changed_per_step": changes, "head": step, "peak_rss": peak_rss(), "disk_writes": disk_writes()}


def role_resume(cfg: dict) -> dict:
    import relay

    tensors = load_checkpoint(Path(cfg["ckpt"]))
    for step in range(1, cfg["head"] + 1):  # the trainer's weights at the head, rebuilt the same way
        mutate_(tensors, step, cfg["changed"])
    base_rss = peak_rss()
    s = time.perf_counter()
    pub = relay.Publisher(cfg["url"], resume=True, snapshot_every=10**6, storage_options=cfg.get("storage_options"),
                          **_publisher_kwargs({"snapshot_fraction": 10.0}))
    attach_s = time.perf_counter() - s
    step = cfg["head"] + 1
    mutate_(tensors, step, cfg["changed"])
    s = time.perf_counter()
    pub.publish(tensors, step)
    pub.flush()
    first_s = time.perf_counter() - s
    pub.close()
    return {"attach_s": attach_s, "first_step_s": first_s, "resume_s": attach_s + first_s, "peak_rss": peak_rss(),
            "rss_before_resume": base_rss}


def watcher_modes() -> list[str]:
    """The persist modes this Watcher offers: ["default"] before the `persist` option exists."""
    import relay
    if "persist" not in inspect.signature(relay.Watcher.__init__).parameters:
        return ["default"]
    return ["full", "journal"]


def role_watcher(cfg: dict) -> dict:
    import relay

    sync = Path(cfg["sync_dir"])
    mode = cfg["mode"]
    dest = Path(cfg["dest"])
    shutil.rmtree(dest, ignore_errors=True)
    kwargs: dict[str, Any] = {"poll_interval": 0.05, "storage_options": cfg.get("storage_options")}
    if mode != "default":
        kwargs["persist"] = mode
    _wait_for(sync / "ready")
    w = relay.Watcher(cfg["url"], dest, **kwargs)
    io0, s = disk_writes(), time.perf_counter()
    head = w.sync(timeout=3600)
    cold_s = time.perf_counter() - s
    cold = {"cold_s": cold_s, "cold_step": head, "cold_disk_writes": disk_writes() - io0,
            "cold_bytes_down": w.bytes_downloaded, "cold_peak_rss": peak_rss()}
    (sync / f"cold-{mode}").write_text("")
    steps, writes, down = [], [], []
    for _ in range(cfg["follow"]):
        want = head + 1
        _wait_for(sync / f"pub-{want}")
        io0, d0, s = disk_writes(), w.bytes_downloaded, time.perf_counter()
        head = w.sync(timeout=600)
        steps.append(time.perf_counter() - s)
        writes.append(disk_writes() - io0)
        down.append(w.bytes_downloaded - d0)
        if head != want:
            raise RuntimeError(f"watcher at {head}, expected {want}")
        (sync / f"synced-{mode}-{head}").write_text("")
    w.close()
    return {**cold, "mode": mode, "step_s": steps, "disk_writes": writes, "bytes_down": down, "peak_rss": peak_rss()}


def role_full(cfg: dict) -> dict:
    """Baseline (a): a host copies the whole checkpoint from the store and loads it, per step. The
    copy is local (file to file, often from the page cache): the network's share is the cost
    model's "full checkpoint over NIC"."""
    import fsspec
    from safetensors.torch import load

    src = Path(cfg["ckpt"])
    dest = Path(cfg["dest"])
    steps, writes, moved = [], [], []
    for _ in range(cfg["repeats"]):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        io0, s = disk_writes(), time.perf_counter()
        fs = fsspec.filesystem("file")
        nbytes = 0
        loaded = {}
        for f in sorted(src.glob("*.safetensors")):
            fs.get(str(f), str(dest / f.name))
            nbytes += f.stat().st_size
        for f in sorted(dest.glob("*.safetensors")):  # into RAM (load_file would map the file)
            loaded.update(load(f.read_bytes()))
        steps.append(time.perf_counter() - s)
        writes.append(disk_writes() - io0)
        moved.append(nbytes)
        del loaded
    shutil.rmtree(dest, ignore_errors=True)
    return {"step_s": steps, "disk_writes": writes, "bytes_down": moved, "peak_rss": peak_rss()}


def role_trl(cfg: dict) -> dict:
    """Baseline (b): TRL-style sparse patches, and the codec on the same pair (same process, same clock)."""
    import codec
    from codec.lab import baselines

    base = load_checkpoint(Path(cfg["ckpt"]))
    target = {k: v.clone() for k, v in base.items()}
    changes = mutate_(target, 1, cfg["changed"])
    out: dict[str, Any] = {"changes": changes}
    for label, enc in (("trl", baselines.trl_sparse_encode), ("codec", codec.encode)):
        enc_s, app_s, size = [], [], 0
        for _ in range(cfg["repeats"]):
            s = time.perf_counter()
            payload = enc(base, target)
            enc_s.append(time.perf_counter() - s)
            size = len(payload)
            live = {k: v.clone() for k, v in base.items()} if label == "codec" else base
            s = time.perf_counter()
            if label == "codec":
                codec.apply_(live, payload)
            else:
                baselines.trl_sparse_decode(base, payload)
            app_s.append(time.perf_counter() - s)
            del live
        out[label] = {"bytes": size, "encode_s": enc_s, "apply_s": app_s, "bytes_per_change": size / max(changes, 1)}
    out["peak_rss"] = peak_rss()
    return out


ROLES = {"publisher": role_publisher, "resume": role_resume, "watcher": role_watcher, "full": role_full,
         "trl": role_trl}


# ---------------------------------------------------------------- orchestration

def _spawn(role: str, cfg: dict, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, __file__, "--child", role, "--config", json.dumps(cfg),
                             "--result", str(out)], env=env)


def _collect(procs: list[tuple[str, subprocess.Popen, Path]]) -> dict[str, dict]:
    results = {}
    for name, p, out in procs:
        if p.wait() != 0:
            for _, other, _ in procs:
                if other.poll() is None:
                    other.kill()
            raise SystemExit(f"role {name} failed (exit {p.returncode})")
        results[name] = json.loads(out.read_text())
    return results


def run_size(size_gb: float, args: argparse.Namespace, storage_options: dict | None, url_base: str) -> dict:
    work = args.workdir
    ckpt = checkpoint_dir(work, size_gb, args.tensor_mib)
    run_dir = work / f"run-{size_gb:g}gb"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "sync").mkdir(parents=True)
    url = f"{url_base}/run-{size_gb:g}gb-{int(time.time())}" if url_base else f"file://{run_dir / 'store'}"
    modes = watcher_modes()
    common = {"ckpt": str(ckpt), "url": url, "storage_options": storage_options, "changed": args.changed,
              "sync_dir": str(run_dir / "sync")}
    print(f"== {size_gb:g} GB: {len(layout(size_gb, args.tensor_mib))} x {args.tensor_mib} MiB, store {url}, "
          f"watcher persist modes {modes}", flush=True)
    pub_out = run_dir / "publisher.json"
    pub = _spawn("publisher", {**common, "steps": args.steps, "follow": args.follow, "watchers": modes}, pub_out)
    procs = [("publisher", pub, pub_out)]
    watchers = {}
    for mode in modes:  # one at a time: a watcher's process holds a copy of the model
        out = run_dir / f"watcher-{mode}.json"
        p = _spawn("watcher", {**common, "mode": mode, "dest": str(run_dir / f"dest-{mode}"), "follow": args.follow},
                   out)
        watchers[mode] = _collect([(f"watcher {mode}", p, out)])[f"watcher {mode}"]
        print(f"   watcher {mode}: cold {watchers[mode]['cold_s']:.1f} s, step median "
              f"{statistics.median(watchers[mode]['step_s']):.2f} s", flush=True)
    results = _collect(procs)
    publisher = results["publisher"]
    print(f"   publisher: snapshot {publisher['snapshot_s']:.1f} s, step median "
          f"{statistics.median(publisher['step_s']):.2f} s", flush=True)
    rest = {}
    for role, cfg in (("resume", {"head": publisher["head"]}),
                      ("full", {"repeats": args.repeats, "dest": str(run_dir / "dest-full")}),
                      ("trl", {"repeats": args.repeats})):
        if role == "trl" and args.no_trl:
            continue
        out = run_dir / f"{role}.json"
        rest.update(_collect([(role, _spawn(role, {**common, **cfg}, out), out)]))
        print(f"   {role} done", flush=True)
    shutil.rmtree(run_dir / "store", ignore_errors=True)
    return {"size_gb": size_gb, "tensors": len(layout(size_gb, args.tensor_mib)), "tensor_mib": args.tensor_mib,
            "model_bytes": publisher["model_bytes"], "url": url.split("/run-")[0], "publisher": publisher,
            "watchers": watchers, **rest}


# ---------------------------------------------------------------- summaries: table, targets, cost model

def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(r: dict) -> dict:
    """Rows of the closing note's table and the targets' verdicts for one size."""
    model = r["model_bytes"]
    pub = r["publisher"]
    rows = [{"role": "publisher", "step_s": _med(pub["step_s"]), "rss_x": pub["peak_rss"] / model,
             "rss_x_above_start": (pub["peak_rss"] - pub["rss_at_start"]) / model,
             "disk_per_step": None, "net_per_step": None, "snapshot_s": pub["snapshot_s"],
             "resume_s": r.get("resume", {}).get("resume_s")}]
    checks = [("publisher peak RSS x model", rows[0]["rss_x"], TARGETS["publisher_rss_x"]),
              ("publisher delta step s", rows[0]["step_s"], TARGETS["publisher_step_s"])]
    for mode, w in r["watchers"].items():
        delta = _med(w["bytes_down"])
        disk = _med(w["disk_writes"])
        rows.append({"role": f"watcher ({mode})", "step_s": _med(w["step_s"]), "rss_x": w["peak_rss"] / model,
                     "rss_x_above_start": (w["peak_rss"] - w["rss_at_start"]) / model,
                     "cold_rss_x": w["cold_peak_rss"] / model, "cold_s": w["cold_s"], "disk_per_step": disk,
                     "net_per_step": delta, "disk_x_delta": disk / max(delta, 1)})
        rows[0]["net_per_step"] = delta
        checks += [(f"watcher ({mode}) cold-sync peak RSS x model", w["cold_peak_rss"] / model,
                    TARGETS["watcher_cold_rss_x"]),
                   (f"watcher ({mode}) delta step s", _med(w["step_s"]), TARGETS["watcher_step_s"]),
                   (f"watcher ({mode}) disk writes per step, bytes", disk,
                    TARGETS["watcher_disk_x_delta"] * delta + TARGETS["watcher_disk_slack_bytes"])]
    if "full" in r:
        f = r["full"]
        rows.append({"role": "baseline: full checkpoint per step", "step_s": _med(f["step_s"]),
                     "rss_x": f["peak_rss"] / model, "rss_x_above_start": (f["peak_rss"] - f["rss_at_start"]) / model,
                     "disk_per_step": _med(f["disk_writes"]),
                     "net_per_step": _med(f["bytes_down"])})
    if "trl" in r:
        t = r["trl"]
        rows.append({"role": "baseline: TRL sparse (int32 + bf16)", "step_s": _med(t["trl"]["apply_s"]),
                     "encode_s": _med(t["trl"]["encode_s"]), "rss_x": None, "disk_per_step": None,
                     "net_per_step": t["trl"]["bytes"], "codec_bytes": t["codec"]["bytes"],
                     "codec_encode_s": _med(t["codec"]["encode_s"]), "codec_apply_s": _med(t["codec"]["apply_s"])})
    return {"rows": rows, "checks": [{"what": w, "value": v, "target": tg, "pass": bool(v <= tg)}
                                     for w, v, tg in checks]}


def _grows(role: dict, model: int, size: float) -> float:
    """A role's peak RSS extrapolated to a model of `size` bytes: what it held above its start
    scales with the model, the start (interpreter, libraries) does not."""
    return role["rss_at_start"] + (role["peak_rss"] - role["rss_at_start"]) / model * size


def cost_model(r: dict, cores_here: int) -> dict:
    """Per-GB rates measured here, extrapolated. Assumption: compute time scales with per-core
    throughput x cores (the codec spreads tensors over threads; measured here on `cores_here`
    cores), floored by memory bandwidth (2 passes over the model's bytes per step: read base and
    target, or read and write while hashing) and by the NIC for bytes over the network; delta
    bytes scale with the model (same changed fraction). RSS above a process's start scales with
    the model. The publisher encodes on the threads its Publisher gives the codec: where that is
    one, the per-core scaling is what a threaded publisher would reach, not today's."""
    model = r["model_bytes"]
    gb = model / GB
    pub_rate = _med(r["publisher"]["step_s"]) / gb  # s per GB of model, on cores_here cores
    # the journal mode's rates where it was measured: the mode whose step costs what changed (full mode
    # rewrites the whole checkpoint per step, which no large deployment would run)
    mode = "journal" if "journal" in r["watchers"] else next(iter(r["watchers"]))
    w = r["watchers"][mode]
    watch_rate = _med(w["step_s"]) / gb
    delta_frac = _med(w["bytes_down"]) / model
    disk_frac = _med(w["disk_writes"]) / model
    rows = []
    for name, size in MODELS.items():
        for cores, host in HOSTS.items():
            scale = cores_here / cores
            mem_floor = 2 * size / (host["mem_gbps"] * GB)
            net = delta_frac * size
            net_s = net / (host["nic_gbps"] * GB)
            rows.append({"model": name, "model_bytes": size, "cores": cores, **host,
                         "publish_s": max(pub_rate * size / GB * scale, mem_floor) + net_s,
                         "watcher_s": max(watch_rate * size / GB * scale, mem_floor) + net_s,
                         "net_bytes": net, "disk_bytes": disk_frac * size,
                         "full_checkpoint_s": size / (host["nic_gbps"] * GB),
                         "publisher_rss_bytes": _grows(r["publisher"], model, size),
                         "watcher_rss_bytes": _grows(w, model, size)})
    return {"measured_at_gb": gb, "cores_here": cores_here, "watcher_mode": mode, "publish_s_per_gb": pub_rate,
            "watcher_s_per_gb": watch_rate, "delta_fraction": delta_frac, "disk_fraction": disk_frac,
            "assumption": cost_model.__doc__.split("Assumption: ")[1].strip().replace("\n    ", " "), "rows": rows}


def _b(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(results: list[dict]) -> str:
    lines = ["| role | model | step time (median) | peak RSS x model (above start) | disk writes / step "
             "| network / step |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for row in r["summary"]["rows"]:
            extra = ""
            if row["role"] == "publisher":
                extra = f" (snapshot {row['snapshot_s']:.1f} s, resume {_f(row.get('resume_s'), '{:.1f}')} s)"
            elif row["role"].startswith("watcher"):
                extra = f" (cold sync {row['cold_s']:.1f} s at {row['cold_rss_x']:.2f}x)"
            elif "encode_s" in row:
                extra = (f" (encode {row['encode_s']:.1f} s; ours {_b(row['codec_bytes'])}, encode "
                         f"{row['codec_encode_s']:.1f} s, apply_ {row['codec_apply_s']:.2f} s)")
            lines.append(f"| {row['role']}{extra} | {r['size_gb']:g} GB | {_f(row['step_s'])} s | "
                         f"{_f(row['rss_x'])} ({_f(row.get('rss_x_above_start'))}) | {_b(row['disk_per_step'])} | "
                         f"{_b(row['net_per_step'])} |")
    lines += ["", "| target | model | measured | limit | verdict |", "|---|---|---|---|---|"]
    for r in results:
        for c in r["summary"]["checks"]:
            value = _b(c["value"]) if "bytes" in c["what"] else f"{c['value']:.2f}"
            limit = _b(c["target"]) if "bytes" in c["what"] else f"{c['target']:.2f}"
            lines.append(f"| {c['what']} | {r['size_gb']:g} GB | {value} | {limit} | "
                         f"{'pass' if c['pass'] else 'FAIL'} |")
    cm = results[-1]["cost_model"]
    lines += ["", f"Cost model (from {cm['measured_at_gb']:.1f} GB on {cm['cores_here']} cores: publish "
              f"{cm['publish_s_per_gb']:.2f} s/GB, watcher ({cm.get('watcher_mode', 'full')} mode) "
              f"{cm['watcher_s_per_gb']:.2f} s/GB, delta "
              f"{100 * cm['delta_fraction']:.3f}% of the model, disk {100 * cm['disk_fraction']:.3f}% per step). "
              f"Assumption: {cm['assumption']}", "",
              "| model | cores | mem GB/s | NIC GB/s | publish step | watcher step | network / step | disk / step "
              "| full checkpoint over NIC | publisher RSS | watcher RSS |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in cm["rows"]:
        lines.append(f"| {row['model']} | {row['cores']} | {row['mem_gbps']:.0f} | {row['nic_gbps']:.1f} | "
                     f"{row['publish_s']:.1f} s | {row['watcher_s']:.1f} s | {_b(row['net_bytes'])} | "
                     f"{_b(row['disk_bytes'])} | {row['full_checkpoint_s']:.0f} s | {_b(row['publisher_rss_bytes'])} | "
                     f"{_b(row['watcher_rss_bytes'])} |")
    return "\n".join(lines)


def charts(results: list[dict], path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for r in results:
        rows = r["summary"]["rows"]
        names = [row["role"].replace("baseline: ", "") for row in rows]
        label = f"{r['size_gb']:g} GB"
        axes[0].barh([f"{n} ({label})" for n in names], [row["step_s"] for row in rows])
        axes[1].barh([f"{n} ({label})" for n in names], [row["rss_x"] or 0 for row in rows])
        axes[2].barh([f"{n} ({label})" for n in names], [(row["net_per_step"] or 0) / MIB for row in rows])
    axes[0].axvline(TARGETS["publisher_step_s"], color="red", ls="--", lw=1)
    axes[0].set_xlabel("step time, median (s)")
    axes[1].axvline(TARGETS["publisher_rss_x"], color="red", ls="--", lw=1)
    axes[1].set_xlabel("peak RSS / model")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("bytes over the network per step (MiB)")
    fig.suptitle("bench_scale: synthetic BF16 checkpoints (medians; shared 2-core machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    model_path = path.with_name(path.stem + "_model.png")
    cm = results[-1]["cost_model"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"{row['model']}, {row['cores']} cores" for row in cm["rows"]]
    x = range(len(labels))
    ax.bar([i - 0.27 for i in x], [row["publish_s"] for row in cm["rows"]], 0.27, label="publish step")
    ax.bar(list(x), [row["watcher_s"] for row in cm["rows"]], 0.27, label="watcher step")
    ax.bar([i + 0.27 for i in x], [row["full_checkpoint_s"] for row in cm["rows"]], 0.27,
           label="full checkpoint over the NIC")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step (model)")
    ax.legend()
    ax.set_title("cost model, extrapolated from the measured per-GB rates")
    fig.tight_layout()
    fig.savefig(model_path, dpi=110)
    plt.close(fig)
    return [path, model_path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1",
                    help="comma-separated checkpoint sizes in GiB (default 1; 4.3 = 16 x 256 MiB)")
    ap.add_argument("--tensor-mib", type=int, default=256, help="MiB per tensor")
    ap.add_argument("--steps", type=int, default=4, help="delta steps the publisher publishes before the watchers")
    ap.add_argument("--follow", type=int, default=3, help="delta steps each watcher follows one at a time")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each baseline (medians)")
    ap.add_argument("--changed", type=float, default=0.01, help="fraction of elements changed per step")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench_scale_cache",
                    help="checkpoints (kept and reused) and runs")
    ap.add_argument("--s3", action="store_true", help="a moto S3 server instead of file://")
    ap.add_argument("--no-trl", action="store_true", help="skip baseline (b)")
    ap.add_argument("--json", type=Path, default=ROOT / "out" / "bench_scale.json")
    ap.add_argument("--chart", type=Path, default=ROOT / "out" / "bench_scale.png")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import codec  # noqa: F401 - loaded before the start RSS is taken, as every role needs them
        import relay  # noqa: F401
        start = rss_now()
        result = {**ROLES[args.child](json.loads(args.config)), "rss_at_start": start}
        args.result.write_text(json.dumps(result))
        return 0
    storage_options, url_base, server = None, "", None
    if args.s3:
        from relay.lab.demo import S3Server
        server = S3Server("us-east-1").start()
        storage_options, url_base = server.options(), "s3://" + server.create_bucket("bench-scale")
    try:
        results = []
        for size in (float(s) for s in args.sizes.split(",")):
            r = run_size(size, args, storage_options, url_base)
            r["summary"] = summarize(r)
            r["cost_model"] = cost_model(r, os.cpu_count() or 1)
            results.append(r)
    finally:
        if server is not None:
            server.stop()
    text = markdown(results)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "cores": os.cpu_count(), "targets": TARGETS, "results": results,
                                     "markdown": text}, indent=1))
    try:
        import matplotlib  # noqa: F401 - the demo extra's; a dev install measures and reports without charts
    except ImportError:
        print(f"wrote {args.json}; charts skipped: matplotlib is not installed (pip install 'deltarelay[demo]')")
        return 0
    written = charts(results, args.chart)
    print(f"wrote {args.json}, {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
