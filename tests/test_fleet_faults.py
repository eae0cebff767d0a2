"""The fleet ledger (relay/fleet.py, PROTOCOL §9) in the cases an adversarial review found uncovered
(docs/RELIABILITY.md has each finding, before and after): a region that cannot be listed for a moment, a
region full of long-gone hosts, an entry nested past the parser's depth."""

from __future__ import annotations

import json
import time

import pytest

from relay import fleet
from relay.store import open_store

RUN = "a" * 32


def _memory(name: str):
    import uuid

    return open_store(f"memory://review-{name}-{uuid.uuid4().hex}")


def _report(host: str, step: int | None, *, updated: float | None = None, **kw) -> bytes:
    now = time.time()
    fields = dict(host=host, hostname=host, url="memory://x", updated=now if updated is None else updated,
                  started=now - 100, interval=30.0, instance="0" * 32, run=RUN, step=step)
    fields.update(kw)
    return fleet.HostReport(**fields).to_bytes()


def _put(store, host: str, data: bytes) -> None:
    key = fleet.host_key(host)
    got = store.read_object(key)
    store.commit_object(key, data, None if got is None else got.etag)



def test_a_transient_listing_failure_in_a_region_does_not_let_wait_for_fleet_return_early():
    """Region eu has one live host stuck at step 1; region ap one host at the head, step 5. The relay gathers
    both into the origin, and a trainer's wait_for_fleet(5, fraction=1.0) rightly waits. Then one LIST of eu's
    fleet/hosts/ fails (a throttle, a timeout): `RegionGatherer.gather` still writes eu's document, with
    `hosts: []` and `truncated: true`, over the good one. No reader looks at `truncated`, so eu's live host
    vanishes from the ledger at once (well before its TTL) and wait_for_fleet returns as if the whole fleet
    held step 5. A gathering that could not list the region should leave the previous document (or keep its
    still-fresh hosts), so the lagging host keeps counting until its TTL."""
    origin, eu, ap = _memory("origin"), _memory("eu"), _memory("ap")
    _put(eu, "eu-stuck", _report("eu-stuck", 1))
    _put(ap, "ap-ok", _report("ap-ok", 5))
    g = fleet.RegionGatherer(origin, {"eu": eu, "ap": ap})
    g.gather_all()
    with pytest.raises(fleet.FleetTimeout):
        fleet.wait_for_fleet([origin], 5, 1.0, timeout=0.3, run=RUN, poll_interval=0.05)

    real = eu.list

    def flaky(prefix: str):
        if prefix == fleet.HOSTS_PREFIX:
            raise OSError("SlowDown: please reduce your request rate")
        return real(prefix)

    eu.list = flaky  # one bad gathering
    g.gather_all()
    eu.list = real
    try:
        progress = fleet.wait_for_fleet([origin], 5, 1.0, timeout=0.3, run=RUN, poll_interval=0.05)
    except fleet.FleetTimeout:
        return
    pytest.fail(f"wait_for_fleet returned after one failed LIST of eu: {progress.holding} of {progress.live} live "
                f"hosts hold step 5, eu-stuck (step 1, reported just now) is gone from the ledger")


@pytest.mark.parametrize("age", [86400, 600])  # gone for a day (left out), or for 10 min (cut to the cap)
def test_a_region_with_thousands_of_stale_entries_does_not_vanish_from_the_ledger(age):
    """Rollout pods come and go (the default host id carries the hostname, new for every pod), and nothing ever
    removes fleet/hosts/<host>.json: a region accumulates stale entries. The gatherer copies every one of them
    into fleet/regions/<region>.json on every round and never bounds that document: 3,500 day-old entries of
    well-formed size (about 19 KiB each: long dest, last_error and engine fields) make a 68 MB document, which
    every reader refuses unread (over MAX_REGION_BYTES, 64 MiB). The region's one live host, lagging at step
    1, disappears with it, and wait_for_fleet(5, fraction=1.0) returns on the other region's host alone. The
    gatherer should keep its document under the cap its readers enforce (leave out long-stale entries first,
    and say `truncated`), so live hosts are always counted."""
    origin, eu, ap = _memory("origin"), _memory("eu"), _memory("ap")
    now = time.time()
    big = dict(url="s3://" + "u" * 2000, dest="/" + "d" * 4000, last_error="e" * 1024,
               engine={f"k{i:02d}" + "x" * 60: "v" * 256 for i in range(32)},
               failures={f"r{i:02d}" + "a" * 29: 1 for i in range(32)})
    for i in range(3500):
        host = f"rollout-{i:05d}"
        eu.commit_object(fleet.host_key(host), _report(host, 1, updated=now - age, hostname="h" * 255, **big),
                         None)
    _put(eu, "zz-live-stuck", _report("zz-live-stuck", 1))
    _put(ap, "ap-ok", _report("ap-ok", 5))
    fleet.RegionGatherer(origin, {"eu": eu, "ap": ap}).gather_all()
    doc = json.loads(origin.read_object(fleet.region_key("eu")).data)
    assert doc["truncated"] == (age == 600) and len(doc["hosts"]) < 3501  # cut to the cap / left out
    assert any(h["host"] == "zz-live-stuck" for h in doc["hosts"])
    try:
        progress = fleet.wait_for_fleet([origin], 5, 1.0, timeout=0.3, run=RUN, poll_interval=0.05)
    except fleet.FleetTimeout:
        return
    problems = fleet.read_fleet([origin]).problems
    pytest.fail(f"wait_for_fleet returned ({progress.holding} of {progress.live} live hosts): the gathered eu "
                f"document is refused by its readers, so its live lagging host is not counted: {problems[:1]}")


def test_a_deeply_nested_heartbeat_is_a_bad_entry_not_a_crash_of_every_ledger_reader():
    """A rollout host (or anyone who may write fleet/hosts/) stores `[` x 60000 as its entry: under the 64 KiB an
    entry may have, but `json.loads` raises RecursionError, which `HostReport.parse` does not catch (only
    ValueError and UnicodeDecodeError; the manifest's `_load_json` does turn it into a ManifestError). It
    escapes `_host_entry` and `read_store`: `read_fleet`, hence `wait_for_fleet` and `deltarelay status
    --fleet`, crash instead of reporting one bad entry, and the relay's `RegionGatherer.gather` fails the whole
    region at every round (its genuine hosts then go stale in the origin). PROTOCOL §9.3 and SECURITY say a
    malformed entry is reported as bad, never a crash; it should be a FleetError like any other."""
    store, origin = _memory("eu"), _memory("origin")
    _put(store, "ok", _report("ok", 5))
    store.commit_object(fleet.host_key("deep"), b"[" * 60000, None)
    try:
        progress = fleet.wait_for_fleet([store], 5, 1.0, timeout=2, run=RUN, poll_interval=0.05)
    except RecursionError as exc:
        pytest.fail(f"wait_for_fleet crashed on one malformed entry: RecursionError: {exc}")
    assert (progress.holding, progress.live, progress.bad) == (1, 1, 1)
    g = fleet.RegionGatherer(origin, {"eu": store})
    g.gather_all()
    assert g.status()["eu"]["errors"] == 0, g.status()["eu"]["last_error"]
