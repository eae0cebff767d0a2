"""`deltarelay status --fleet` and `deltarelay wait-fleet`: the fleet ledger (relay.fleet) from the command line.

The first URL is the run the fleet is measured against (its manifest gives the head and the run id);
every URL is searched for host entries and for the regions a relay gathered there, so a trainer's
origin store is enough behind a relay, and regional stores are added for CRR setups without one.
"""

from __future__ import annotations

import argparse
import json
import sys

from relay import fleet
from relay.cli_options import add_storage_options, shown, storage_options
from relay.manifest import Manifest
from relay.store import Store, open_store


def _stores(urls: list[str], given: list[str] | None) -> list[Store]:
    given = given or []
    if len(given) > 1 and len(given) != len(urls):
        raise ValueError(f"{len(given)} --storage-options for {len(urls)} URLs: give one, or one per URL")
    return [open_store(u, storage_options(given[i] if len(given) > 1 else (given[0] if given else None)))
            for i, u in enumerate(urls)]


def _head(store: Store) -> tuple[int | None, str | None, str | None]:
    """(head, run, problem) of the store's manifest."""
    try:
        got = store.read_manifest()
        if got is None:
            return None, None, f"{store.url}/manifest.json: no run here"
        m = Manifest.parse(got.data, f"{store.url}/manifest.json")
        return m.head, m.run, None
    except Exception as exc:  # noqa: BLE001 - the fleet is shown anyway, without a head to compare with
        return None, None, f"{store.url}/manifest.json: {exc}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else (f"{seconds / 60:.0f}m" if seconds < 7200 else
                                                    f"{seconds / 3600:.0f}h")


def fleet_status(args: argparse.Namespace) -> int:
    """`status --fleet URL...`: per region, how many hosts hold each step, their lag and staleness."""
    stores = _stores(args.urls, args.storage_options)
    head, run, problem = _head(stores[0])
    summary = fleet.summarize(fleet.read_fleet(stores), head=head, run=run, ttl=args.ttl)
    if problem:
        summary["problems"].insert(0, problem)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(shown(f"{stores[0].url}: run {run or '?'} head {head if head is not None else '?'}"))
    print(f"{'region':24} {'hosts':>5} {'ok':>4} {'behind':>6} {'stale':>5} {'bad':>4} {'max lag':>7} "
          f"{'oldest':>6}  steps held (hosts)")
    for name, r in summary["regions"].items():
        steps = " ".join(f"{s}:{n}" for s, n in r["steps"].items()) or "-"
        lag = "-" if r["max_lag_steps"] is None else str(r["max_lag_steps"])
        gathered = f"  (gathered {_age(r['gathered_age_s'])} ago)" if "gathered_age_s" in r else ""
        print(shown(f"{shown(name)[:24]:24} {r['hosts']:>5} {r['ok']:>4} {r['behind'] + r['other-run']:>6} "
                    f"{r['stale']:>5} {r['bad']:>4} {lag:>7} {_age(r['oldest_report_s']):>6}  {steps}{gathered}"))
    for row in summary["hosts"]:
        if row["state"] == "bad":
            print(shown(f"bad entry {row['where']}: {row['error']}"))
        elif row["state"] != "ok" and args.verbose_hosts:
            print(shown(f"{row['state']:9} {row['host']} ({row['region']}): step {row['step']}, reported "
                        f"{_age(row['age_s'])} ago{'; ' + row['last_error'] if row['last_error'] else ''}"))
    for p in summary["problems"]:
        print(shown(f"problem: {p}"), file=sys.stderr)
    return 0


def _wait(args: argparse.Namespace) -> int:
    stores = _stores(args.urls, args.storage_options)
    head, run, problem = _head(stores[0])
    if run is None:
        raise ValueError(problem or f"{stores[0].url}: no run")
    step = head if args.step is None else args.step
    if step is None:
        raise ValueError(f"{stores[0].url}: no head to wait for")
    try:
        progress = fleet.wait_for_fleet(stores, step, args.fraction, args.timeout, run=run, ttl=args.ttl,
                                        poll_interval=args.poll_interval, min_hosts=args.min_hosts)
    except fleet.FleetTimeout as exc:
        if args.json:
            print(json.dumps({"reached": False, **_progress(exc.progress)}, indent=1))
        print(shown(f"deltarelay wait-fleet: {exc}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"reached": True, **_progress(progress)}, indent=1))
    else:
        print(f"step {step}: {progress.holding} of {progress.live} live host(s) hold it "
              f"({progress.stale} stale, {progress.bad} bad)")
    return 0


def _progress(p: fleet.FleetProgress) -> dict:
    return {"step": p.step, "fraction": p.fraction, "live": p.live, "holding": p.holding, "stale": p.stale,
            "bad": p.bad, "lagging": [{k: r[k] for k in ("host", "region", "step", "run", "age_s", "state")}
                                      for r in p.lagging]}


def add_fleet_status(p: argparse.ArgumentParser) -> None:
    """The `status` options of the fleet view."""
    p.add_argument("--fleet", action="store_true",
                   help="the fleet ledger instead: per region, how many hosts hold each step, lag and staleness "
                        "(the first URL's manifest gives the head; every URL is searched for host entries and "
                        "for regions a relay gathered)")
    p.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="with --fleet: a host not heard from for S seconds is stale (default: 3 heartbeats + 10 s)")
    p.add_argument("--hosts", dest="verbose_hosts", action="store_true",
                   help="with --fleet: also list every host that is not at the head")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wait-fleet", help="wait until a fraction of the rollout fleet holds a step "
                                                 "(bounded staleness)")
    p.add_argument("urls", nargs="+", metavar="URL", help="the run (first) and any regional stores to read directly")
    p.add_argument("--step", type=int, default=None, help="the step to wait for (default: the head)")
    p.add_argument("--fraction", type=float, default=1.0, metavar="F", help="of the live hosts (default 1.0)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="give up after S seconds (exit 2, naming the hosts that lag)")
    p.add_argument("--min-hosts", type=int, default=1, metavar="N", help="at least N live hosts must hold it")
    p.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="a host not heard from for S seconds is stale and counts neither way (default: 3 of its "
                        "heartbeats + 10 s)")
    p.add_argument("--poll-interval", type=float, default=2.0, metavar="S")
    p.add_argument("--json", action="store_true")
    add_storage_options(p, many=True)
    p.set_defaults(func=_wait)
