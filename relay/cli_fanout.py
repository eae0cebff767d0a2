"""`deltarelay relay`: the regional relay process.

    deltarelay relay --source s3://origin/runs/r --dest s3://eu/runs/r --dest s3://ap/runs/r
    deltarelay relay --config relay.toml [--once --timeout 600]
    deltarelay relay --source s3://origin/runs/r --dest s3://eu/runs/r --regional-snapshots --workdir /var/lib/relay

A config file names each store with its own fsspec options (regions sit behind different endpoints):

    [source]
    url = "s3://acme-origin-us-east-1/runs/grpo"
    storage_options = { client_kwargs = { region_name = "us-east-1" } }

    [[dest]]
    name = "eu-west-1"
    url = "s3://acme-eu-west-1/runs/grpo"
    storage_options = { client_kwargs = { region_name = "eu-west-1" } }
"""

from __future__ import annotations

import argparse
import tomllib
import json
import os
import sys
import tempfile
from pathlib import Path

from relay import fleet
from relay.cli_options import add_metrics, add_trusted_key, shown, storage_options
from relay.fanout import Destination, Fanout


def _dest_name(url: str, used: set[str]) -> str:
    """A unique name for a destination given only by URL: its bucket, or the whole URL for local paths."""
    scheme, _, rest = url.partition("://")
    stem = rest.strip("/").split("/")[0] if rest and scheme not in ("file", "local", "") else url.rstrip("/")
    name, i = stem, 2
    while name in used:
        name, i = f"{stem}-{i}", i + 1
    used.add(name)
    return name


def _table_options(value: object, where: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.storage_options must be a table")
    return value


def load_config(path: str | os.PathLike) -> tuple[str, dict | None, list[Destination]]:
    """(source url, source options, destinations) from a TOML file; errors name the file and the field."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the relay config: {exc}") from None
    unknown = set(doc) - {"source", "dest"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)} (expected [source] and [[dest]])")
    src = doc.get("source")
    if not isinstance(src, dict) or not isinstance(src.get("url"), str):
        raise ValueError(f"{path}: [source] with a url is required")
    dests = doc.get("dest")
    if not isinstance(dests, list) or not dests:
        raise ValueError(f"{path}: at least one [[dest]] table with a url is required")
    out: list[Destination] = []
    used: set[str] = set()
    for i, d in enumerate(dests):
        where = f"{path}: dest[{i}]"
        if not isinstance(d, dict) or not isinstance(d.get("url"), str):
            raise ValueError(f"{where}: url is required")
        extra = set(d) - {"name", "url", "storage_options"}
        if extra:
            raise ValueError(f"{where}: unknown field(s) {sorted(extra)}")
        name = d.get("name") or _dest_name(d["url"], used)
        if name in used and d.get("name"):
            raise ValueError(f"{where}: name {name!r} is used twice")
        used.add(name)
        out.append(Destination(name, d["url"], _table_options(d.get("storage_options"), where)))
    extra = set(src) - {"url", "storage_options"}
    if extra:
        raise ValueError(f"{path}: [source] has unknown field(s) {sorted(extra)}")
    return src["url"], _table_options(src.get("storage_options"), f"{path}: source"), out


def _from_args(args: argparse.Namespace) -> tuple[str, dict | None, list[Destination]]:
    if args.config:
        if args.source or args.dest or args.storage_options:
            raise ValueError("--config names the stores; do not combine it with --source, --dest or --storage-options")
        return load_config(args.config)
    if not args.source or not args.dest:
        raise ValueError("give --source URL and at least one --dest URL, or --config FILE")
    urls = [args.source, *args.dest]
    given = args.storage_options or []
    if len(given) > 1 and len(given) != len(urls):
        raise ValueError(f"{len(given)} --storage-options for {len(urls)} URLs (source first, then each --dest): "
                         f"give one for all, or one per URL")
    opts = [storage_options(given[i] if len(given) > 1 else (given[0] if given else None)) for i in range(len(urls))]
    used: set[str] = set()
    dests = [Destination(_dest_name(u, used), u, o) for u, o in zip(args.dest, opts[1:])]
    return args.source, opts[0], dests


def _status_writer(path: str | None):
    if path is None:
        return None
    target = Path(path)

    def write(status: dict) -> None:  # atomic, so a monitor never reads half a file
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".status-", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, target)

    return write


def _relay(args: argparse.Namespace) -> int:
    source, source_options, dests = _from_args(args)
    if args.regional_snapshots and not args.workdir:
        raise ValueError("--regional-snapshots needs --workdir DIR (where each region's materialiser spools snapshots)")
    fan = Fanout(source, dests, source_options=source_options, poll_interval=args.poll_interval,
                 workers=args.workers, retry_max=args.retry_max, trusted_keys=args.trusted_key,
                 replace_runs=True if args.replace_run else None, regional_snapshots=args.regional_snapshots,
                 workdir=args.workdir, materialise_every=args.materialise_every, materialise_keep=args.materialise_keep,
                 fleet_interval=None if args.no_fleet else args.fleet_interval, metrics_port=args.metrics_port,
                 metrics_addr=args.metrics_addr)
    if fan.metrics_port is not None:
        print(f"metrics on http://{args.metrics_addr}:{fan.metrics_port}/metrics", file=sys.stderr, flush=True)
    try:
        return _relay_with(fan, args)
    finally:
        fan.close()


def _relay_with(fan: Fanout, args: argparse.Namespace) -> int:
    on_status = _status_writer(args.status_file)
    if not args.once:
        try:
            fan.run(status_every=args.status_every, on_status=on_status)
        except KeyboardInterrupt:
            fan.stop()
        return 0
    ok = fan.sync_once(timeout=args.timeout, on_status=on_status)
    st = fan.status()
    head = st["origin"]["head"] if st["origin"] else None
    for name, r in st["regions"].items():
        state = "REFUSED" if r["run_refused"] else (
            "ok" if r["head"] is not None and head is not None and r["head"] >= head else "BEHIND")
        err = f"  last error: {r['last_error']}" if r["last_error"] and state != "ok" else ""
        print(shown(f"{name:20} head {r['head']!s:>6} / {head!s:<6} {state:6} {r['bytes_copied']:>12} bytes copied"
                    f"{err}"))
    if not ok:
        print(f"deltarelay relay: not every destination reached step {head}"
              f"{f' within {args.timeout:g}s' if args.timeout is not None else ''}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("relay", help="mirror a run from the origin store into regional stores")
    p.add_argument("--source", metavar="URL", help="the origin run prefix (where the trainer publishes)")
    p.add_argument("--dest", action="append", metavar="URL", help="a regional run prefix (repeat per region)")
    p.add_argument("--config", metavar="FILE", help="TOML: [source] url, storage_options; [[dest]] name, url, "
                                                     "storage_options")
    p.add_argument("--storage-options", action="append", metavar="JSON",
                   help="fsspec options as JSON: once for every URL, or once per URL (source first, then each --dest)")
    p.add_argument("--once", action="store_true", help="bring every destination to the origin head, then exit "
                                                       "(0 only if all got there)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="with --once: give up after S seconds")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S", help="origin manifest poll interval")
    p.add_argument("--workers", type=int, default=4, help="parallel object copies per destination")
    p.add_argument("--retry-max", type=float, default=30.0, metavar="S", help="longest backoff of a failing region")
    p.add_argument("--status-file", metavar="PATH", help="keep per-region lag and bytes in this JSON file")
    p.add_argument("--status-every", type=float, default=30.0, metavar="S", help="log per-region lag this often")
    p.add_argument("--fleet-interval", type=float, default=fleet.DEFAULT_AGGREGATE_INTERVAL, metavar="S",
                   help="gather each region's fleet ledger (fleet/hosts/) into the origin's fleet/regions/ this often")
    p.add_argument("--no-fleet", action="store_true", help="do not gather the fleet ledger")
    add_metrics(p)
    add_trusted_key(p)
    p.add_argument("--replace-run", action="store_true",
                   help="with --trusted-key: let a new run at the origin replace the run a region holds (without it "
                        "such a switch is refused, since a replayed manifest of an older run looks the same; "
                        "without keys runs are always replaced)")
    p.add_argument("--regional-snapshots", action="store_true",
                   help="never copy the origin's snapshots into a region: a materialiser per region builds the "
                        "region's own snapshots from the chain (one origin snapshot crosses, to bootstrap); needs "
                        "--workdir; run the relay in the region it serves (PROTOCOL section 8)")
    p.add_argument("--workdir", metavar="DIR", help="with --regional-snapshots: the materialisers' spool "
                                                     "(one subdirectory per destination)")
    p.add_argument("--materialise-every", type=int, default=None, metavar="N",
                   help="with --regional-snapshots: also snapshot N steps past a region's newest snapshot (default: "
                        "at the origin's snapshot steps only)")
    p.add_argument("--materialise-keep", type=int, default=2, metavar="K",
                   help="with --regional-snapshots: regional snapshots kept per region (default 2)")
    p.set_defaults(func=_relay)
