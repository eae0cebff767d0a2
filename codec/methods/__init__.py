"""Per-tensor coding methods, each one `Method` object (base.py) in REGISTRY by its id.

A new method slots in by writing a `Method` subclass (in a module here) and registering it; the
container and codec/api.py never change: they only ask methods the questions base.py lists.
"""

from __future__ import annotations

from ..container import Entry
from ..errors import DeltaError
from . import conditional, same, sparse, xor_planes
from .base import Method

REGISTRY: dict[int, Method] = {m.id: m for m in (same.METHOD, xor_planes.METHOD, sparse.METHOD, conditional.METHOD)}


def register(method: Method) -> None:
    REGISTRY[method.id] = method


def lookup(entry: Entry, version: int) -> Method:
    """The method of a record in a payload of this format version; DeltaError naming the tensor if
    there is none by that id, or it does not exist in that version."""
    method = REGISTRY.get(entry.method)
    if method is None:
        raise DeltaError(f"unknown method {entry.method}", tensor=entry.name)
    if not method.exists_in(version):
        if version < min(method.versions):
            raise DeltaError(f"method {method.name!r} needs format version {min(method.versions)}, "
                             f"payload is {version}", tensor=entry.name)
        raise DeltaError(f"method {method.name!r} does not exist in format version {version}", tensor=entry.name)
    return method


def in_version(version: int) -> list[Method]:
    """The methods a payload of this format version may use, in the order encoders try them."""
    return sorted((m for m in REGISTRY.values() if m.exists_in(version)), key=lambda m: m.preference)
