"""The fleet ledger (relay.fleet, PROTOCOL §9) and the Prometheus endpoints (relay.metrics), with real
watchers, a real relay, file:// and moto S3 stores, and the CLI: who holds which step, bounded
staleness (wait_for_fleet with a watcher held back), and hostile ledger entries reported, not fatal."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from relay import cli, fleet
from relay.fanout import Destination, Fanout
from relay.publisher import Publisher
from relay.store import open_store
from relay.watcher import Watcher
from fake_engine import FakeEngine

from conftest import publish_steps


def scrape(port: int) -> dict[str, float]:
    """GET /metrics over loopback: {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_until(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def entry(host: str, **kw) -> bytes:
    """A well-formed host entry (HostReport) with `kw` overriding its fields."""
    now = time.time()
    fields = dict(host=host, hostname="h", url="file:///x", updated=now, started=now - 10, interval=30.0,
                  instance="0" * 32, run=None, step=None)
    fields.update(kw)
    return fleet.HostReport(**fields).to_bytes()


def status_json(capsys, *urls: str, extra: tuple = ()) -> dict:
    assert cli.main(["status", "--fleet", *urls, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


class Publishing:
    """A live publisher of the trainer's steps (one at a time, on demand)."""

    def __init__(self, url: str, trainer, options=None) -> None:
        self.t = trainer(seed=3)
        self.pub = Publisher(url, storage_options=options, snapshot_every=3, background=False)
        self.step = -1

    def next(self, n: int = 1) -> int:
        for _ in range(n):
            self.step += 1
            self.pub.publish(self.t.state() if self.step == 0 else self.t.step(), self.step)
        return self.step


def test_watchers_report_and_status_fleet_shows_steps_per_region(file_run, trainer, tmp_path, capsys):
    pub = Publishing(file_run.url, trainer)
    pub.next(3)
    with Watcher(file_run.url, tmp_path / "a", host="a", region="eu") as a, \
            Watcher(file_run.url, tmp_path / "b", host="b", region="eu") as b, \
            Watcher(file_run.url, tmp_path / "c", host="c", region="ap") as c:
        b.sync(timeout=30)  # b stays at step 2
        pub.next(2)
        a.sync(timeout=30)
        c.sync(timeout=30)
        store = open_store(file_run.url)
        got = fleet.HostReport.parse(store.get("fleet/hosts/a.json"), "a")
        assert (got.host, got.region, got.step, got.run, got.head) == ("a", "eu", 4, pub.pub.run, 4)
        assert got.bytes_downloaded == a.bytes_downloaded > 0 and got.step_since <= got.updated
        doc = status_json(capsys, file_run.url)
    assert doc["head"] == 4 and doc["run"] == pub.pub.run
    eu, ap = doc["regions"]["eu"], doc["regions"]["ap"]
    assert (eu["hosts"], eu["ok"], eu["behind"], eu["steps"], eu["max_lag_steps"]) == (2, 1, 1, {"4": 1, "2": 1}, 2)
    assert (ap["hosts"], ap["ok"], ap["steps"], ap["max_lag_steps"]) == (1, 1, {"4": 1}, 0)
    assert eu["oldest_report_s"] is not None and eu["oldest_report_s"] < 60
    rows = {r["host"]: r for r in doc["hosts"]}
    assert rows["b"]["state"] == "behind" and rows["b"]["lag_steps"] == 2 and rows["a"]["state"] == "ok"
    assert cli.main(["status", "--fleet", file_run.url, "--hosts"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^eu\s+2\s+1\s+1\s+0\s+0\s+2\s+\S+\s+4:1 2:1$", text, re.M), text
    assert re.search(r"^ap\s+1\s+1\s+0\s+0\s+0\s+0\s+\S+\s+4:1$", text, re.M), text
    assert re.search(r"^behind\s+b \(eu\): step 2", text, re.M), text


def test_stale_hosts_are_shown_and_count_neither_way(file_run, trainer, tmp_path, capsys):
    publish_steps(file_run.url, trainer, 2)
    store = open_store(file_run.url)
    with Watcher(file_run.url, tmp_path / "a", host="live", region="eu") as w:
        w.sync(timeout=30)
    run = json.loads(store.get("fleet/hosts/live.json"))["run"]
    # a host that stopped reporting 10 minutes ago, at step 0
    store.commit_object("fleet/hosts/dead.json", entry("dead", region="eu", run=run, step=0,
                                                       updated=time.time() - 600), None)
    doc = status_json(capsys, file_run.url)
    eu = doc["regions"]["eu"]
    assert (eu["hosts"], eu["ok"], eu["stale"], eu["steps"]) == (2, 1, 1, {"1": 1})
    assert {r["host"]: r["state"] for r in doc["hosts"]} == {"live": "ok", "dead": "stale"}
    assert {r["host"]: r["age_s"] > 500 for r in doc["hosts"]} == {"live": False, "dead": True}
    progress = fleet.wait_for_fleet([store], 1, 1.0, timeout=5, run=run)  # the dead host does not hold it back
    assert (progress.live, progress.holding, progress.stale) == (1, 1, 1)
    # a TTL longer than its silence makes it live again, and lagging
    with pytest.raises(fleet.FleetTimeout, match=r"dead \(eu: step 0"):
        fleet.wait_for_fleet([store], 1, 1.0, timeout=0.2, run=run, ttl=3600, poll_interval=0.05)


def test_wait_for_fleet_with_a_watcher_held_back(file_run, trainer, tmp_path, capsys):
    pub = Publishing(file_run.url, trainer)
    pub.next(2)
    fast = Watcher(file_run.url, tmp_path / "fast", host="fast", poll_interval=0.05, report_interval=0.2)
    slow = Watcher(file_run.url, tmp_path / "slow", host="slow", report_interval=0.2)
    runner = threading.Thread(target=fast.run, daemon=True)
    try:
        slow.sync(timeout=30)  # step 1, then only heartbeats: alive but not syncing (a stuck host)
        slow.fleet.start()
        runner.start()
        head = pub.next(3)
        got = pub.pub.wait_for_fleet(head, 0.5, timeout=60, poll_interval=0.05)  # the fast one is enough
        assert (got.holding, got.live) == (1, 2) and [r["host"] for r in got.lagging] == ["slow"]
        t0 = time.monotonic()
        with pytest.raises(fleet.FleetTimeout) as caught:
            pub.pub.wait_for_fleet(head, 1.0, timeout=0.5, poll_interval=0.05)
        assert time.monotonic() - t0 < 10
        msg = str(caught.value)
        assert "1 of 2 live host(s) hold step 4" in msg and "slow (" in msg and "step 1" in msg, msg
        assert "fast" not in msg.split("lagging:")[1]
        # the CLI form: exit 2 naming the host, then 0 once it catches up
        assert cli.main(["wait-fleet", file_run.url, "--timeout", "0.3", "--poll-interval", "0.05"]) == 2
        assert "slow (" in capsys.readouterr().err
        slow.sync(timeout=30)
        got = pub.pub.wait_for_fleet(fraction=1.0, timeout=60, poll_interval=0.05)
        assert (got.holding, got.live, got.lagging) == (2, 2, [])
        assert cli.main(["wait-fleet", file_run.url, "--timeout", "30", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["reached"] and out["holding"] == out["live"] == 2
        # a host that stops reporting no longer holds the fleet back once its entry is stale
        slow.close()
        head = pub.next()
        got = pub.pub.wait_for_fleet(head, 1.0, timeout=60, ttl=1.0, poll_interval=0.05)
        assert (got.holding, got.live, got.stale) == (1, 1, 1)
    finally:
        fast.stop()
        runner.join(timeout=30)
        fast.close()
        slow.close()


BAD_ENTRIES = {
    "garbage": b"\x00not json",
    "wrongformat": json.dumps({"format": "other", "version": 1}).encode(),
    "liar": entry("someone-else"),  # names another host than its key
    "future": entry("future", updated=time.time() + 10 * 86400),
    "forever": entry("forever").replace(b'"interval": 30.0', b'"interval": 1e9'),
    "nested": entry("nested").replace(b'"engine": null', b'"engine": {"a": {"b": 1}}'),
    "negative": entry("negative").replace(b'"step": null', b'"step": -3'),
    "huge": b" " * (fleet.MAX_ENTRY_BYTES + 1),
}


def test_malformed_entries_are_reported_not_fatal(file_run, trainer, tmp_path, capsys):
    publish_steps(file_run.url, trainer, 2)
    store = open_store(file_run.url)
    for name, data in BAD_ENTRIES.items():
        store.commit_object(f"fleet/hosts/{name}.json", data, None)
    store.commit_object("fleet/regions/eu.json", b"{broken", None)
    with Watcher(file_run.url, tmp_path / "ok", host="ok", region="eu") as w:
        w.sync(timeout=30)
    doc = status_json(capsys, file_run.url)
    states = {r["where"].rsplit("/", 1)[-1]: r for r in doc["hosts"]}
    assert states["ok.json"]["state"] == "ok"
    bad = {k: v["error"] for k, v in states.items() if v["state"] == "bad"}
    assert set(bad) == {f"{n}.json" for n in BAD_ENTRIES}, bad
    assert "stored as fleet/hosts/liar.json" in bad["liar.json"] and "future" in bad["future.json"]
    assert "interval" in bad["forever.json"] and "engine" in bad["nested.json"] and "bytes" in bad["huge.json"]
    assert any("fleet/regions/eu.json" in p for p in doc["problems"])
    # a waiting trainer is not fooled: the bad entries count neither way
    progress = fleet.wait_for_fleet([store], 1, 1.0, timeout=5, run=w.run_id)
    assert (progress.live, progress.holding, progress.bad) == (1, 1, len(BAD_ENTRIES))
    assert cli.main(["status", "--fleet", file_run.url]) == 0
    assert "bad entry" in capsys.readouterr().out


def test_a_ledger_that_cannot_be_written_never_stops_the_watcher(file_run, trainer, tmp_path, caplog):
    publish_steps(file_run.url, trainer, 2)
    with Watcher(file_run.url, tmp_path / "d", host="ro") as w:
        def refuse(key, data, expected_etag):
            raise PermissionError(f"{key}: AccessDenied")

        w.store.commit_object = refuse  # a read-only role
        assert w.sync(timeout=30) == 1
        assert w.fleet.failures == 1 and "AccessDenied" in w.fleet.last_error
        assert "syncing is not affected" in caplog.text
        assert json.loads((tmp_path / "d" / "relay-state.json").read_bytes())["step"] == 1


def test_watcher_metrics_endpoint_moves_with_the_run(file_run, trainer, tmp_path):
    pub = Publishing(file_run.url, trainer)
    pub.next(2)
    engine = FakeEngine()
    with Watcher(file_run.url, tmp_path / "d", host="m1", metrics_port=0, metrics_addr="127.0.0.1",
                 engine=engine) as w:
        m = scrape(w.metrics_port)
        assert 'deltarelay_watcher_held_step{host="m1"}' not in m
        assert m['deltarelay_watcher_bytes_downloaded_total{host="m1"}'] == 0
        engine.pause = 0.02
        w.sync(timeout=30)
        assert engine.step == 1
        m = scrape(w.metrics_port)
        assert m['deltarelay_watcher_held_step{host="m1"}'] == 1 and m['deltarelay_watcher_lag_steps{host="m1"}'] == 0
        first = m['deltarelay_watcher_bytes_downloaded_total{host="m1"}']
        assert first == w.bytes_downloaded > 0
        assert m['deltarelay_watcher_ledger_writes_total{host="m1"}'] == 1
        assert m['deltarelay_watcher_engine_pause_seconds_count{host="m1"}'] == 1
        assert m['deltarelay_watcher_engine_pause_seconds_bucket{host="m1",le="0.025"}'] == 1
        pub.next(2)
        w.reader.read_manifest()  # the watcher sees the new head before it syncs: it lags
        m = scrape(w.metrics_port)
        assert m['deltarelay_watcher_lag_steps{host="m1"}'] == 2 and m['deltarelay_watcher_head_step{host="m1"}'] == 3
        assert m['deltarelay_watcher_lag_seconds{host="m1"}'] >= 0
        engine.pause = 0.4
        w.sync(timeout=30)
        assert engine.step == 3
        m = scrape(w.metrics_port)
        assert m['deltarelay_watcher_held_step{host="m1"}'] == 3 and m['deltarelay_watcher_lag_seconds{host="m1"}'] == 0
        assert m['deltarelay_watcher_bytes_downloaded_total{host="m1"}'] > first
        assert m['deltarelay_watcher_engine_pause_seconds_count{host="m1"}'] == 2
        assert m['deltarelay_watcher_engine_pause_seconds_sum{host="m1"}'] == pytest.approx(0.42)
        w.sync(timeout=30)  # nothing new: the same engine update is not observed twice, nor the entry rewritten
        m = scrape(w.metrics_port)
        assert m['deltarelay_watcher_engine_pause_seconds_count{host="m1"}'] == 2
        assert m['deltarelay_watcher_ledger_writes_total{host="m1"}'] == 2
        w.engine = None
        w.store.commit_manifest(b"{}", w.store.read_manifest().etag)  # a failed sync is counted
        with pytest.raises(ValueError, match="manifest"):
            w.sync(timeout=5)
        m = scrape(w.metrics_port)
        assert m['deltarelay_watcher_failures_total{host="m1",reason="other"}'] == 1
        assert m['deltarelay_watcher_held_step{host="m1"}'] == 3
        port = w.metrics_port
    with pytest.raises(OSError):
        scrape(port)  # closed with the watcher


def test_relay_gathers_regions_and_serves_metrics_on_s3(moto_regions, trainer, tmp_path, capsys):
    """Origin and one region on moto S3: a watcher follows the region and reports there, the relay gathers
    the region's ledger into the origin, and the trainer's wait_for_fleet and status --fleet read the origin
    only. The relay's metrics endpoint moves with the copies."""
    origin, eu = moto_regions("us-east-1"), moto_regions("eu-west-1")
    src = f"s3://{origin.new_bucket()}/run"
    dst = f"s3://{eu.new_bucket()}/run"
    pub = Publishing(src, trainer, origin.options)
    pub.next(2)
    fan = Fanout(src, [Destination("eu-west-1", dst, eu.options)], source_options=origin.options,
                 poll_interval=0.05, fleet_interval=0.1, metrics_port=0)
    try:
        assert fan.sync_once(timeout=120)
        m = scrape(fan.metrics_port)
        assert m["deltarelay_relay_origin_head_step"] == 1
        assert m['deltarelay_relay_region_head_step{region="eu-west-1"}'] == 1
        assert m['deltarelay_relay_region_lag_steps{region="eu-west-1"}'] == 0
        copied = m['deltarelay_relay_region_copied_bytes_total{region="eu-west-1"}']
        assert copied > 0 and m['deltarelay_relay_region_copied_objects_total{region="eu-west-1"}'] > 0
        with Watcher(dst, tmp_path / "w", host="eu-1", region="eu-west-1", storage_options=eu.options,
                     report_interval=0.2) as w:
            w.sync(timeout=60)
            assert fleet.HostReport.parse(open_store(dst, eu.options).get("fleet/hosts/eu-1.json"), "x").step == 1
            pub.next(2)
            runner = threading.Thread(target=fan.run, kwargs={"status_every": 3600}, daemon=True)
            runner.start()
            try:
                wait_until(lambda: scrape(fan.metrics_port).get('deltarelay_relay_region_head_step{region="eu-west-1"}')
                           == 3, what="the relay to copy step 3")
                m = scrape(fan.metrics_port)
                assert m['deltarelay_relay_region_copied_bytes_total{region="eu-west-1"}'] > copied
                assert m['deltarelay_relay_fleet_hosts{region="eu-west-1",state="valid"}'] == 1
                # the trainer waits on its own store: the watcher lags until it syncs
                with pytest.raises(fleet.FleetTimeout, match=r"eu-1 \(eu-west-1: step 1"):
                    pub.pub.wait_for_fleet(3, timeout=0.5, poll_interval=0.05)
                w.sync(timeout=60)
                got = pub.pub.wait_for_fleet(3, timeout=60, poll_interval=0.05)
                assert (got.live, got.holding) == (1, 1)
            finally:
                fan.stop()
                runner.join(timeout=60)
        doc = status_json(capsys, src, extra=("--storage-options", json.dumps(origin.options)))
        region = doc["regions"]["eu-west-1"]
        assert region["steps"] == {"3": 1} and region["ok"] == 1 and region["gathered_age_s"] < 60
        assert region["gathered_from"] == dst
        gathered = json.loads(open_store(src, origin.options).get(fleet.region_key("eu-west-1")))
        assert gathered["format"] == "deltarelay-fleet-region" and [h["host"] for h in gathered["hosts"]] == ["eu-1"]
    finally:
        fan.close()


def test_region_keys_and_host_ids():
    assert fleet.region_key("eu-west-1") == "fleet/regions/eu-west-1.json"
    odd = fleet.region_key("file:///tmp/x/eu")
    assert re.fullmatch(r"fleet/regions/file_tmp_x_eu-[0-9a-f]{8}\.json", odd)
    assert odd != fleet.region_key("file_tmp_x_eu")
    with pytest.raises(ValueError, match="host id"):
        fleet.host_key("../etc")
    assert fleet.HOST_ID.fullmatch(fleet.default_host_id("/data/weights"))
    assert fleet.default_host_id("/a") != fleet.default_host_id("/b")
