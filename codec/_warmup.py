"""codec.warm_up(): compile the codec's kernels while the caller waits on something else.

Numba compiles a kernel on its first call, and on a fresh host (an empty kernel cache) the first
encode, decode or apply_ paid ~20-50 s of compilation on top of the step itself. A publisher or
watcher calls `warm_up()` in its constructor: the kernels compile in a background thread while
the first snapshot uploads or downloads (a safetensors snapshot runs no kernel; a compressed one
has its own paths, "snapshot_encode" and "snapshot_decode"), so the first delta finds them
ready. Kernels go to numba's on-disk cache (`_kernel_cache`), so on a host whose cache is warm,
warm-up only loads them (~1 s), and processes of one host that warm up the same path take turns
(a file lock in the cache directory): the first compiles, the others then load what it wrote
instead of compiling the same kernels at the same time on the same cores.

Each path ("encode", "decode", "apply_") is a list of steps, callables that run the real entry
point on a tiny checkpoint holding every dtype and method the codec has, so that each kernel is
compiled for the very signatures a real call uses (`kernel_signatures()` before and after a real
call shows nothing compiles later; tests/test_warmup.py checks it in a fresh process). Code that
adds kernels on a new path (a threaded apply_, say) registers a step for it: `register(path, fn)`.
apply_ and decode need a payload: the one embedded here (`PAYLOAD`, made by `encoded()`), so that
a watcher's warm-up compiles no encoder.

What compiles, and what was cut (kernel semantics unchanged): numba compiles every kernel a
kernel calls as well, once per distinct argument types, and a constant argument is typed as a
literal, so `container._uvarint`, called with ten different constant limits, compiled ten times
(now inlined). An array-to-array slice assignment in a kernel compiles numba's shape-mismatch
error path (string formatting, ~3-4 s per process for 1-D and again for 2-D arrays): kernels copy
with loops instead. `conditional._decode` compiled twice, for a read-only empty array (a module
global, which numba freezes) and a writable one, and the payload's streams were read-only or not
as the caller's buffer was: `container.unpack` now views every payload read-only.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import numpy as np
import torch

from . import _kernel_cache

log = logging.getLogger(__name__)

Step = Callable[[], None]
PATHS = ("encode", "decode", "apply_")
_STEPS: dict[str, list[Step]] = {path: [] for path in PATHS}
_FUTURES: dict[str, Future] = {}
_LOCK = threading.Lock()


def register(path: str, step: Step) -> None:
    """Adds a step to a warm-up path (a new path name starts a new path): a callable that runs
    real code on tiny inputs so that every kernel it reaches compiles. A path that already ran in
    this process does not run again; register before the first `warm_up`."""
    with _LOCK:
        _STEPS.setdefault(path, []).append(step)


class WarmUp:
    """A warm-up under way (or done): `wait()` for it; `seconds` and `failed` once it is done."""

    def __init__(self, paths: tuple[str, ...], futures: list[Future]) -> None:
        self.paths = paths
        self._futures = futures
        self._started = time.perf_counter()

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every path is warm (or failed: a failed step only means the first real call
        compiles what it needs, so it is logged, never raised); False if `timeout` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self._futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(left)
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - logged where it happened
                pass
        return True

    @property
    def seconds(self) -> float | None:
        """The longest of its paths' durations, once all are done."""
        if not self.done():
            return None
        return max((f.result()[0] for f in self._futures if f.exception() is None), default=0.0)

    @property
    def failed(self) -> dict[str, BaseException]:
        return {p: exc for p, f in zip(self.paths, self._futures) if f.done() and (exc := f.exception()) is not None}


def warm_up(paths: Iterable[str] | None = None, *, background: bool = True) -> WarmUp:
    """Compile (or load from the on-disk cache) every kernel that `paths` use: "encode",
    "decode", "apply_" (default: all). Idempotent and thread-safe: a path runs once per process,
    later calls share it. In a background thread (exit waits for it) unless `background` is False; returns a handle to
    `wait()` on. A publisher wants ("encode",), a watcher ("apply_", "snapshot_decode")."""
    wanted = tuple(dict.fromkeys(PATHS if paths is None else paths))
    unknown = [p for p in wanted if p not in _STEPS]
    if unknown:
        raise ValueError(f"unknown warm-up path(s) {unknown}; known: {sorted(_STEPS)}")
    fresh: list[tuple[str, Future]] = []
    with _LOCK:
        for path in wanted:
            if path not in _FUTURES:
                _FUTURES[path] = Future()
                fresh.append((path, _FUTURES[path]))
        futures = [_FUTURES[p] for p in wanted]
    if fresh:
        if background:
            # not a daemon: an interpreter that exits mid-compile would kill LLVM's threads and abort
            # ("terminate called without an active exception"); exit waits for the compile instead
            threading.Thread(target=_run, args=(fresh,), name="deltarelay-codec-warmup", daemon=False).start()
        else:
            _run(fresh)
    return WarmUp(wanted, futures)


def _run(paths: list[tuple[str, Future]]) -> None:
    for path, future in paths:
        future.set_running_or_notify_cancel()
        start = time.perf_counter()
        before = _compile_stats()
        try:
            with _host_lock(path):
                waited = time.perf_counter() - start
                for step in list(_STEPS[path]):
                    step()
        except Exception as exc:  # noqa: BLE001 - a failed warm-up costs the first call its compile, no more
            log.warning("codec warm-up of %s failed (the first real call compiles instead): %r", path, exc)
            future.set_exception(exc)
            continue
        seconds = time.perf_counter() - start
        hits, misses = (a - b for a, b in zip(_compile_stats(), before))
        log.info("codec warm-up of %s: %.1f s (%d kernels compiled, %d loaded from the cache; %.1f s waiting for "
                 "another process of this host)", path, seconds, misses, hits, waited)
        future.set_result((seconds, misses, hits))


@contextlib.contextmanager
def _host_lock(path: str) -> Iterator[None]:
    """An exclusive lock, per path, over the kernel cache directory: processes of one host warm
    up one at a time and the later ones load what the first compiled. Best effort: without a
    usable lock file the warm-up runs unlocked."""
    directory = _kernel_cache.used_dir()
    try:
        import fcntl
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / f"warmup-{path.strip('_')}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def kernel_signatures() -> dict[str, tuple]:
    """Every compiled kernel of the codec's modules and the signatures it holds in this process:
    compare before and after a call to see what it compiled."""
    from numba.core.registry import CPUDispatcher
    out: dict[str, tuple] = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "codec" or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, CPUDispatcher):
                out[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = tuple(value.signatures)
    return out


def _compile_stats() -> tuple[int, int]:
    """(cache hits, cache misses) over the codec's kernels so far in this process."""
    from numba.core.registry import CPUDispatcher
    hits = misses = 0
    seen = set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "codec" or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, CPUDispatcher) and id(value) not in seen:
                seen.add(id(value))
                stats = value.stats
                hits += sum(stats.cache_hits.values())
                misses += sum(stats.cache_misses.values())
    return hits, misses


# The tiny checkpoint: every dtype the codec treats differently, each with sparse changes (BF16
# also dense ones, unchanged, and sizes off the scan's block), all from integer hashes (exact on
# every platform, so the embedded payload always matches).

def _hash(n: int, seed: int) -> np.ndarray:
    x = np.arange(n, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


_LAYOUT = (  # name, torch dtype, shape, one change in every `every` elements
    ("bf16.matrix", torch.bfloat16, (64, 64), 100),
    ("bf16.odd", torch.bfloat16, (3000,), 40),
    ("bf16.busy", torch.bfloat16, (8192,), 8),
    ("bf16.dense", torch.bfloat16, (512,), 2),
    ("bf16.same", torch.bfloat16, (256,), 0),
    ("f32", torch.float32, (1024,), 100),
    ("f32.dense", torch.float32, (256,), 2),
    ("f16", torch.float16, (1024,), 100),
    ("f8_e4m3", torch.float8_e4m3fn, (1024,), 100),
    ("f8_e5m2", torch.float8_e5m2, (1024,), 100),
    ("i32", torch.int32, (512,), 50),
    ("i64.step", torch.int64, (), 1),
    ("u8", torch.uint8, (512,), 50),
    ("bool", torch.bool, (512,), 50),
)
_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_EXPONENT = {torch.bfloat16: (7, 0x75), torch.float32: (23, 0x75), torch.float16: (10, 0x08)}


def _elements(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    size = torch.empty((), dtype=dtype).element_size()
    h = _hash(n, seed)
    if dtype == torch.bool:
        return (h & np.uint64(1)).astype(np.uint8)
    if dtype in _EXPONENT:  # weights of 1e-3 .. 0.1 (|w| < 1 for F16): several exponent classes
        shift, low = _EXPONENT[dtype]
        bits = 8 * size
        sign = (h >> np.uint64(63)) << np.uint64(bits - 1)
        exponent = (np.uint64(low) + ((h >> np.uint64(40)) & np.uint64(7))) << np.uint64(shift)
        return (sign | exponent | (h & np.uint64((1 << shift) - 1))).astype(_INT[size])
    return h.astype(_INT[size])


def checkpoint() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, target) of the tiny checkpoint: a few KB, deterministic."""
    base: dict[str, torch.Tensor] = {}
    target: dict[str, torch.Tensor] = {}
    for seed, (name, dtype, shape, every) in enumerate(_LAYOUT):
        n = int(np.prod(shape, dtype=np.int64))
        b = _elements(dtype, n, seed)
        t = b.copy()
        if every:
            where = np.flatnonzero(_hash(n, 1000 + seed) % np.uint64(every) == 0)
            t[where] = (b[where] ^ 1) if dtype == torch.bool else b[where] + 1  # one ULP, or one step
        for out, elems in ((base, b), (target, t)):
            raw = torch.from_numpy(elems.view(np.uint8).copy())
            out[name] = raw.view(dtype).reshape(shape) if dtype != torch.bool else raw.view(torch.bool).reshape(shape)
    return base, target


def encoded() -> str:
    """The tiny checkpoint's payload as the current encoder writes it, base64: what `PAYLOAD`
    holds (regenerate with `python -c "import codec._warmup as w; print(w.encoded())"`)."""
    from .api import encode
    base, target = checkpoint()
    return base64.b64encode(encode(base, target)).decode()


def _fresh_payload(exc: Exception) -> bytes:
    """A payload from the current encoder, when the embedded one is refused (a regression
    tests/test_warmup.py catches): it compiles the encoder too, but the path still warms up."""
    from .api import encode
    log.warning("codec warm-up: the embedded payload is refused (%s); encoding one", exc)
    base, target = checkpoint()
    return encode(base, target)


def _warm_encode() -> None:
    from .api import encode
    base, target = checkpoint()
    encode(base, target)


def _warm_decode() -> None:
    from .api import decode
    from .errors import DeltaError
    base = checkpoint()[0]
    payload = base64.b64decode(PAYLOAD)
    try:
        decode(base, payload)
    except DeltaError as exc:
        payload = _fresh_payload(exc)
        decode(base, payload)
    decode(base, bytearray(payload), workers=2)
    decode(base, _interim_payload())


def _interim_payload() -> bytes:
    """The tiny checkpoint's delta as a publisher writes it while its encoder compiles
    (`encode(compiled=False)`, which runs no kernel): `sparse-split` records for every changed
    BF16 tensor, which reach the patch paths (`patching.swap_digest` for 2-byte elements) that
    the embedded payload's records, decoded in place, do not."""
    from .api import encode
    base, target = checkpoint()
    return encode(base, target, compiled=False)


def _warm_apply() -> None:
    """apply_ alone (no decode to check the payload first: that would compile decode's kernels)."""
    from .api import apply_
    from .errors import DeltaError
    payload = base64.b64decode(PAYLOAD)
    try:
        apply_(checkpoint()[0], payload)
    except DeltaError as exc:  # apply_ changed nothing
        payload = _fresh_payload(exc)
        apply_(checkpoint()[0], payload)
    apply_(checkpoint()[0], memoryview(bytearray(payload)))  # a writable buffer, as a download may be
    apply_(checkpoint()[0], _interim_payload())


def _warm_snapshot_decode() -> None:
    """A snapshot object's decoder on every BF16 block kind, of every version (its encoder runs
    too: a snapshot of the tiny checkpoint, so that nothing embedded here can go stale). The tiny
    checkpoint's blocks are too small for kind 4 to pay, so version 3 is also written with
    `pairs="always"`."""
    from .snapshot import VERSIONS, decode_snapshot, encode_snapshot
    named = list(checkpoint()[0].items())
    named.append(("zeros", torch.zeros(64, dtype=torch.bfloat16)))  # kinds 2-4 with a zstd residual plane
    for version, pairs in [(v, "auto") for v in VERSIONS] + [(VERSIONS[-1], "always")]:  # buckets keep old versions
        blob = b"".join(encode_snapshot(named, version=version, pairs=pairs))
        for src in (blob, bytearray(blob)):
            for _ in decode_snapshot(src):
                pass


def _warm_snapshot_encode() -> None:
    """Both of version 3's BF16 encoders: kind 3 (small blocks) and kind 4."""
    from .snapshot import encode_snapshot
    for pairs in ("auto", "always"):
        for _ in encode_snapshot(checkpoint()[0].items(), pairs=pairs):
            pass


register("encode", _warm_encode)
register("decode", _warm_decode)
register("apply_", _warm_apply)
register("snapshot_encode", _warm_snapshot_encode)  # a publisher or relay that writes compressed snapshots
register("snapshot_decode", _warm_snapshot_decode)  # a watcher (relay.watcher warms it after apply_)

PAYLOAD = (  # encoded() of checkpoint(); tests/test_warmup.py checks it still decodes
    "RFJERUxUQQAEAAAAPgMAAOaIfVkEKtEC8dibQ45ApQwotS/9YKcCpRkARC4OC2JmMTYubWF0cml4BwJAQAMfiu7h0S9XclaM"
    "mfRyFergIKlE2kIkkeyaEyQg0tqHTVoDASkfAQAwMAhvZGQHAbgXAzt02U7QJ+z0nar5BlB1vE2+BRnFhspUpj6a8g+cD1c+"
    "2wMBITsBAEhICWJ1c3kHAYBAA/oH6cOv1Dp1a/Fh7vBQu5hXhW02+IJ1Gs3cc5zKbxUAdqcEARH6BwEAtAW0BQpkZW5zZQcB"
    "gAQDhgKzn+sR1mk9gQMpQcqHTchOeQ4CFhVPiMzb1Yej/7yM7QQBBYYCAQBsbHNhbQIAAEnHPReJcB4JARrXVWlKDb8AAANm"
    "MzIIAYAIAREQcGj8fnnf3jHp7L4h2ProYUun8ZW5GjMuhtKd6FN1RgAEAYAIVQKACA4JZjMyCAGAAgGOAY35mDjaTjQYz9Pr"
    "Dyf3t5GpVGxzr9IFf+G+AL7nNaZBAooBAoACEAKAAgsDZjE2BgGACAMMPcvatp7c+NARnMLBamjxeH53rb8hvja/mxA7RtYi"
    "HhEDASUMAQAYGAdmOF9lNG0zCg82q7b2escnHnMRyjtHfu37b/esbB00OwRLdVOR9ZGj9QABAYAITjVtMgsKzKYL7QvjeZCR"
    "eW91hjb1E2JwzaIywyhIZhZF5J3RxrA3A2kzMgQBgAQBDYfa0kGPfvjZ125/OuEJjUjmA6M0i96vWKubcxRb6ODfBDoCgAQM"
    "CGk2NC5zdGVwBQABAQK0B0lQKM3oNG8MRcscT7yzsab+gYJqCxA1pmLnVf9OAAgAAQECdTgBD3X8BY1jknDTaS3WjNu1e6Jk"
    "4KTn5UvBdKNID5xzANwGBEQEYm9vbAAMs3bao50JfQ2CrDF+iHP0JjUPBBY7+Uaqmh8gXTT4XhE9AgGHARJEAgABAP8fAQcD"
    "BwwCBAIA/x8AAgDYDgCoEQACAIMMAP0TAAIAjw4A8bYPAMoQAAIAsg8AztEQAK8PAAIAqA8A2JkQAOcPAgKAICEgoIIauh1z"
    "kaZIB0LjCTTYtjTMDGHcg+kQZFR4j2I86dkrxCLiP3wq0x4lH9Hyr/ptLgv/9TdYb2VMbCLgGUOv4Er/7PvcFu22uQtsD4vP"
    "C2wxEvbL2JqJdmzNvAHznQPaVKphdFlNMAEoKvCMnfR9VT2dEADlv9PhQBkAAEIICdTBxCRfC0QzPenZMujwyIInDtWUGY45"
    "5ZKGeYDO8NdEdoM1HSvsCAvmHxfQepzGyYerBqrkR9VjX5KBAAAZhJfgTQYAAJO0zhhRIpqLGHJal0xWnRtZCaAFkMKPLZF6"
    "x2fmvWaJLgjoXSGg6UJOCbG2gHqOv58V9fx3Gfr4Cl0y8AdFy0L/yIpI1132FOyIAZLW505haEH9zV6BGiUu4HrqTca0LQcg"
    "lecHGeXOg/B+U6B3SS4e78McRPj6K19k1NkuCVB4afmwjlOWnDx7mHf6fK24q9zHL+TSFMoVB3lv/ohfmiySScn3dUd/T5Nq"
    "A/CSVJIG/yJRtYPvoSmNB9H615y1lVIYsR7Lwi9jUX0EncOrXhj7N3Ska5a6Ud+jZ8N9TfnByk8RlPvYzm5POUDGOgNdHquo"
    "zhDSdJ/dHjFHxRyIxJ1jaXb231cjKC/6MWiTdWWpXwIZ73QDIcd9vbHzevHc3FR1sdlKJLBe0nmxBTnJJr7g5AmVuLCLDgqP"
    "rYNKqW513ksqEoRb1TTQ77u/Y/Wf21CUA+R+c/Pzn8sseFas2y/QZ3XpE9gbVLrHT+DiyYN6aTNOr3TfLycTuHBEHjjddnWf"
    "cwjL6A5U7/pUFDb7ocmsdaoxrT7MfS6qDIBNVw8iX69irl4F/jqmpn7qrUBBUBtNKb0DzjeOhwXbo0iZtA8P+Ks2atw8oFGf"
    "nPpW2lE5pcaTFwdP96mGgtJCyrRo+ZzmPnE1NGQ7xuoNRMR4FMCEfd5IyU8h3R7ptliSeOwfm/U2QKgzc9B716c0GNfZM3OW"
    "IVqRGgt/yQVEi0Ei75agjhZahc3j7t+v1KU2leX436kBFAS5FAFM+6SyRdTPihSL5VAaAHXZ0vAeWRcUNo/q1YNCneZNYP7Y"
    "Lo0qfMwZhYC98afE5vOYM0Yjo1gLA+aw4/lNVP09KzFh+UgHhSKfEbgDeQRhPkvxfC1ezoMzPu0pnJG7i3cyBerIGiZf1QBO"
    "cEWZcPvANhYAAP5KP9ezWLger27jV2MTy4H9RyZ6JJi0Nh5UfqPyozd6+VB2QHC7HR8PdGTeIBiOCTqGGqgY5mtYk+yeefo9"
    "HEr67QwHck7uoFOn9d44RZlaVeC8fpWGiEz2IRbfCv3xbPKtZCrr8sg72AAAAMyDd2Pi8F4DKLUv/QAAZQIAsAAAAQAPAAEB"
    "AwAfAAEAAwAABwABBwMWAIABUA4OSIAQoLsqhAEYwHbgjRmCxxpQ2B4OADAOODF4AroLXg0VGEBBuTqvwcFAwCLAAh8AAQD/"
    "///qUAAAAAAAHwABAP///+pQAAAAAAAfAAEA////6lAAAAAAACi1L/0AAA0EAFJIDxOwJekMwzAMA1mSBKyBCK18yikFVQlB"
    "txlPpnYVsPaBEs6KBTajji5TZrOtMuQs1sXlp5kRFC33eb1HqAocAFiNVA2I4i7EjJXGAhgAO6UsqLLTsZBwA1jGDF6aWoJv"
    "McIOfBUzCH0VQFWAzTiVYDUvd2XEZ8M6QVOFIRYoKB8AAQCEHwGYAE9QAAAAAAAfAAEA51AAAAAAAB8AAQDnUAAAAAAAY/q3"
    "nXOofeQkDPegqJMCAL5dF1uGFQAAKLUv/QAALQIAaAAAAQABAQ8DAH8AAwEXAKACeM+QuAN0ECE9IQPFhBRWrBIwAIWBDBnM"
    "CYIHQQ4ogABqAPdBzZbDaQimAOl+EgHY2AOwKLUv/QAAdQEAUAAAAwADDwEBPwANACQmTiBgQgnS4LkAEADorlcRZEAFkNxA"
    "YnIIBQIp1inAAii1L/0AAI0BAHgAAP8ADwEAAwAPAAMfBwEOAGADMKeTZTCyNiw4AQqBMnA+gAVEmMHAxKAbIMEvBVgfAAEA"
    "/+hQAAAAAAAfAAEA/+hQAAAAAAAfAAEA/+hQAAAAAAAPAAAAAAAAACi1L/0AAN0BAGAAAAMAAz8AAQEBAwEUAE0VAGoA3lmF"
    "gWMBqSKAquiAEuA9QDMIQgQXAglBuAFoEPgA+2gOAXT4UIAFKLUv/QAApQEAcAAAAQEAAQEAAQEAAQAAEABgFjAfEAzEAgcQ"
    "QwHwQvAHLg4VZADivxAZwBmYggBQjp4ACw=="
)
