"""Untrusted JSON costs what its kind of document can legitimately cost, once per version (issue 37.4, 37.5).

A hostile writer of a bucket object must not make a reader build far more objects than an honest document of
that size holds, nor make it download and parse the same refused version at every poll; text it wrote reaches
an operator's terminal escaped."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

from faultproxy import FaultProxy
from relay import cli, fleet
from relay.store import open_store
from relay.watcher import Watcher


def hostile_manifest(size: int) -> bytes:
    """`[{},{},...]`: one object per 3 bytes, under every size cap."""
    n = (size - 2) // 3
    return b"[" + b"{}," * (n - 1) + b"{}]"


def manifest_gets(proxy: FaultProxy) -> list[tuple[int, int]]:
    """(status, body bytes) of each manifest GET the store answered."""
    return [(status, n) for method, path, status, n in list(proxy.served)
            if method == "GET" and path.endswith("/manifest.json")]


def test_a_hostile_manifest_is_downloaded_and_parsed_once_per_version(s3_run, tmp_path):
    proxy = FaultProxy(s3_run.region.endpoint, seed=37).start()
    options = proxy.options(s3_run.options)
    doc = hostile_manifest(8 << 20)
    open_store(s3_run.url, s3_run.options).commit_manifest(doc, None)
    w = Watcher(s3_run.url, tmp_path / "dest", poll_interval=0.1, storage_options=options)
    tracemalloc.start()
    try:
        thread = threading.Thread(target=w.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(manifest_gets(proxy)) < 8:
            time.sleep(0.1)
        w.stop()
        thread.join(60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        w.close()
        proxy.stop()
    bodies = [n for status, n in manifest_gets(proxy) if status == 200]
    assert len(manifest_gets(proxy)) >= 8  # it kept polling
    # one version: read by the poll and by the sync that refuses it, then only conditional reads (304)
    assert len(bodies) <= 2 and all(n == len(doc) for n in bodies), manifest_gets(proxy)
    assert sum(w.failures.values()) == 1, w.failures
    assert "JSON elements" in str(w.last_error) and "manifest.json" in str(w.last_error), w.last_error
    # refused before json.loads built its ~2.8M objects (~200 MiB): copies of the bytes and their text (~60 MB)
    assert peak < 12 * len(doc), peak


def test_status_fleet_escapes_what_a_region_document_says(file_run, capsys):
    store = open_store(file_run.url)
    evil = "\x1b]0;owned\x07\x1b[2J\u202e"
    doc = {"format": fleet.REGION_FORMAT, "version": fleet.VERSION, "region": "eu", "url": "s3://eu" + evil,
           "updated": time.time(), "interval": 15.0, "hosts": [], "truncated": False,
           "bad": [{"where": "fleet/hosts/x.json" + evil, "error": "broken" + evil}]}
    store.commit_object(fleet.region_key("eu"), json.dumps(doc).encode(), None)
    store.commit_object(fleet.host_key("h" + "x"), ("{\"host\": \"" + evil + "\"}").encode(), None)
    assert cli.main(["status", "--fleet", file_run.url, "--hosts"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "bad entry" in text and "broken" in text
    assert "\\x1b]0;owned\\x07" in text  # shown, as its escape
    assert not any(c in text for c in "\x1b\x07\u202e"), repr(text)
