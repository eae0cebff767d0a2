"""Method 0, `same`: the tensor did not change. No streams; the target digest equals the base digest."""

from __future__ import annotations

import numpy as np

from .. import tensors
from ..container import Entry
from ..errors import DeltaError
from .base import Job, Method, Patch, empty_patch

ID = 0
NAME = "same"
VERSIONS = (1, 2, 3, 4)


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    if entry.streams or entry.params:
        raise DeltaError("`same` record carries data", tensor=entry.name)
    if entry.base_digest != entry.target_digest:
        raise DeltaError("`same` record has different base and target digests", tensor=entry.name)
    return empty_patch(base.dtype)


def stream_names(entry: Entry) -> list[str]:
    return []


class Same(Method):
    """The record of every unchanged tensor; encoders write it themselves, never race it."""

    id, name, versions = ID, NAME, VERSIONS
    preference = 1 << 30
    identity = True

    def applicable(self, dtype: tensors.DType) -> bool:
        return True

    def encode(self, job: Job, model: object) -> None:
        return None  # a changed tensor is never `same`

    def decode(self, entry: Entry, base: np.ndarray, shared: dict) -> Patch:
        return decode(entry, base, shared)

    def stream_names(self, entry: Entry) -> list[str]:
        return stream_names(entry)


METHOD = Same()
