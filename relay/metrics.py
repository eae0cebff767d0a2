"""Prometheus metrics of a watcher and of a regional relay (prometheus_client), read from their state at
scrape time, so the sync and copy paths carry no metric code; only the engine's pause per update, a
histogram, is observed as it happens (after each sync).

Watcher: deltarelay_watcher_{held_step, head_step, lag_steps, lag_seconds, step_timestamp_seconds,
bytes_downloaded_total, failures_total{reason}, ledger_writes_total, engine_pause_seconds}.
Relay: deltarelay_relay_{origin_head_step, region_head_step, region_lag_steps, region_lag_seconds,
region_copied_bytes_total, region_copied_objects_total, region_errors_total, region_failing,
source_read_bytes_total, fleet_hosts{state}, fleet_gather_errors_total}. Labels: `host` on the
watcher's (several watchers may share a registry), `region` on the relay's.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from relay.fanout import Fanout
    from relay.watcher import Watcher

PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def lag_seconds(heads_seen: dict[int, float], held: int | None, now: float | None = None) -> float:
    """Seconds since the oldest head newer than `held` was first seen (0 when nothing newer was seen)."""
    newer = [t for h, t in heads_seen.items() if held is None or h > held]
    return max(0.0, (time.time() if now is None else now) - min(newer)) if newer else 0.0


class _Served:
    """A registry and, once serve() is called, the HTTP server exposing it."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._server: Any = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on addr:port (0: a free port); returns the port bound."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _WatcherCollector(Collector):
    def __init__(self, watcher: "Watcher", host: str) -> None:
        self.watcher = weakref.ref(watcher)  # the watcher holds us: no cycle, so a dropped one is freed at once
        self.host = host

    def collect(self) -> Iterator[Metric]:
        w = self.watcher()
        if w is None:
            return
        labels = [self.host]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                g = GaugeMetricFamily(f"deltarelay_watcher_{name}", doc, labels=["host"])
                g.add_metric(labels, value)
                yield g

        step, head = w.step, w.reader.head_seen
        yield from gauge("held_step", "step DEST holds", step)
        yield from gauge("head_step", "head of the last manifest read", head)
        lag = None if head is None else (head + 1 if step is None else max(head - step, 0))
        yield from gauge("lag_steps", "head seen minus step held (head + 1 with no step)", lag)
        yield from gauge("lag_seconds", "seconds since a head newer than the held step was first seen",
                         lag_seconds(w.reader.heads_seen, step))
        since = w.fleet.last_report.step_since if w.fleet is not None and w.fleet.last_report is not None else None
        yield from gauge("step_timestamp_seconds", "unix time the held step was reached", since)
        c = CounterMetricFamily("deltarelay_watcher_bytes_downloaded", "bytes read from the store", labels=["host"])
        c.add_metric(labels, w.bytes_downloaded)
        yield c
        f = CounterMetricFamily("deltarelay_watcher_failures", "failures by reason (failed syncs, objects that failed "
                                "a check, ledger writes)", labels=["host", "reason"])
        counts = w.failure_counts()
        if w.fleet is not None:
            counts["ledger"] = w.fleet.failures
        for reason in ("timeout", "sync", "hotload", "store", "poll", "verify", "ledger", "other"):
            counts.setdefault(reason, 0)
        for reason, n in sorted(counts.items()):
            f.add_metric([self.host, reason], n)
        yield f
        if w.fleet is not None:
            c = CounterMetricFamily("deltarelay_watcher_ledger_writes", "fleet ledger entries written",
                                    labels=["host"])
            c.add_metric(labels, w.fleet.writes)
            yield c


class WatcherMetrics(_Served):
    """A watcher's metrics in `registry` (a fresh one by default); `serve(port)` exposes them over HTTP."""

    def __init__(self, watcher: "Watcher", registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.host = watcher.fleet.host if watcher.fleet is not None else str(watcher.dest)
        self.registry.register(_WatcherCollector(watcher, self.host))
        self.pause = Histogram("deltarelay_watcher_engine_pause_seconds", "engine pause per weight update",
                               labelnames=["host"], buckets=PAUSE_BUCKETS, registry=self.registry)
        self._seen: tuple | None = None
        watcher.listeners.append(self.after_sync)

    def after_sync(self, watcher: "Watcher") -> None:
        """Observe the engine's last pause once per update (its step or weight version changed)."""
        state = watcher._engine_state()
        if not isinstance(state, dict):
            return
        pause = state.get("last_pause_s")
        mark = (state.get("step"), state.get("weight_version"))
        if isinstance(pause, (int, float)) and not isinstance(pause, bool) and pause >= 0 and mark != self._seen:
            self._seen = mark
            self.pause.labels(self.host).observe(float(pause))


class _FanoutCollector(Collector):
    def __init__(self, fanout: "Fanout") -> None:
        self.fanout = weakref.ref(fanout)

    def collect(self) -> Iterator[Metric]:
        fan = self.fanout()
        if fan is None:
            return
        st = fan.status()
        origin = st["origin"]
        g = GaugeMetricFamily("deltarelay_relay_origin_head_step", "head of the origin manifest")
        if origin is not None:
            g.add_metric([], origin["head"])
        yield g
        c = CounterMetricFamily("deltarelay_relay_source_read_bytes", "bytes read from the origin")
        c.add_metric([], st["source_bytes_read"])
        yield c
        gauges = {k: GaugeMetricFamily(f"deltarelay_relay_region_{k}", doc, labels=["region"]) for k, doc in (
            ("head_step", "head of the regional manifest"), ("lag_steps", "origin head minus regional head"),
            ("lag_seconds", "seconds since the oldest origin head the region lacks was seen"),
            ("failing", "failed attempts in a row"))}
        counters = {k: CounterMetricFamily(f"deltarelay_relay_region_{k}", doc, labels=["region"]) for k, doc in (
            ("copied_bytes", "bytes written to the region"), ("copied_objects", "objects written to the region"),
            ("errors", "failed sync attempts"))}
        for name, r in st["regions"].items():
            for key, field in (("head_step", "head"), ("lag_steps", "lag_steps"), ("lag_seconds", "lag_seconds"),
                               ("failing", "failures")):
                if r[field] is not None:
                    gauges[key].add_metric([name], r[field])
            for key, field in (("copied_bytes", "bytes_copied"), ("copied_objects", "objects_copied"),
                               ("errors", "errors")):
                counters[key].add_metric([name], r[field])
        yield from gauges.values()
        yield from counters.values()
        fleet = st.get("fleet")
        if fleet:
            hosts = GaugeMetricFamily("deltarelay_relay_fleet_hosts", "ledger entries gathered per region",
                                      labels=["region", "state"])
            errors = CounterMetricFamily("deltarelay_relay_fleet_gather_errors", "failed gatherings of a region's "
                                         "ledger", labels=["region"])
            for name, f in fleet.items():
                hosts.add_metric([name, "valid"], f["hosts"])
                hosts.add_metric([name, "bad"], f["bad"])
                errors.add_metric([name], f["errors"])
            yield hosts
            yield errors


class FanoutMetrics(_Served):
    """A regional relay's metrics in `registry` (a fresh one by default); `serve(port)` exposes them."""

    def __init__(self, fanout: "Fanout", registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.registry.register(_FanoutCollector(fanout))


__all__ = ["WatcherMetrics", "FanoutMetrics", "lag_seconds", "PAUSE_BUCKETS"]
