"""The one backoff policy of the relay: every component that waits before trying again uses it.

A retry cures only what may pass: `relay.store.transient()` tells those failures (5xx, throttling,
resets, timeouts) from refusals. What differs between components is how long they wait and how
often they try, not the formula: the publisher's background snapshot, the store's re-fetch of a
body that broke off, the re-read after an unanswered manifest write, the watcher waiting for an
object that is not there yet and backing off a reference that failed verification, and the
regional relay backing off a failing region.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Waits of `initial` seconds, times `factor` per further failure, never more than `maximum`."""

    initial: float
    maximum: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum or self.factor < 1:
            raise ValueError(f"need 0 < initial <= maximum and factor >= 1, got {self}")

    def delay(self, failures: int) -> float:
        """The wait after `failures` failures in a row (1 or more): initial * factor ** (failures - 1), capped."""
        if failures < 1:
            return 0.0
        if self.factor <= 1:
            return self.initial
        # past the cap, the cap (computed in logs: factor ** n overflows a float for any factor above ~2 at
        # n = 1000, and a region that has failed for days keeps a finite wait)
        if (failures - 1) * math.log(self.factor) >= math.log(self.maximum / self.initial):
            return self.maximum
        return min(self.initial * self.factor ** (failures - 1), self.maximum)

    def sleep(self, failures: int) -> float:
        """Sleep the wait after `failures` failures; returns it."""
        wait = self.delay(failures)
        time.sleep(wait)
        return wait


__all__ = ["Backoff"]
