"""Per-tensor coding methods. Each module exposes ID, NAME, MIN_VERSION, decode() and stream_names().

A new method slots in by adding a module here and registering it; the container never changes.
"""

from __future__ import annotations

from types import ModuleType

from ..container import Entry
from ..errors import DeltaError
from . import conditional, same, sparse, xor_planes

REGISTRY: dict[int, ModuleType] = {m.ID: m for m in (same, xor_planes, sparse, conditional)}


def register(module: ModuleType) -> None:
    REGISTRY[module.ID] = module


def lookup(entry: Entry, version: int) -> ModuleType:
    module = REGISTRY.get(entry.method)
    if module is None:
        raise DeltaError(f"unknown method {entry.method}", tensor=entry.name)
    if version < module.MIN_VERSION:
        raise DeltaError(f"method {module.NAME!r} needs format version {module.MIN_VERSION}, payload is {version}", tensor=entry.name)
    return module
