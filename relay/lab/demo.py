"""`deltarelay demo`: the whole pipeline on one machine, checked step by step.

An origin and N rollout regions, each a moto S3 server in its own process on loopback (or plain
directories with `--store file://DIR`); a trainer fine-tuning the real all-MiniLM-L6-v2 with the
RL-style step of relay.lab.corpus and publishing every step in BF16; one `deltarelay relay`
process per region (`--regional-snapshots`: the region builds its own snapshots, only a bootstrap snapshot
crosses) and K `deltarelay watch` processes per region. After each step the demo waits until every
watcher holds that step and compares its files bit for bit with the trainer's weights, then prints
what crossed each region boundary against the naive designs, the bytes per step against a full
checkpoint and the published baselines, and the staleness per region, and draws a chart.

Stores follow infra/: buckets `deltarelay-origin-us-east-1` and `deltarelay-<region>`, runs under `runs/`.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import relay
from codec.lab import fireworks
from codec.tensors import same_bits
from relay import checkpoint, lab, traffic
from relay.lab import corpus as mc

# The directory that holds the `relay` package: a checkout's root, or site-packages when installed.
PACKAGE_ROOT = Path(relay.__file__).resolve().parents[1]
ORIGIN_REGION = "us-east-1"
REGION_NAMES = ("us-west-2", "eu-west-1", "ap-northeast-1", "us-east-2", "eu-central-1")
NAME_PREFIX = "deltarelay"
RUN_PREFIX = "runs/"
# Manifest poll interval of relays and watchers: each poll costs a little CPU in the client and in
# moto, and the demo runs 3 + 6 pollers on 2 cores; a quarter second keeps that overhead small.
POLL_S = 0.25
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": ORIGIN_REGION}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One simulated region: a moto S3 server in its own process on loopback.

    Its objects live in that process: stop() loses them, as a region that comes back empty
    would. start() after stop() reuses the port, so clients keep their endpoint.
    """

    def __init__(self, region: str, port: int | None = None, log_path: str | os.PathLike | None = None) -> None:
        self.region = region
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict:
        """s3fs storage_options for this endpoint (a fresh dict: botocore rewrites its config in place).

        One attempt per request and a 2 s connect timeout: a region that is down fails fast, and the
        relay's own backoff, not botocore's, decides when to try again.
        """
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                "client_kwargs": {"region_name": self.region},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 30}}

    def launch(self) -> None:
        """Start the process without waiting (start several, then wait for each)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS})
        finally:
            if not isinstance(out, int):  # a log file; subprocess.DEVNULL is an int
                out.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"moto server for {self.region} on port {self.port} exited with "
                                   f"{self.proc.returncode}"
                                   f"{f' (see {self.log_path})' if self.log_path else ''}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2) as resp:
                    resp.read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server for {self.region} on port {self.port} did not answer in "
                                       f"{timeout:g}s") from None
                time.sleep(0.05)

    def start(self, timeout: float = 60.0) -> "S3Server":
        self.launch()
        self.wait_ready(timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def create_bucket(self, name: str) -> str:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name=self.region)
        kw = {} if self.region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": self.region}}
        client.create_bucket(Bucket=name, **kw)
        return name


@dataclass
class Site:
    """Where one store lives: a region name, its run URL and the options to reach it."""

    region: str
    url: str
    options: dict | None
    server: S3Server | None = None


@dataclass
class Host:
    region: str
    dest: Path
    proc: subprocess.Popen
    log: Path
    reached: dict[int, float] = field(default_factory=dict)  # step -> seconds after the publish commit


def _python_env() -> dict:
    """This process's environment, with the `relay` we run first on PYTHONPATH when it is not installed
    (a checkout run as `python -m relay.cli`), so relays and watchers run the same code."""
    env = {**os.environ, **CREDENTIALS}
    if str(PACKAGE_ROOT) not in site.getsitepackages() + [site.getusersitepackages()]:
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{PACKAGE_ROOT}{os.pathsep}{path}" if path else str(PACKAGE_ROOT)
    return env


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "relay.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=_python_env())


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _held_step(dest: Path) -> int | None:
    try:
        return int(json.loads((dest / "relay-state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


class _Trainer:
    """relay.lab.corpus's model and RL-style step (imported, not copied), publishing BF16 snapshots."""

    def __init__(self, tiny: bool, seed: int = 0, warmup: int = 2) -> None:
        settings = mc.REGIMES[mc.DEFAULT_REGIME]
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.seq_len = (4, 16) if tiny else (8, 32)
        self.model: mc.TinyPolicy | mc.BertPolicy
        self.source: Callable[[], dict[str, Any]]
        if tiny:
            self.model = mc.TinyPolicy(max_len=self.seq_len)
            self.source = self.model.state_dict
            self.name = "tiny policy (relay.lab.corpus --tiny)"
        else:
            self.model = mc.BertPolicy(mc.load_minilm())
            self.source = self.model.snapshot_source
            self.name = mc.MODEL_NAME
        self.model.train()
        self.vocab = self.model.word_embeddings.weight.shape[0]
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=settings["lr"],
                                     weight_decay=settings["weight_decay"])
        self.regime = mc.DEFAULT_REGIME
        for _ in range(warmup):  # settle AdamW's moments, as the corpus does
            self.step()

    def step(self) -> None:
        mc.policy_gradient_step(self.model, self.opt, self.gen, self.vocab, self.batch, self.seq_len)

    def state(self) -> dict[str, torch.Tensor]:
        return mc.bf16_snapshot(self.source())


def _sites(store: str | None, regions: list[str], work: Path, run: str, log: Callable[[str], None]):
    if store:
        if not store.startswith("file://"):
            raise ValueError(f"--store {store!r}: only file://DIR is supported (S3 runs on local moto servers)")
        root = Path(store.removeprefix("file://")).resolve()
        root.mkdir(parents=True, exist_ok=True)
        origin = Site(ORIGIN_REGION, f"file://{root}/origin/{RUN_PREFIX}{run}", None)
        return origin, [Site(r, f"file://{root}/{r}/{RUN_PREFIX}{run}", None) for r in regions], []
    lab.require("the demo on S3 servers", "moto", "flask", "flask_cors", otherwise="; or pass --store file://DIR")
    servers = [S3Server(r, log_path=work / "logs" / f"moto-{r}.log") for r in (ORIGIN_REGION, *regions)]
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
    log("S3 servers: " + ", ".join(f"{s.region} {s.endpoint}" for s in servers))
    sites = []
    for s in servers:
        bucket = f"{NAME_PREFIX}-origin-{s.region}" if s.region == ORIGIN_REGION else f"{NAME_PREFIX}-{s.region}"
        s.create_bucket(bucket)
        sites.append(Site(s.region, f"s3://{bucket}/{RUN_PREFIX}{run}", s.options(), s))
    return sites[0], sites[1:], servers


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


FIREWORKS_EVERY = 25  # Fireworks ships a full snapshot every 20-30 steps (docs: anchors)


def _crossed(store: Any, status: dict | None) -> dict:
    """What crossed into one region, by kind: the relay's writes of origin objects and manifests into it,
    plus what its materialiser read from the origin to bootstrap (regional snapshots are written in region).
    `listed` is the region's own listing of the run layout, a cross-check of the relay's count."""
    regions = (status or {}).get("regions") or {}
    r: dict[str, Any] = next(iter(regions.values()), {})  # the demo runs one relay per region
    written = r.get("bytes_by_kind") or {}
    boot = r.get("bootstrap_bytes_by_kind") or {}
    by_kind = traffic.split({k: written.get(k, 0) + boot.get(k, 0) for k in traffic.KINDS if k != "regional_snapshots"})
    listed: dict[str, int] = {}
    for prefix in ("deltas/", "records/", "snapshots/"):
        listed.update(store.list(prefix))
    return {"by_kind": by_kind, "bootstrap": traffic.split(boot), "objects": len(listed),
            "listed": sum(listed.values()), "in_region": int((r.get("materialised_bytes_by_kind") or {}).get(
                "regional_snapshots", 0)), "relay_bytes_copied": r.get("bytes_copied")}


def fireworks_bytes(manifest: Any, manifests: int, every: int = FIREWORKS_EVERY) -> dict:
    """The same run's steps under a Fireworks-style policy, per region: a full snapshot (this run's snapshot
    size) at every `every`-th step, the step's delta otherwise, each with its record; manifests as measured."""
    snap = manifest.snapshots[-1].bytes
    out = {"deltas": 0, "records": 0, "snapshots": 0, "manifests": manifests}
    for st in manifest.steps:
        out["records"] += st.record.size
        if st.step % every == 0 or not st.parts:
            out["snapshots"] += snap
        else:
            out["deltas"] += st.delta_bytes
    out["chain"] = out["deltas"] + out["records"]
    out["total"] = out["chain"] + out["snapshots"] + out["manifests"]
    return out


def run_demo(*, store: str | None = None, steps: int = 30, regions: int = 3, watchers: int = 2,
             chart: str | os.PathLike | None = "out/demo.png", tiny: bool = False, baseline_every: int | None = None,
             workdir: str | os.PathLike | None = None, json_path: str | os.PathLike | None = None,
             step_timeout: float = 180.0, copy_snapshots: bool = False, snapshot_format: str = "compressed",
             log: Callable[[str], None] = print) -> dict:
    """Run the pipeline; returns the summary (`text`, `ok` and the numbers behind them).

    By default each region's relay runs in regional-snapshot mode (one origin snapshot crosses, to
    bootstrap; the region builds the others); `copy_snapshots` copies every origin snapshot instead.
    `snapshot_format`: the trainer's snapshot files (`Publisher(snapshot_format=...)`)."""
    Manifest, open_store = relay.Manifest, relay.open_store
    if not 1 <= regions <= len(REGION_NAMES):
        raise ValueError(f"--regions must be 1..{len(REGION_NAMES)}")
    if steps < 1 or watchers < 1:
        raise ValueError("--steps and --watchers must be at least 1")
    baseline_every = baseline_every or (1 if tiny else 5)
    work = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="deltarelay-demo-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    names = list(REGION_NAMES[:regions])
    procs: list[subprocess.Popen] = []
    servers: list[S3Server] = []
    started = time.monotonic()
    try:
        origin, sites, servers = _sites(store, names, work, run, log)
        log(f"origin {origin.url}; regions " + ", ".join(f"{s.region} {s.url}" for s in sites) + f"; work dir {work}")
        hosts: list[Host] = []
        for site in sites:
            opts = [] if site.options is None else ["--storage-options", json.dumps(origin.options),
                                                    "--storage-options", json.dumps(site.options)]
            rlog = work / "logs" / f"relay-{site.region}.log"
            mode = [] if copy_snapshots else ["--regional-snapshots", "--workdir",
                                              str(work / "materialise" / site.region)]
            procs.append(_spawn(["-v", "relay", "--source", origin.url, "--dest", site.url, *opts, "--poll-interval",
                                 str(POLL_S), "--status-every", "10", "--status-file",
                                 str(work / f"relay-{site.region}.json"), *mode], rlog))
            for i in range(watchers):
                dest = work / "hosts" / f"{site.region}-{i}"
                wlog = work / "logs" / f"watch-{site.region}-{i}.log"
                wopts = [] if site.options is None else ["--storage-options", json.dumps(site.options)]
                proc = _spawn(["-v", "watch", site.url, "--dest", str(dest), "--poll-interval", str(POLL_S), *wopts],
                              wlog)
                procs.append(proc)
                hosts.append(Host(site.region, dest, proc, wlog))
        log(f"started {len(sites)} relays and {len(hosts)} watchers; loading the model")
        trainer = _Trainer(tiny)
        deadline = time.monotonic() + step_timeout
        while not all((work / f"relay-{site.region}.json").exists() for site in sites):  # relays are polling
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a relay did not start: {_tail(work / 'logs' / f'relay-{sites[0].region}.log')}")
            time.sleep(0.05)
        pub = relay.Publisher(origin.url, storage_options=origin.options, snapshot_format=snapshot_format)
        prev: dict[str, torch.Tensor] | None = None
        checks = failures = 0
        publish_s: list[float] = []
        # the real Fireworks ARCv2 / ARCv3 where installed (default race, as Fireworks ships it)
        anchors, _, not_run = fireworks.select(every_candidate=False)
        baseline_sizes: dict[str, dict[int, int]] = {k: {} for k in anchors}
        problems: list[str] = []
        for step in range(steps + 1):
            if step:
                trainer.step()
            state = trainer.state()
            t0 = time.monotonic()
            pub.publish(state, step)
            committed = time.monotonic()
            publish_s.append(committed - t0)
            pending = {id(h): h for h in hosts}
            deadline = committed + step_timeout
            while pending and time.monotonic() < deadline:
                for key, h in list(pending.items()):
                    held = _held_step(h.dest)
                    if held is not None and held >= step:
                        h.reached[step] = time.monotonic() - committed
                        del pending[key]
                    elif h.proc.poll() is not None:
                        raise RuntimeError(f"watcher {h.dest.name} exited with {h.proc.returncode}: {_tail(h.log)}")
                if pending:
                    time.sleep(0.01)
            for h in pending.values():
                problems.append(f"step {step}: {h.dest.name} did not get it within {step_timeout:g}s")
            for h in hosts:
                if step not in h.reached:
                    continue
                weights, _ = checkpoint.load(h.dest)
                checks += 1
                if _held_step(h.dest) != step or not same_bits(weights, state):
                    failures += 1
                    problems.append(f"step {step}: {h.dest.name} holds weights that differ from the trainer's")
            if step and step % baseline_every == 0 and prev is not None:  # prev: set at every step after 0
                for name, b in anchors.items():
                    baseline_sizes[name][step] = len(b.encode(prev, state))
            worst = max((h.reached.get(step, float("inf")) for h in hosts), default=0.0)
            log(f"step {step:3d}: published in {publish_s[-1]:.2f}s, every region bit-exact after {worst:.2f}s")
            prev = state
        pub.close()
        got = open_store(origin.url, origin.options).read_manifest()
        if got is None:
            raise RuntimeError(f"{origin.url}: no manifest after publishing")
        final = Manifest.parse(got.data)
        # Wait for the relays to mirror the last snapshots too (they follow the head), then stop everything.
        deadline = time.monotonic() + step_timeout
        regional: dict[str, relay.Manifest] = {}
        while time.monotonic() < deadline:
            for site in sites:
                got = open_store(site.url, site.options).read_manifest()
                m = None if got is None else Manifest.parse(got.data)
                if m is not None and m.head == final.head:
                    want = [s.step for s in final.snapshots if s.step >= m.snapshots[0].step]
                    if [s.step for s in m.snapshots] == want:
                        regional[site.region] = m
            if len(regional) == len(sites):
                break
            time.sleep(0.1)
        for site in sites:
            if site.region not in regional:
                problems.append(f"{site.region}: relay did not mirror the final snapshots in time")
        time.sleep(0.3)  # let the relays write their last status
        relay_status = {}
        for site in sites:
            try:
                relay_status[site.region] = json.loads((work / f"relay-{site.region}.json").read_text())
            except (OSError, ValueError):
                relay_status[site.region] = None
        crossed = {site.region: _crossed(open_store(site.url, site.options), relay_status[site.region])
                   for site in sites}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for s in servers:
            s.stop()

    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    params = sum(t.numel() for t in state.values() if t.is_floating_point())
    delta_sizes = {s.step: s.delta_bytes for s in final.steps if s.parts}
    snapshot_bytes = final.snapshots[0].bytes
    # A host pulling from the origin: the first snapshot and its record, then each step's delta and record.
    naive_delta_bytes = snapshot_bytes + sum(s.record.size + s.delta_bytes for s in final.steps)
    sampled = sorted(baseline_sizes[next(iter(anchors))])
    summary: dict[str, Any] = {
        "model": trainer.name, "parameters": params, "regime": trainer.regime, "full_bytes": full_bytes,
        "snapshot_bytes": snapshot_bytes, "naive_delta_bytes": naive_delta_bytes, "steps": steps + 1,
        "regions": names, "watchers_per_region": watchers,
        "relay_mode": "copy snapshots" if copy_snapshots else "regional snapshots",
        "snapshot_format": snapshot_format,
        "store": "file" if store else "s3 (moto on loopback)", "checks": checks, "check_failures": failures,
        "problems": problems, "delta_bytes": delta_sizes, "publish_seconds": publish_s,
        "baselines": {k: {"label": anchors[k].label, "sizes": v} for k, v in baseline_sizes.items()},
        "baselines_not_run": not_run,
        "baseline_steps": sampled, "crossed": crossed, "relay_status": relay_status,
        "fireworks": {r: fireworks_bytes(final, c["by_kind"]["manifests"]) for r, c in crossed.items()},
        "fireworks_every": FIREWORKS_EVERY,
        "snapshots": [s.step for s in final.snapshots],
        "staleness": {r: sorted(v for h in hosts if h.region == r for st, v in h.reached.items() if st) for r in names},
        "staleness_by_step": {r: {st: max(h.reached.get(st, float("nan")) for h in hosts if h.region == r)
                                  for st in range(steps + 1)} for r in names},
        "seconds": time.monotonic() - started, "work_dir": str(work),
    }
    summary["ok"] = not problems and failures == 0 and checks == len(hosts) * (steps + 1)
    summary["text"] = format_summary(summary)
    if chart:
        try:
            summary["chart"] = str(save_chart(summary, chart))
            summary["text"] += f"\nchart: {summary['chart']}"
        except ImportError:  # matplotlib comes with the demo extra
            summary["text"] += "\nchart skipped: matplotlib is not installed (pip install 'deltarelay[demo]')"
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({k: v for k, v in summary.items() if k != "text"}, indent=1,
                                              default=str))
    if not workdir and summary["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def format_summary(s: dict) -> str:
    deltas = list(s["delta_bytes"].values())
    mean_delta = statistics.fmean(deltas) if deltas else 0.0
    hosts = len(s["regions"]) * s["watchers_per_region"]
    lines = [
        f"deltarelay demo: {s['model']}, {s['parameters'] / 1e6:.1f}M parameters, "
        f"{_fmt_bytes(s['full_bytes'])} in BF16;"
        f" {s['steps']} steps published (0..{s['steps'] - 1}), regime {s['regime']}",
        f"stores: {s['store']}; origin + {len(s['regions'])} regions ({', '.join(s['regions'])}), one relay "
        f"({s.get('relay_mode', 'copy snapshots')}) and {s['watchers_per_region']} watcher processes per region; "
        f"{s['seconds']:.0f}s in all; the trainer's snapshots {s.get('snapshot_format', 'safetensors')}",
        f"bit-exact checks: {s['checks'] - s['check_failures']}/{s['checks']} (every watcher, every step)"
        + ("" if s["ok"] else "  FAILED"),
    ]
    lines += [f"  problem: {p}" for p in s["problems"][:10]]
    lines += ["", "bytes per step (steps 1..N)                      bytes    x smaller than full",
              f"  full checkpoint (BF16 safetensors)        {_fmt_bytes(s['full_bytes']):>12}    1",
              f"  deltarelay delta, mean of {len(deltas):3d} steps        {_fmt_bytes(mean_delta):>12}"
              f"    {s['full_bytes'] / mean_delta:,.0f}" if mean_delta else "  (no deltas)"]
    sampled = s["baseline_steps"]
    if sampled:
        ours = statistics.fmean(s["delta_bytes"][st] for st in sampled if st in s["delta_bytes"])
        lines.append(f"  on the {len(sampled)} sampled steps {sampled if len(sampled) <= 8 else ''}".rstrip())
        lines.append(f"    deltarelay                              {_fmt_bytes(ours):>12}    "
                     f"{s['full_bytes'] / ours:,.0f}")
        for b in s["baselines"].values():
            mean = statistics.fmean(b["sizes"].values())
            lines.append(f"    {b['label'][:38]:38}  {_fmt_bytes(mean):>12}    {s['full_bytes'] / mean:,.0f}"
                         f"   ({mean / ours:.2f}x deltarelay)")
        for key, why in (s.get("baselines_not_run") or {}).items():
            lines.append(f"    {key:38}  not run: {why}")
    per_region = [c["by_kind"]["total"] for c in s["crossed"].values()]
    total = sum(per_region)
    snaps = sum(c["by_kind"]["snapshots"] for c in s["crossed"].values())
    naive_full = hosts * s["steps"] * s["full_bytes"]
    naive_delta = hosts * s["naive_delta_bytes"]
    lines += ["", f"cross-region bytes, {len(s['regions'])} regions x {s['watchers_per_region']} hosts, "
                  f"{s['steps']} steps",
              f"  deltarelay (each object crosses once)     {_fmt_bytes(total):>12}   "
              f"(snapshots {_fmt_bytes(snaps)}, deltas+records {_fmt_bytes(total - snaps)}; "
              f"the trainer snapshotted steps {s['snapshots']}; {s.get('relay_mode', 'copy snapshots')})",
              f"  every host pulls full checkpoints        {_fmt_bytes(naive_full):>12}   ({naive_full / total:.1f}x)",
              f"  every host pulls deltas from the origin   {_fmt_bytes(naive_delta):>12}   "
              f"({naive_delta / total:.1f}x)",
              f"  each extra host in a region adds: deltarelay 0 B, full checkpoints "
              f"{_fmt_bytes(s['steps'] * s['full_bytes'])}, deltas from the origin "
              f"{_fmt_bytes(s['naive_delta_bytes'])}"]
    lines += format_crossed(s)
    lines += ["", "staleness, steps 1..N: publish commit -> each watcher holds the verified step (seconds)",
              f"  {'region':16} {'median':>8} {'p90':>8} {'max':>8}"]
    for region, vals in s["staleness"].items():
        if vals:
            p90 = vals[min(len(vals) - 1, int(0.9 * len(vals)))]
            lines.append(f"  {region:16} {statistics.median(vals):8.2f} {p90:8.2f} {max(vals):8.2f}")
    pubs = s["publish_seconds"][1:] or s["publish_seconds"]
    lines.append(f"publish (encode + upload + commit), median {statistics.median(pubs):.2f}s per step")
    return "\n".join(lines)


def format_crossed(s: dict) -> list[str]:
    """The per-region split of what crossed, next to the same run under the Fireworks-style policy."""
    cols = ("deltas", "records", "manifests", "snapshots", "total")
    every = s.get("fireworks_every", FIREWORKS_EVERY)
    lines = ["", "what crossed into each region, by kind (measured where it crosses: the relay's writes into the "
                 "region, its materialiser's bootstrap reads from the origin)",
             f"  next to the same run under a Fireworks-style policy (a full snapshot shipped to every region "
             f"every {every} steps, deltas between; accounted from this run's objects)",
             f"  {'region':16}" + "".join(f"{c:>11}" for c in cols) + f"   | {'Fireworks':>11}  {'ratio':>6}"]
    sums = dict.fromkeys(cols, 0)
    fw_sum = 0
    for region, c in s["crossed"].items():
        k = c["by_kind"]
        fw = s["fireworks"][region]["total"]
        fw_sum += fw
        for col in cols:
            sums[col] += k[col]
        lines.append(f"  {region:16}" + "".join(f"{_fmt_bytes(k[col]):>11}" for col in cols)
                     + f"   | {_fmt_bytes(fw):>11}  {fw / max(1, k['total']):5.1f}x")
    lines.append(f"  {'all regions':16}" + "".join(f"{_fmt_bytes(sums[col]):>11}" for col in cols)
                 + f"   | {_fmt_bytes(fw_sum):>11}  {fw_sum / max(1, sums['total']):5.1f}x")
    chain = sums["deltas"] + sums["records"]
    first = sum(min(c["by_kind"]["snapshots"], s["snapshot_bytes"]) for c in s["crossed"].values())
    after = sums["total"] - first
    if chain:
        lines.append(f"  beyond each region's bootstrap snapshot: {_fmt_bytes(after)} crossed, "
                     f"{after / chain:.3f}x the deltas and records")
    in_region = sum(c.get("in_region", 0) for c in s["crossed"].values())
    if in_region:
        lines.append(f"  regional snapshots written in region (never crossing): {_fmt_bytes(in_region)}")
    return lines


def save_chart(s: dict, path: str | os.PathLike) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.6))
    steps = sorted(s["delta_bytes"])
    ax1.plot(steps, [s["delta_bytes"][k] for k in steps], "o-", color="C0", label="deltarelay delta", zorder=3)
    ax1.axhline(s["full_bytes"], color="k", ls="--", label="full checkpoint (BF16)")
    for i, b in enumerate(s["baselines"].values()):
        pts = sorted(b["sizes"].items())
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], "s:", color=f"C{i + 1}", label=b["label"], ms=4)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("bytes per step")
    ax1.set_title("What one step costs on the wire")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax1.grid(alpha=0.3, which="both")
    for i, (region, by_step) in enumerate(s["staleness_by_step"].items()):
        pts = sorted((k, v) for k, v in by_step.items() if v == v)
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, color=f"C{i}", label=region)
    for snap in s["snapshots"]:
        ax2.axvline(snap, color="grey", alpha=0.3, lw=1)
    ax2.set_xlabel("step (grey: snapshot steps)")
    ax2.set_ylabel("seconds")
    ax2.set_title("Staleness: publish commit to slowest watcher in the region")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"deltarelay demo: {s['model']}, origin + {len(s['regions'])} regions x "
                 f"{s['watchers_per_region']} watchers ({s['store']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["run_demo", "S3Server", "format_summary", "save_chart", "REGION_NAMES"]
