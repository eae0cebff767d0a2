#!/usr/bin/env python
"""Measure what a large object costs a store's client in memory: upload one (put_immutable_stream), then
download it (download into a file) and read it (iter_chunks), and report each phase's peak RSS above the
RSS it started with (VmHWM, reset through /proc/self/clear_refs), its time and throughput. Each phase
runs in a fresh process, so none inherits memory another freed but kept.

    scripts/store_memory.py URL [--size-mib 512] [--storage-options JSON] [--part-size-mib 64]
                                [--threads 4] [--chunk-size-mib 8] [--threshold-mib 64] [--dir DIR]

The object is `snapshots/0/memory-probe.safetensors` under URL (deleted afterwards); the stream is one
8 MiB block repeated (held before the measure starts), so the peaks are the store's own buffers. The
download is checked against the stream's xxh3. Prints one JSON object. Linux only (procfs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xxhash

from relay.store import MiB, Store, Transfer, open_store

KEY = "snapshots/0/memory-probe.safetensors"
BLOCK = random.Random(0).randbytes(8 * MiB)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measured(fn: Callable[[], object], size: int) -> dict:
    """Run `fn` with the peak RSS reset first: its extra peak (MiB), seconds and MiB/s."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start_kib, t0 = status_kib("VmRSS"), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return {"extra_peak_mib": round((status_kib("VmHWM") - start_kib) / 1024, 1), "seconds": round(seconds, 2),
            "mib_per_s": round(size / MiB / seconds, 1)}


def stream(size: int) -> Iterator[memoryview]:
    view = memoryview(BLOCK)
    for at in range(0, size, len(BLOCK)):
        yield view[:min(len(BLOCK), size - at)]


def phase(name: str, store: Store, size: int, tag: str, where: str | None) -> dict:
    """One measured phase, in this process."""
    if name == "upload":
        store.delete([KEY])
        return measured(lambda: store.put_immutable_stream(KEY, lambda: stream(size), size, tag), size)
    if name == "download":
        with tempfile.NamedTemporaryFile(dir=where) as f:
            out = measured(lambda: store.download(KEY, f.fileno(), size), size)
            got = xxhash.xxh3_128()
            for at in range(0, size, 8 * MiB):
                got.update(os.pread(f.fileno(), 8 * MiB, at))
        if got.hexdigest() != tag:
            raise SystemExit(f"{store.url}/{KEY}: the download hashes to {got.hexdigest()}, uploaded {tag}")
        return out
    if name == "iter_chunks":
        got = xxhash.xxh3_128()
        out = measured(lambda: [got.update(c) for c in store.iter_chunks(KEY)], size)
        if got.hexdigest() != tag:
            raise SystemExit(f"{store.url}/{KEY}: iter_chunks hashes to {got.hexdigest()}, uploaded {tag}")
        return out
    raise ValueError(name)


PHASES = ("upload", "download", "iter_chunks")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--storage-options", type=json.loads, default=None)
    p.add_argument("--part-size-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--chunk-size-mib", type=int, default=8)
    p.add_argument("--threshold-mib", type=int, default=64)
    p.add_argument("--dir", default=None, help="where the downloaded copy goes (default: the temp directory)")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in this process
    a = p.parse_args(argv)
    size = a.size_mib * MiB
    transfer = Transfer(multipart_threshold=a.threshold_mib * MiB, part_size=a.part_size_mib * MiB,
                        threads=a.threads, chunk_size=a.chunk_size_mib * MiB)
    store = open_store(a.url, a.storage_options, transfer=transfer)
    h = xxhash.xxh3_128()
    for piece in stream(size):
        h.update(piece)
    if a.phase:
        out = {"baseline_rss_mib": round(status_kib("VmRSS") / 1024, 1)} | phase(a.phase, store, size, h.hexdigest(),
                                                                                  a.dir)
        print(json.dumps(out))
        return out
    report: dict = {"url": a.url, "size_mib": a.size_mib, "part_size_mib": a.part_size_mib, "threads": a.threads,
                    "chunk_size_mib": a.chunk_size_mib, "threshold_mib": a.threshold_mib}
    try:
        for name in PHASES:
            run = subprocess.run([sys.executable, __file__, *argv, "--phase", name], check=True, text=True,
                                 stdout=subprocess.PIPE)
            report[name] = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        store.delete([KEY])
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
