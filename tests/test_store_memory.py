"""A 512 MiB object moves through file:// and S3 (moto) with the client's extra memory bounded by the Transfer
settings, not by the object's size: upload, download and iter_chunks each measured in a fresh process
(scripts/store_memory.py, VmHWM above the RSS the phase started with), the download checked bit for bit.

moto holds and copies whole objects in the test's own process (a few GiB at peak): run this file under
`flock /tmp/deltarelay-bigmem.lock` on a shared machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZE_MIB = 512
PART_MIB, THREADS, CHUNK_MIB = 32, 3, 8  # uploads: at most THREADS + 1 parts in memory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def measure(url: str, options: dict | None, where: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "store_memory.py"), url, "--size-mib", str(SIZE_MIB),
           "--part-size-mib", str(PART_MIB), "--threads", str(THREADS), "--chunk-size-mib", str(CHUNK_MIB),
           "--dir", str(where)]
    if options:
        cmd += ["--storage-options", json.dumps(options)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_large_object_memory_is_bounded(request, tmp_path, record_property, kind):
    run = request.getfixturevalue(f"{kind}_run")
    report = measure(run.url, run.options, tmp_path)
    record_property("measured", json.dumps({k: report[k] for k in ("upload", "download", "iter_chunks")}))
    upload_bound = (THREADS + 1) * PART_MIB + 48  # part buffers, plus the HTTP stack's own
    assert report["upload"]["extra_peak_mib"] < min(upload_bound, 200), report
    assert report["download"]["extra_peak_mib"] < 128, report  # THREADS pieces of CHUNK_MIB and their reads
    assert report["iter_chunks"]["extra_peak_mib"] < 128, report
