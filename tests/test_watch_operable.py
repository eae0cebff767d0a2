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


def test_a_restarted_watcher_is_not_another_live_watcher(file_run, trainer, tmp_path):
    """Start, stop and restart `watch` on one DEST: the restart finds its previous self's fresh ledger entry
    and says nothing of it (that process is gone: the restart holds DEST's lock). Two live watchers on two
    DESTs under one --host are still told of each other."""
    from conftest import publish_steps

    publish_steps(file_run.url, trainer, 1)
    store_dir = Path(file_run.url.removeprefix("file://"))
    dest = tmp_path / "dest"
    beat = ("--report-interval", "30")  # the first instance's entry is still fresh when the second starts
    first = start_watch(file_run.url, dest, tmp_path / "first.log", *beat)
    try:
        wait_for(first, tmp_path / "first.log", "now at step 0")
        deadline = time.monotonic() + 60
        while not list((store_dir / "fleet" / "hosts").glob("*.json")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stop(first)
    again = start_watch(file_run.url, dest, tmp_path / "again.log", *beat)
    try:
        # the restart's first ledger write replaces the old entry, after reading it
        (entry,) = (store_dir / "fleet" / "hosts").glob("*.json")
        old = json.loads(entry.read_text())["instance"]
        deadline = time.monotonic() + 60
        while json.loads(entry.read_text())["instance"] == old:
            assert again.poll() is None and time.monotonic() < deadline, (tmp_path / "again.log").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        stop(again)
    assert "another live watcher" not in (tmp_path / "again.log").read_text()

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start_watch(file_run.url, tmp_path / f"dest-{i}", logs[i], *beat, "--host", "shared") for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not any("another live watcher" in p.read_text() for p in logs):
            assert all(p.poll() is None for p in procs), [p.read_text()[-2000:] for p in logs]
            assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in logs]
            time.sleep(0.05)
    finally:
        for p in procs:
            stop(p)


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses (hex, as /proc/net/tcp writes them) with a socket listening on `port`."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(addr)
    return found


def test_watch_serves_metrics_on_loopback_by_default(file_run, trainer, tmp_path):
    """`watch --metrics-port` binds 127.0.0.1, as Watcher(metrics_port=) does from Python; the scrape answers."""
    import urllib.request

    from conftest import free_port, publish_steps

    publish_steps(file_run.url, trainer, 1)
    port = free_port()
    log_path = tmp_path / "watch.log"
    proc = start_watch(file_run.url, tmp_path / "dest", log_path, "--metrics-port", str(port), "--no-report")
    try:
        wait_for(proc, log_path, "now at step 0")
        assert f"metrics on http://127.0.0.1:{port}/metrics" in log_path.read_text()
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 00000000 (all interfaces)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            assert b"deltarelay_watcher_held_step" in resp.read()
    finally:
        stop(proc)


def test_status_fleet_names_a_region_by_the_watchers_region_not_the_relays_bucket(tmp_path, trainer):
    """A relay given only `--dest URL` names that region after its bucket (here: the URL); the watcher was
    given `--region eu-west-1`. `status --fleet` shows the host, and the gathered region, as eu-west-1."""
    from conftest import publish_steps

    from relay import fleet
    from relay.cli_fanout import _dest_name
    from relay.store import open_store

    src, dst = f"file://{tmp_path}/origin/run", f"file://{tmp_path}/eu/run"
    publish_steps(src, trainer, 1)
    publish_steps(dst, trainer, 1)  # a run in the region to follow (this test is about names, not steps)
    watch = subprocess.run([sys.executable, "-m", "relay.cli", "watch", dst, "--dest", str(tmp_path / "d"), "--once",
                            "--region", "eu-west-1", "--host", "eu-1"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert watch.returncode == 0, watch.stderr
    name = _dest_name(dst, set())  # what `deltarelay relay --dest URL` calls the region
    fleet.RegionGatherer(open_store(src), {name: open_store(dst)}).gather(name)
    status = subprocess.run([sys.executable, "-m", "relay.cli", "status", src, "--fleet", "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    doc = json.loads(status.stdout)
    assert [(h["host"], h["region"]) for h in doc["hosts"]] == [("eu-1", "eu-west-1")], doc
    assert list(doc["regions"]) == ["eu-west-1"], doc["regions"]
    assert doc["regions"]["eu-west-1"]["gathered_from"] == dst and doc["regions"]["eu-west-1"]["hosts"] == 1
