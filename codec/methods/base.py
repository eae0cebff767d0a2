"""What every per-tensor method shares: the `Method` interface codec/api.py dispatches through,
the patch a record decodes to, bounded stream access and the per-payload cache of shared blocks.

A method is one `Method` object in `codec.methods.REGISTRY` (by its id, the byte in the index).
The encoder and decoder only ever ask a method the questions below; what a method's records,
analyses, batches and shared blocks hold stays inside its module.

Encoder, per payload of format version v (over methods that exist in v, by `preference`):

- every tensor has at most one analysing method (`analyses`, the first `applicable` to its
  dtype): it `analyse`s the tensor (its changes, maybe their positions, whatever it codes from),
  or, for the pairs it `batch_encodable`s, `analyse_batch`es many in one call;
- each analysing method `fit`s its payload-wide model from all its analyses;
- each changed tensor is coded by the first method whose `encode` takes it; where its changes
  are dense or effort is "max", every applicable method races and the smallest record wins.
  A batch's tensors that would not race are coded in one `encode_batch` call;
- every method some record uses writes its `shared_blocks`.

Decoder: a record's method is `lookup`ed (unknown or not in the payload's version: DeltaError
naming the tensor); `identity` methods' records change nothing; `batch_decodable` records are
decoded together by `decode_batch`, the others by `decode_target` (`builds_target` methods) or
`decode` (a Patch); apply_ has `decodes_in_place` records write themselves into the live
tensor (`decode_in_place`). Blocks in `Payload.shared` are declared by their owner
(`SharedBlock`) and parsed at most once per payload (`parsed_block`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from .. import compressors, tensors
from ..container import Entry, Stream
from ..errors import DeltaError
from ..hashing import Running


@dataclass
class Patch:
    """The changes one tensor's record describes, in flat element positions.

    Sparse on purpose: apply_ keeps an undo log of exactly these positions.
    """

    index: np.ndarray  # int64, strictly increasing, < numel
    values: np.ndarray  # new elements, same dtype as the element view

    @property
    def count(self) -> int:
        return int(self.index.size)


def empty_patch(dtype: np.dtype) -> Patch:
    return Patch(np.zeros(0, np.int64), np.zeros(0, dtype))


def pack_stream(raw: bytes | np.ndarray, effort: str) -> Stream:
    """One stream of `raw` (any contiguous buffer of bytes), by the best compressor for `effort`."""
    codec, stored = compressors.compress_best(raw, effort)
    return Stream(codec, raw.nbytes if isinstance(raw, np.ndarray) else len(raw), stored)


def read_stream(entry: Entry, i: int, what: str, *, exact: int | None = None, at_most: int | None = None) -> bytes:
    """Decompress stream `i` of `entry` after checking its declared length against the base."""
    if i >= len(entry.streams):
        raise DeltaError(f"missing {what} stream", tensor=entry.name)
    s = entry.streams[i]
    if exact is not None and s.raw_len != exact:
        raise DeltaError(f"{what} stream declares {s.raw_len} bytes, expected {exact}", tensor=entry.name)
    if at_most is not None and s.raw_len > at_most:
        raise DeltaError(f"{what} stream declares {s.raw_len} bytes, at most {at_most} possible", tensor=entry.name)
    try:
        return compressors.decompress(s.codec, s.stored, s.raw_len, what)
    except DeltaError as exc:
        raise DeltaError(exc.reason, tensor=entry.name) from None


def expect_streams(entry: Entry, n: int) -> None:
    if len(entry.streams) != n:
        raise DeltaError(f"method expects {n} streams, index has {len(entry.streams)}", tensor=entry.name)


def check_index(entry: Entry, index: np.ndarray, numel: int) -> None:
    """Positions must be strictly increasing and inside the tensor."""
    if index.size and (index[0] < 0 or index[-1] >= numel or (index.size > 1 and np.any(np.diff(index) <= 0))):
        raise DeltaError("change positions are out of order or outside the tensor", tensor=entry.name)


def changed_positions(base: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Positions where two flat element views differ (one compiled pass for 2-byte elements)."""
    if base.dtype == np.uint16:
        from .exponent_classes import differences

        return differences(base, target)
    return np.flatnonzero(base != target)


# ---------------------------------------------------------------- shared blocks

@dataclass(frozen=True)
class SharedBlock:
    """A kind of `Payload.shared` block a method owns: its key, the format versions it exists in,
    and what it is (for errors: "an interleave rule"). A payload of another version carrying
    it is refused when opened, unless `refused_elsewhere` is False (the block is then unread)."""

    kind: int
    versions: tuple[int, ...]
    what: str
    refused_elsewhere: bool = True


# One parsed shared block per kind, for the payload whose shared dict was read last: every
# record of a payload reads the same blocks (keyed by the dict's id, checked by the block's
# identity, so a new payload in a recycled dict is parsed afresh).
_SHARED_CACHE: dict[int, tuple[int, bytes | None, object]] = {}


def parsed_block(shared: dict, kind: int, parse: Callable[[dict], Any]) -> Any:
    """`parse(shared)` for block `kind`, computed once per payload."""
    data = shared.get(kind)
    cached = _SHARED_CACHE.get(kind)
    if cached is not None and cached[0] == id(shared) and cached[1] is data:
        return cached[2]
    value = parse(shared)
    _SHARED_CACHE[kind] = (id(shared), data, value)
    return value


# ---------------------------------------------------------------- the interface

@dataclass
class Job:
    """One changed tensor on its way into the payload, as every method's `encode` sees it."""

    name: str
    dtype: tensors.DType
    base: np.ndarray  # flat element views (`tensors.element_view`)
    target: np.ndarray
    changes: int
    effort: str
    index: np.ndarray | None = None  # changed positions, where someone had them for free
    analysis: Any = None  # what the tensor's analysing method learned (its own type), if any


class Analysed(Protocol):
    """What an analysing method's `analyse` returns: at least the changes it found."""

    @property
    def changes(self) -> int: ...

    index: np.ndarray | None  # their positions, where the analysis had them for free


class Batch(Protocol):
    """What `analyse_batch` returns: many tensors analysed together, in the given order."""

    def changes(self) -> np.ndarray:
        """Changed elements per tensor (int64)."""

    def digest_pairs(self) -> list[tuple[bytes, bytes]] | None:
        """(base, target) digest of each tensor, where the analysis made them; else None."""

    def analysis(self, i: int) -> Any:
        """Tensor i's analysis, as the method's `encode` takes it (Job.analysis)."""


class Method(abc.ABC):
    """One per-tensor coding method. Subclasses set the class attributes and implement
    `applicable`, `encode`, `decode` and `stream_names`; the rest is optional and says so."""

    id: ClassVar[int]  # the method byte of its records
    name: ClassVar[str]
    versions: ClassVar[tuple[int, ...]]  # the format versions it exists in
    preference: ClassVar[int]  # encoders try methods lowest first (the first that codes a tensor wins)
    shared_kinds: ClassVar[tuple[SharedBlock, ...]] = ()  # the payload-wide blocks it owns
    identity: ClassVar[bool] = False  # its records change nothing: the target is the base
    analyses: ClassVar[bool] = False  # analyses tensors before coding them (`analyse`, `fit`)
    builds_target: ClassVar[bool] = False  # `decode_target` builds the whole target
    decodes_in_place: ClassVar[bool] = False  # `decode_in_place` writes the target into the base

    def exists_in(self, version: int) -> bool:
        return version in self.versions

    @abc.abstractmethod
    def applicable(self, dtype: tensors.DType) -> bool:
        """Whether it codes tensors of this element type."""

    def encodes(self, dtype: tensors.DType, version: int) -> bool:
        """Whether an encoder of format `version` codes tensors of this element type with it (a method may
        take a dtype from some version on, which keeps older versions' encodes, and their vectors, as they were)."""
        return self.applicable(dtype)

    # ---- encoder

    @abc.abstractmethod
    def encode(self, job: Job, model: Any) -> tuple[bytes, list[Stream]] | None:
        """(params, streams) of one changed tensor, or None where it cannot code this one.
        `model` is what its `fit` returned for the payload (None without)."""

    def analyse(self, base: torch.Tensor, target: torch.Tensor,
                host: Callable[[], tuple[np.ndarray, np.ndarray]]) -> Analysed:
        """(`analyses` methods) One tensor's analysis; `host()` gives flat element views of
        both (made once, on demand: base and target may live on a device)."""
        raise NotImplementedError(f"method {self.name!r} does not analyse")

    def batch_encodable(self, base: torch.Tensor, target: torch.Tensor) -> bool:
        """(`analyses` methods) Whether `analyse_batch` takes this pair."""
        return False

    def scratch(self) -> Any:
        """Reusable working memory for `analyse_batch` (with an `nbytes`), or None. The encoder
        keeps a few and lends one per batch until the payload is packed."""
        return None

    def analyse_batch(self, bases: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], scratch: Any,
                      hash_base: Sequence[bool] | None = None, version: int = 0) -> Batch:
        """`analyse` of many `batch_encodable` pairs in a few compiled calls. Where the batch digests
        (`Batch.digest_pairs`), it digests base i only if hash_base[i] (default: every base); the
        caller fills in the base digests it skipped. `version`: the format the batch is for (what
        its analysis must hold for that version's models)."""
        raise NotImplementedError(f"method {self.name!r} does not batch")

    def encode_batch(self, batch: Any, which: np.ndarray, model: Any) -> Sequence[tuple[bytes, list[Stream]] | None]:
        """`encode` of the batch's tensors `which` (changed, not raced), in one go where it can;
        None for one it leaves to `encode`. The encoder calls it for tensors this method would
        code first, so a batching method must come first (`preference`) among their coders."""
        raise NotImplementedError(f"method {self.name!r} does not batch")

    def fit(self, version: int, batches: list[Any], analyses: list[Any]) -> Any:
        """(`analyses` methods) The payload-wide model its records are coded with, from every
        batch and every other changed tensor's analysis; None if there is nothing to fit."""
        return None

    def shared_blocks(self, model: Any) -> dict[int, bytes]:
        """The shared blocks a payload whose records use this method carries."""
        return {}

    # ---- decoder

    @abc.abstractmethod
    def decode(self, entry: Entry, base: np.ndarray, shared: dict) -> Patch:
        """The record's changes against the base's flat elements; DeltaError naming the tensor."""

    def decode_target(self, entry: Entry, base: np.ndarray, shared: dict,
                      digest: Running | None = None) -> tuple[int, np.ndarray]:
        """(`builds_target` methods) (changes decoded, the whole target, flat), feeding `digest`."""
        raise NotImplementedError(f"method {self.name!r} does not build targets")

    def decode_in_place(self, entry: Entry, elems: np.ndarray, shared: dict,
                        digest: Running | None = None) -> Patch:
        """(`decodes_in_place` methods) The record applied to `elems` (the base's writable flat
        elements) as it is decoded, feeding `digest` the target in order: one pass over the
        tensor instead of a decode then a write. Returns the changed positions and the elements
        they held (apply_'s undo log). On DeltaError `elems` hold the base's exact bits again."""
        raise NotImplementedError(f"method {self.name!r} does not decode in place")

    def batch_decodable(self, entry: Entry) -> bool:
        """Whether `decode_batch` takes this record (others are decoded alone)."""
        return False

    def decode_batch(self, entries: list[Entry], bases: list[torch.Tensor], outs: list[torch.Tensor], shared: dict,
                     headers: list[bytes] | None) -> tuple[np.ndarray, np.ndarray, list[bytes] | None] | None:
        """The targets of many `batch_decodable` records written into `outs` (CPU tensors of
        their shape and dtype), from CPU `bases` of the same: (changes decoded, status (0: ok),
        each target's digest where `headers` asked for them, else None), or None where the
        payload's shared blocks fail. A record that fails here is decoded alone, which says why."""
        raise NotImplementedError(f"method {self.name!r} does not batch")

    def check_shared(self, shared: dict, version: int) -> None:
        """The payload-wide check of its blocks when a payload is opened: by default, that each
        one it owns may appear in this format version."""
        for block in self.shared_kinds:
            if block.refused_elsewhere and block.kind in shared and version not in block.versions:
                raise DeltaError(f"a v{version} payload carries {block.what} (a v{min(block.versions)} field)")

    @abc.abstractmethod
    def stream_names(self, entry: Entry) -> list[str]:
        """A name per stream, for `deltarelay inspect`."""

    def describe(self, entry: Entry, shared: dict, base: np.ndarray | None, target: np.ndarray | None) -> dict:
        """Extra per-tensor facts for `deltarelay inspect` (given the elements where known)."""
        return {}

    def __repr__(self) -> str:
        return f"<method {self.id} {self.name!r}>"
