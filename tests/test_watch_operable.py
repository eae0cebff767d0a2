"""An operator's view of a running `deltarelay watch` (issue 39, "Operable by default"): what it says when
there is nothing to follow, and what it does not say about itself. Real processes, moto S3 on loopback."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_watch(url: str, dest: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "relay.cli", "watch", url, "--dest", str(dest), "--poll-interval", "0.1", *extra]
    with open(log_path, "w") as log_file:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file)


def wait_for(proc: subprocess.Popen, log_path: Path, text: str, limit: float = 90.0) -> str:
    """The watcher's stderr once it holds `text` (the process still running)."""
    deadline = time.monotonic() + limit
    while text not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)
    return log_path.read_text()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def test_watch_warns_of_a_missing_bucket_and_of_a_missing_run(moto_regions, tmp_path):
    """No bucket, and a bucket without a run: each gets a WARNING naming the URL and which is missing, at the
    first poll, and not again at each poll that follows (polls here are 0.1 s apart)."""
    region = moto_regions("us-east-1")
    options = json.dumps(region.options)
    cases = [(f"s3://no-such-bucket-{tmp_path.name.lower()[:20]}/run", "the bucket (or directory) does not exist"),
             (f"s3://{region.new_bucket()}/run", "the run's manifest.json does not exist")]
    for i, (url, missing) in enumerate(cases):
        log_path = tmp_path / f"watch-{i}.log"
        proc = start_watch(url, tmp_path / f"dest-{i}", log_path, "--storage-options", options, "--no-report")
        try:
            wait_for(proc, log_path, f"no run at {url}: {missing}")
            polls_before = time.monotonic()
            while time.monotonic() - polls_before < 2.0:  # ~20 polls, each finding nothing
                assert proc.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.1)
        finally:
            stop(proc)
        text = log_path.read_text()
        assert text.count(f"no run at {url}") == 1, text[-3000:]
        assert "WARNING" in text.split(f"no run at {url}")[0].splitlines()[-1], text[-3000:]
