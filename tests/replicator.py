"""A test stand-in for S3 Cross-Region Replication between two moto buckets.

moto stores a replication configuration but never replicates, so tests run this instead. It
behaves as CRR is documented to, at its least convenient: every new or overwritten object is
copied asynchronously and late, in no particular order, except that a changed manifest is sent
first, so a replica regularly shows a manifest naming objects it does not have yet. Deletes are
not replicated (as with delete marker replication off, infra/README.md). With `prefixes` it copies
only keys under them, as S3 replication rules with prefix filters do (infra/replication.tf: the
run's deltas/, records/ and manifest.json, never snapshots/ or regional/); `traffic` counts the
bytes it copied by kind (relay.traffic), keys taken relative to `run_prefix`.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from relay.traffic import Traffic


class Replicator:
    """Copies src bucket -> dst bucket in a background thread: manifest first, the rest shuffled, each delayed."""

    def __init__(self, src_client: Any, src_bucket: str, dst_client: Any, dst_bucket: str, *, seed: int = 0,
                 max_delay: float = 0.05, poll: float = 0.02, prefixes: tuple[str, ...] | None = None,
                 run_prefix: str = "") -> None:
        self.src, self.src_bucket = src_client, src_bucket
        self.dst, self.dst_bucket = dst_client, dst_bucket
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.poll = poll
        self.copied = 0
        self.prefixes, self.run_prefix = prefixes, run_prefix
        self.traffic = Traffic()
        self.manifest_ahead = 0  # times the replica's manifest named an object the replica lacked
        self._etags: dict[str, str] = {}
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _listing(self) -> dict[str, str]:
        out = {}
        for page in self.src.get_paginator("list_objects_v2").paginate(Bucket=self.src_bucket):
            out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])
                        if self.prefixes is None or o["Key"].startswith(self.prefixes)})
        return out

    def _copy(self, key: str) -> None:
        body = self.src.get_object(Bucket=self.src_bucket, Key=key)["Body"].read()
        self.dst.put_object(Bucket=self.dst_bucket, Key=key, Body=body)
        self.copied += 1
        self.traffic.add(key.removeprefix(self.run_prefix), len(body))

    def _dst_keys(self) -> set[str]:
        out: set[str] = set()
        for page in self.dst.get_paginator("list_objects_v2").paginate(Bucket=self.dst_bucket):
            out.update(o["Key"] for o in page.get("Contents", []))
        return out

    def _round(self) -> bool:
        """One pass over the source; True if anything was copied."""
        import json

        listing = self._listing()
        changed = [k for k, etag in listing.items() if self._etags.get(k) != etag]
        if not changed:
            return False
        manifests = [k for k in changed if k.endswith("manifest.json")]
        others = [k for k in changed if k not in manifests]
        self.rng.shuffle(others)
        for key in manifests:
            self._copy(key)
            self._etags[key] = listing[key]
            prefix = key[: -len("manifest.json")]
            named = set()
            doc = json.loads(self.dst.get_object(Bucket=self.dst_bucket, Key=key)["Body"].read())
            for s in doc["steps"]:
                named.add(s["record"]["key"])
                named.update(p["key"] for p in s["parts"] or ())
            for snap in doc["snapshots"]:
                named.add(snap["index"]["key"])
                named.update(f["key"] for f in snap["files"])
            named = {prefix + k for k in named}
            if self.prefixes is not None:
                named = {k for k in named if k.startswith(self.prefixes)}
            if named - self._dst_keys():
                self.manifest_ahead += 1
        for key in others:
            time.sleep(self.rng.uniform(0, self.max_delay))
            self._copy(key)
            self._etags[key] = listing[key]
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._round():
                    self._idle.set()
                    self._stop.wait(self.poll)
                else:
                    self._idle.clear()
        except BaseException as exc:  # noqa: BLE001 - surfaced by stop()/drain() in the test thread
            self.error = exc
            self._idle.set()

    def start(self) -> "Replicator":
        self._thread = threading.Thread(target=self._loop, daemon=True, name="replicator")
        self._thread.start()
        return self

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until a pass finds nothing left to copy."""
        deadline = time.monotonic() + timeout
        self._idle.clear()
        while not self._idle.wait(0.05):
            if time.monotonic() > deadline:
                raise TimeoutError("replicator did not catch up")
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.error is not None:
            raise self.error
