"""Method 0, `same`: the tensor did not change. No streams; the target digest equals the base digest."""

from __future__ import annotations

import numpy as np

from ..container import Entry
from ..errors import DeltaError
from .base import Patch, empty_patch

ID = 0
NAME = "same"
MIN_VERSION = 1


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    if entry.streams or entry.params:
        raise DeltaError("`same` record carries data", tensor=entry.name)
    if entry.base_digest != entry.target_digest:
        raise DeltaError("`same` record has different base and target digests", tensor=entry.name)
    return empty_patch(base.dtype)


def stream_names(entry: Entry) -> list[str]:
    return []
