"""Payload size of codec versions on corpora, and one-core speed against zstd-1 (issue #18).

For each corpus, consecutive pairs (or step t -> t + span): bytes and percent of the BF16
checkpoint of every version asked for, each round trip checked bit-exact; then, on one pair,
median encode and decode MB/s of each version with one thread, each run paired with a zstd-1
compression of the raw target timed just before it (the bench's yardstick).

    python scripts/compare_versions.py corpus/minilm-fp32-lr1e-6 --span 4 --versions 3 4 [--arcv3]

`--arcv3` also sizes Fireworks' real ARCv3 (PyPI `fireworks-delta-compression`, backend `arc_v3`,
every raced candidate allowed to finish, so it returns its smallest) on the same pairs: the
safetensors file its `delta_compress_dicts_to_file` writes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import codec  # noqa: E402


def _exact(out: dict, target: dict) -> bool:
    return all(torch.equal(out[k].view(torch.uint8) if out[k].dim() else out[k].reshape(1).view(torch.uint8),
                           target[k].view(torch.uint8) if target[k].dim() else target[k].reshape(1).view(torch.uint8))
               for k in target)


def arcv3_bytes(base: dict, target: dict) -> int:
    """Bytes of the real ARCv3's delta file for a pair, every candidate allowed to finish."""
    import os
    import tempfile

    os.environ["ARC3_CANDIDATE_WAIT_MULTIPLIER"] = "1e9"  # read at import: set before it
    from fireworks_delta_compression import delta_compress_dicts_to_file  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "delta.safetensors")
        delta_compress_dicts_to_file(src=base, dst=target, diff_file=path, compression_format="arc_v3")
        return os.path.getsize(path)


def sizes(corpus: Path, span: int, pairs: int, versions: list[int], arcv3: bool = False) -> list[dict]:
    files = sorted(corpus.glob("step_*.safetensors"))
    rows = []
    for t in range(min(pairs, len(files) - span)):
        base, target = load_file(str(files[t])), load_file(str(files[t + span]))
        raw = sum(v.numel() * v.element_size() for v in target.values())
        row = {"pair": f"{files[t].stem}->{files[t + span].stem}", "raw_bytes": raw}
        for v in versions:
            payload = codec.encode(base, target, format_version=v)
            if not _exact(codec.decode(base, payload), target):
                raise SystemExit(f"{corpus.name} {row['pair']}: v{v} does not round-trip")
            row[f"v{v}"] = len(payload)
        if arcv3:
            row["arcv3"] = arcv3_bytes(base, target)
        rows.append(row)
    return rows


def speeds(corpus: Path, span: int, versions: list[int], runs: int) -> dict:
    torch.set_num_threads(1)
    files = sorted(corpus.glob("step_*.safetensors"))
    base, target = load_file(str(files[0])), load_file(str(files[span]))
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in target.values())
    mb = len(raw) / 1e6
    z = zstandard.ZstdCompressor(level=1)
    out = {}
    for v in versions:
        payload = codec.encode(base, target, format_version=v, workers=1)  # warm: kernels compiled
        codec.decode(base, payload, workers=1)
        enc, dec = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            z.compress(raw)
            tz = time.perf_counter() - t0
            t0 = time.perf_counter()
            payload = codec.encode(base, target, format_version=v, workers=1)
            te = time.perf_counter() - t0
            t0 = time.perf_counter()
            z.compress(raw)
            tz2 = time.perf_counter() - t0
            t0 = time.perf_counter()
            codec.decode(base, payload, workers=1)
            td = time.perf_counter() - t0
            enc.append((te, tz / te))
            dec.append((td, tz2 / td))
        out[f"v{v}"] = {"encode_mbps": mb / float(np.median([e[0] for e in enc])),
                        "decode_mbps": mb / float(np.median([d[0] for d in dec])),
                        "encode_vs_zstd1": float(np.median([e[1] for e in enc])),
                        "decode_vs_zstd1": float(np.median([d[1] for d in dec]))}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpora", nargs="+", type=Path)
    p.add_argument("--span", type=int, default=1)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--versions", type=int, nargs="+", default=[3, 4])
    p.add_argument("--speed-runs", type=int, default=0, help="timed runs per version on the first pair (0: none)")
    p.add_argument("--arcv3", action="store_true", help="also size the real ARCv3 on the same pairs")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    report = []
    for c in a.corpora:
        rows = sizes(c, a.span, a.pairs, a.versions, a.arcv3)
        raw = sum(r["raw_bytes"] for r in rows)
        total = {f"v{v}": sum(r[f"v{v}"] for r in rows) for v in a.versions}
        line = ", ".join(f"v{v} {100 * total[f'v{v}'] / raw:.4f}%" for v in a.versions)
        last = a.versions[-1]
        rel = " ".join(f"v{last}/v{v} {total[f'v{last}'] / total[f'v{v}']:.4f}" for v in a.versions[:-1])
        if a.arcv3:
            arc = sum(r["arcv3"] for r in rows)
            total["arcv3"] = arc
            rel += f"; real ARCv3 {100 * arc / raw:.4f}%, " + " ".join(
                f"v{v}/ARCv3 {total[f'v{v}'] / arc:.4f}" for v in a.versions)
        print(f"{c.name} span {a.span}, {len(rows)} pairs: {line} of BF16; {rel}")
        entry = {"corpus": c.name, "span": a.span, "pairs": rows, "total": total}
        if a.speed_runs:
            entry["speed"] = speeds(c, a.span, a.versions, a.speed_runs)
            for v, s in entry["speed"].items():
                print(f"  {v}: encode {s['encode_mbps']:.0f} MB/s ({s['encode_vs_zstd1']:.2f}x zstd-1), "
                      f"decode {s['decode_mbps']:.0f} MB/s ({s['decode_vs_zstd1']:.2f}x zstd-1)")
        report.append(entry)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
