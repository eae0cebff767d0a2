"""`deltarelay encode | decode | inspect`: checkpoint deltas from the command line.

BASE and TARGET are a `.safetensors` file or a directory (Hugging Face shards with
`model.safetensors.index.json`, or one `model.safetensors`). decode writes OUT in BASE's layout.
Every output is written under a temporary name and renamed at the end, so a refused delta or a
crash leaves no OUT behind; errors propagate to `relay.cli.main`, which prints one line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import codec
from codec import container
from relay import checkpoint
from relay.cli_options import shown
from relay.files import write_atomic

_ROW_KEYS = {"name", "dtype", "shape", "method", "changed", "changed_fraction", "bytes", "streams"}


def _save_like_base(tensors: dict, out: Path, base: Path, layout: checkpoint.Layout) -> None:
    """Write `tensors` at `out` in the layout `base` had: a file, a shard directory, or a
    directory holding one `model.safetensors`."""
    if not (base.is_dir() and not layout.sharded):
        checkpoint.save(tensors, out, layout)
        return
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        checkpoint.save(tensors, out / checkpoint.SINGLE_NAME, layout)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _encode(args: argparse.Namespace) -> int:
    base, _ = checkpoint.load(args.base)
    target, _ = checkpoint.load(args.target)
    payload = codec.encode(base, target, effort=args.effort, format_version=args.format_version)
    write_atomic(Path(args.out), payload)
    info = codec.describe(payload)
    raw = sum(t.numel() * t.element_size() for t in target.values())
    share = f"{100 * len(payload) / raw:.4f}% of" if raw else "vs"
    print(f"{args.out}: {len(payload):,} bytes, {share} the target's {raw:,} bytes; "
          f"{info['changed']:,} of {info['elements']:,} elements changed")
    return 0


def _decode(args: argparse.Namespace) -> int:
    base_path = Path(args.base)
    base, layout = checkpoint.load(base_path)
    payload = Path(args.delta).read_bytes()
    target = codec.decode(base, payload)  # verified; raises DeltaError before anything is written
    _save_like_base(target, Path(args.out), base_path, layout)
    print(f"{args.out}: {len(target)} tensors verified against the delta's target digests")
    return 0


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _inspect(args: argparse.Namespace) -> int:
    payload = Path(args.delta).read_bytes()
    base = checkpoint.load(args.base)[0] if args.base else None
    info = codec.describe(payload, base=base)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [["tensor", "dtype", "shape", "changed", "method", "bytes", "streams (bytes)", "extra"]]
    per_stream: dict[str, int] = {}
    for r in info["tensors"]:
        for name, n in r["streams"].items():
            per_stream[name] = per_stream.get(name, 0) + n
        extra = {k: v for k, v in r.items() if k not in _ROW_KEYS}
        rows.append([shown(r["name"]), r["dtype"], "x".join(map(str, r["shape"])) or "()",
                     f"{100 * r['changed_fraction']:.4f}%", r["method"], f"{r['bytes']:,}",
                     _fmt(r["streams"]) or "-", _fmt(extra)])
    changed = info["changed"] / info["elements"] if info["elements"] else 0.0
    rows.append(["TOTAL", "", "", f"{100 * changed:.4f}%", "", f"{info['body_bytes']:,}", _fmt(per_stream) or "-", ""])
    print(f"{args.delta}: format v{info['format_version']}, {len(info['tensors'])} tensors, "
          f"{info['changed']:,} of {info['elements']:,} elements changed")
    print(_table(rows))
    print(f"total {info['total_bytes']:,} bytes = body {info['body_bytes']:,} "
          f"+ index/header {info['overhead_bytes']:,}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("encode", help="write the delta that turns BASE into TARGET")
    p.add_argument("base", metavar="BASE", help=".safetensors file or shard directory")
    p.add_argument("target", metavar="TARGET", help=".safetensors file or shard directory")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="delta file to write")
    p.add_argument("--effort", choices=("fast", "default", "max"), default="default",
                   help="encode time against size (default: %(default)s)")
    p.add_argument("--format-version", type=int, choices=container.SUPPORTED_VERSIONS, default=codec.FORMAT_VERSION,
                   help="payload format version to write (default: %(default)s)")
    p.set_defaults(func=_encode)

    p = subparsers.add_parser("decode", help="rebuild TARGET from BASE and a delta, verified, in BASE's layout")
    p.add_argument("base", metavar="BASE", help=".safetensors file or shard directory")
    p.add_argument("delta", metavar="DELTA", help="delta file written by encode")
    p.add_argument("-o", "--out", required=True, metavar="OUT",
                   help="checkpoint to write (file or directory, like BASE)")
    p.set_defaults(func=_decode)

    p = subparsers.add_parser("inspect", help="per tensor: dtype, shape, changed fraction, method, bytes per stream")
    p.add_argument("delta", metavar="DELTA", help="delta file")
    p.add_argument("--base", metavar="BASE", help="the base it applies to: also decode, verify, and split v2 bits per "
                                                  "change into mask and values")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
