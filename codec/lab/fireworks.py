"""The real Fireworks anchors: `fireworks-delta-compression` (PyPI, MIT), the compressor Fireworks'
serving stack uses, behind the same `Baseline` shape as codec.lab.baselines' reimplementations.

Why the real package: an ARCv3-style reimplementation (baselines.arcv3) is weaker than ARCv3
itself (which races zstd-1 and bz2-9 over pickled flat and row-wise index streams and codes
mantissas with a 3-bit codebook), so a comparison against it flatters us.

- `arc_v2`: its ARCv2 backend, XOR of old and new bytes, zstd. One codec: nothing races.
- `arc_v3`: its ARCv3 backend with its default race (per tensor, candidates in threads; the first
  to finish sets a deadline of 1.5x its time, later ones are dropped, the smallest kept).
- `arc_v3-all`: the same with every candidate allowed to finish (the package's deadline
  multiplier raised for the call), so the smallest of all is kept: ARCv3's size at its best.

The payload is the safetensors file `delta_compress_dicts_to_file` writes (one uint8 tensor per
model tensor, Adler-32 checksums in its metadata); its bytes are the size. Decoding writes those
bytes to a file and reads it back with the package's `delta_decompress_dict_from_file`, which
checks its checksums; a watcher downloads such a file, so the write is part of its decode.
Scratch files go to /dev/shm where it exists, so that a disk does not time them.

The package is optional (`pip install 'deltarelay[fireworks]'`); `unavailable()` says why it
cannot run, and the bench lists these methods as not run with that reason.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import torch

from codec import check_structure
from codec.lab import baselines as style
from codec.lab.baselines import Baseline

PACKAGE = "fireworks_delta_compression"
DISTRIBUTION = "fireworks-delta-compression"
INSTALL_HINT = "pip install 'deltarelay[fireworks]'"
# Candidate deadline multiplier for `-all`: the wait after the first finisher is its time times
# this. 1e7 turns a 1 us first finisher into 10 s and stays far below threading.TIMEOUT_MAX for
# any first finisher under 15 minutes.
EVERY_CANDIDATE = 1e7
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_deadline_lock = threading.Lock()


def unavailable() -> str | None:
    """Why the real anchors cannot run here (None when they can)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return f"{DISTRIBUTION} is not installed ({INSTALL_HINT})"
    return None


def version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package() -> ModuleType:
    reason = unavailable()
    if reason:
        raise RuntimeError(f"the real Fireworks anchors need {reason}")
    import fireworks_delta_compression

    return fireworks_delta_compression


@contextlib.contextmanager
def _every_candidate() -> Iterator[None]:
    """Let every ARCv3 candidate finish: raise the deadline multiplier its module reads per call."""
    from fireworks_delta_compression.backends import arc3

    if not isinstance(getattr(arc3, "_CANDIDATE_WAIT_MULTIPLIER", None), float):
        raise RuntimeError(f"{DISTRIBUTION} {version()}: backends.arc3 has no _CANDIDATE_WAIT_MULTIPLIER, "
                           "so every candidate cannot be let finish (the adapter knows 0.1.0)")
    with _deadline_lock:
        saved = arc3._CANDIDATE_WAIT_MULTIPLIER
        arc3._CANDIDATE_WAIT_MULTIPLIER = EVERY_CANDIDATE
        try:
            yield
        finally:
            arc3._CANDIDATE_WAIT_MULTIPLIER = saved


def encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], backend: str,
           every_candidate: bool = False) -> bytes:
    """The bytes of the delta file the package writes for `base` -> `target` with `backend`."""
    fdc = _package()
    check_structure(base, target)
    with tempfile.TemporaryDirectory(prefix="fireworks-", dir=_SCRATCH) as tmp:
        path = str(Path(tmp) / "delta.safetensors")
        with _every_candidate() if every_candidate else contextlib.nullcontext():
            fdc.delta_compress_dicts_to_file(src=dict(base), dst=dict(target), diff_file=path,
                                             compression_format=backend)
        return Path(path).read_bytes()


def decode(base: Mapping[str, torch.Tensor], payload: bytes, backend: str) -> dict[str, torch.Tensor]:
    """The target rebuilt by the package's own decoder (its checksums checked), in base order."""
    fdc = _package()
    with tempfile.TemporaryDirectory(prefix="fireworks-", dir=_SCRATCH) as tmp:
        path = Path(tmp) / "delta.safetensors"
        path.write_bytes(payload)
        with warnings.catch_warnings():  # ARCv2 wraps zstd's read-only output in a tensor and torch warns once
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            # it rebinds entries of the dict it is given: a copy keeps the caller's base as it was
            out = fdc.delta_decompress_dict_from_file(src=dict(base), diff_file=str(path),
                                                      compression_format=backend)
    return {k: out[k] for k in base}


def arc_v2_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    return encode(base, target, "arc_v2")


def arc_v2_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    return decode(base, payload, "arc_v2")


def arc_v3_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    return encode(base, target, "arc_v3")


def arc_v3_all_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    return encode(base, target, "arc_v3", every_candidate=True)


def arc_v3_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    return decode(base, payload, "arc_v3")


REFERENCE = "arc_v3"  # the bench's "/ARCv3" column when the package is installed
BASELINES: dict[str, Baseline] = {
    b.key: b
    for b in (
        Baseline("arc_v2", "ARCv2 real (fireworks, XOR+zstd)", arc_v2_encode, arc_v2_decode),
        Baseline("arc_v3", "ARCv3 real (fireworks, default race)", arc_v3_encode, arc_v3_decode),
        Baseline("arc_v3-all", "ARCv3 real (fireworks, every candidate)", arc_v3_all_encode, arc_v3_decode),
    )
}
# The ARCv3-style reimplementations the real package supersedes: run only where it is missing
# (or, beside it, with --slow, to show how far the style one is from the real one).
SUPERSEDED = ("arcv3", "arcv3-max")


def select(slow: bool = False, every_candidate: bool = True) -> tuple[dict[str, Baseline], str, dict[str, str]]:
    """The anchors a comparison runs, the key of its ARCv3 reference, and those it cannot run (key -> why).

    With the package: the real ARCv2/ARCv3 (`every_candidate=False` leaves out arc_v3-all, the
    slow variant Fireworks does not ship) and the style baselines that have no real package
    (TRL, PULSESync, zstd-1), ARCv3 real as the reference. Without it: every style baseline,
    ARCv3-style as the reference, the real ones listed as not run.
    """
    real = {k: b for k, b in BASELINES.items() if every_candidate or k != "arc_v3-all"}
    chosen = dict(style.BASELINES, **(style.SLOW_BASELINES if slow else {}))
    reason = unavailable()
    if reason:
        return chosen, "arcv3", {k: reason for k in real}
    if not slow:
        chosen = {k: b for k, b in chosen.items() if k not in SUPERSEDED}
    return {**real, **chosen}, REFERENCE, {}
