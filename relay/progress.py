"""Progress bars (tqdm, on stderr) for the command line's long transfers: a watcher's downloads, a
publisher's uploads, `dest materialize`. The library never prints: a bar polls a counter the library
keeps anyway (Reader.progress, Publisher.bytes_uploaded, the files being written), from a thread of
its own, and exists only when the CLI asks and stderr is a terminal (never with --json).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

MIN_BYTES = 16 << 20  # transfers smaller than this get no bar: they are over before one would help
# one INFO line per step (a watcher's step, a relay's regional commit: step, bytes, seconds), so that a healthy
# process is not silent: the CLI shows this logger at INFO by default (relay.cli), the rest at WARNING
STEP_LOG = logging.getLogger("relay.steps")


def wanted(json_output: bool = False, stream: Any = None) -> bool:
    """Whether to draw bars: not for --json, and only on a terminal."""
    stream = sys.stderr if stream is None else stream
    return not json_output and bool(getattr(stream, "isatty", lambda: False)())


class Poller:
    """While open, a thread reads `read() -> (done, total) | None` every `interval` seconds and keeps one
    tqdm bar per transfer: opened when a transfer of at least `min_bytes` starts (of unknown size: once
    `min_bytes` are done), closed when `read` returns None. Disabled (`enabled=False`), it does nothing."""

    def __init__(self, read: Callable[[], tuple[int, int | None] | None], desc: str, *, enabled: bool,
                 interval: float = 0.2, min_bytes: int = MIN_BYTES) -> None:
        self.read = read
        self.desc = desc
        self.enabled = enabled
        self.interval = interval
        self.min_bytes = min_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None

    def __enter__(self) -> "Poller":
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="deltarelay-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._tick()  # the last state, then the bar goes
        self._close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick()

    def _tick(self) -> None:
        if not self.enabled:
            return
        try:
            got = self.read()
        except Exception:  # noqa: BLE001 - a bar must never break the command it decorates
            got = None
        if got is None:
            self._close()
            return
        done, total = got
        if self._bar is None:
            if (done if total is None else total) < self.min_bytes:  # unknown size: once it is large
                return
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False, dynamic_ncols=True)
        if total is not None and self._bar.total != total:
            self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def _close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


def written_bytes(directory: Path) -> int:
    """Bytes in the files directly under `directory` (0 if it does not exist): a streamed writer's progress."""
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


__all__ = ["Poller", "wanted", "written_bytes", "MIN_BYTES"]
