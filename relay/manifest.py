"""The manifest (the run's only mutable object) and the per-step record, as versioned JSON.

Parsing is strict: an unknown version, a missing or extra field, a wrong type or an inconsistent
chain is refused with a ManifestError naming the field, so a reader never acts on a manifest it
half understands. Input is hostile until proven otherwise: documents are size-capped before
parsing, any JSON failure (nesting, huge numbers) becomes a ManifestError, and every name that
can become a path (object keys, shard file names) must be one safe component. docs/PROTOCOL.md
is the normative description; this module implements it.

A signed manifest (docs/SECURITY.md) carries `signatures` over `signed_payload()`, canonical JSON
of everything else, and a `sha256` in every object reference; relay/signing.py makes and checks them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from typing import Any, TypeGuard, Union

Buffer = Union[bytes, bytearray, memoryview]  # one chunk of a streamed object

MANIFEST_FORMAT = "deltarelay.manifest"
RECORD_FORMAT = "deltarelay.record"
VERSION = 1

INDEX_NAME = "model.safetensors.index.json"
MAX_MANIFEST_BYTES = 64 << 20  # ~100k steps; refused before json.loads so a hostile store cannot make us allocate
MAX_RECORD_BYTES = 64 << 20  # ~300k tensors
MAX_SIGNATURES = 16
# Untrusted JSON's element budget (load_json): an honest document spends at least this many bytes per array
# element or object member (the densest, a compact list of 5-character names, spends 8), so a hostile one
# builds at most ~10x its size in objects instead of ~25x; JSON_MIN_ITEMS keeps tiny documents unaffected.
JSON_BYTES_PER_ITEM = 8
JSON_MIN_ITEMS = 1024
SIGNED_PAYLOAD_PREFIX = b"deltarelay.manifest signed payload v1\n"  # domain separation for the signing key
SLICED_DIGEST_PREFIX = b"deltarelay.sliced-digest v1\n"  # domain separation of a row-sliced tensor's digest
BLAKE3_PREFIX = b"deltarelay.tensor-blake3 v1\n"  # domain separation of a tensor's cryptographic digest
SLICED_BLAKE3_PREFIX = b"deltarelay.sliced-blake3 v1\n"  # ... and of a row-sliced tensor's
BLAKE3_THREADS_FROM = 4 << 20  # tensors of at least this many bytes are hashed on every core (blake3's AUTO)

# One path component that is safe on every filesystem we write to: no separator, no leading dot
# (dot names are the watcher's and the store's own), no NUL or control characters, bounded length.
_SAFE_NAME = r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}"
_SAFE_NAME_RE = re.compile(_SAFE_NAME)
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")  # the only characters a manifest string may hold (canonical JSON)
MAX_INT = (1 << 63) - 1  # steps and sizes: signed 64-bit, so every implementation holds them exactly
_KEY_STEP = re.compile(r"^(?:deltas/(\d{1,20})-\d{1,9}\.drd|records/(\d{1,20})\.json|snapshots/(\d{1,20})/"
                       + _SAFE_NAME + ")$")


class ManifestError(ValueError):
    """A manifest or record that does not follow docs/PROTOCOL.md."""


def delta_key(step: int, part: int) -> str:
    return f"deltas/{step}-{part}.drd"


def record_key(step: int) -> str:
    return f"records/{step}.json"


def snapshot_prefix(step: int) -> str:
    return f"snapshots/{step}/"


def safe_file_name(name: object) -> TypeGuard[str]:
    """True for a name that can be written as one file inside a directory and nowhere else."""
    return isinstance(name, str) and _SAFE_NAME_RE.fullmatch(name) is not None


def safe_shard_name(name: object) -> bool:
    """A shard file a watcher may create in DEST: a safe file name ending in .safetensors."""
    return safe_file_name(name) and name.endswith(".safetensors")


def step_of_key(key: str) -> int | None:
    """The step an object key belongs to, or None for keys outside the layout."""
    m = _KEY_STEP.fullmatch(key)
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def _need(obj: dict, name: str, kind: type | tuple, where: str) -> Any:
    if name not in obj:
        raise ManifestError(f"{where}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ManifestError(f"{where}.{name}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _only(obj: Any, fields: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected an object, got {type(obj).__name__}")
    extra = set(obj) - fields
    if extra:
        raise ManifestError(f"{where}: unknown field(s) {sorted(extra)}")
    return obj


def _step_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise ManifestError(f"{where}: a step is an integer from 0 to 2**63-1, got {str(value)[:40]}")
    return value


def _hex32(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not _HEX32.fullmatch(value):
        raise ManifestError(f"{where}: {what} is 32 lower-case hex digits, got {str(value)[:80]!r}")
    return value


def _printable(value: str, where: str) -> str:
    """Manifest strings are printable ASCII, so canonical JSON (§4.2) needs no escaping rule but \\ and \"."""
    if not _PRINTABLE.fullmatch(value):
        raise ManifestError(f"{where}: {value[:80]!r} holds a character outside printable ASCII (0x20-0x7e)")
    return value


def load_json(data: Any, where: str, limit: int, bytes_per_item: int = JSON_BYTES_PER_ITEM,
              max_items: int | None = None) -> Any:
    """The one reader of untrusted JSON (bucket documents, DEST state, snapshot indexes, safetensors headers):
    every failure is a ManifestError naming `where`.

    Bounded before any object is built: by size (`limit` bytes), by element count (array elements plus object
    members: at most one per `bytes_per_item` bytes, the fewest an honest document of that kind spends on one,
    and at most `max_items` where the trusted state says how many it may hold) and by nesting (the
    interpreter's recursion limit). A size cap alone lets `[{},{},...]` build one object per 3 bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview, str)):
        raise ManifestError(f"{where}: expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ManifestError(f"{where}: {len(data)} bytes, more than the {limit} this reader accepts")
    # RFC 8259 §8.1: UTF-8 without a BOM (json.loads would guess UTF-16/32 and strip a BOM), and one value per
    # member name: two parsers must never read one signed document differently
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: not UTF-8 ({exc})") from None
    if text.startswith("\ufeff"):
        raise ManifestError(f"{where}: begins with a byte order mark (JSON here is UTF-8 without one)")
    # every element after a container's first follows a ',', every first one a '[' or '{': their count bounds
    # the elements (those inside strings only overcount), at C speed and before json.loads allocates
    items = text.count(",") + text.count("[") + text.count("{")
    cap = len(text) // bytes_per_item + JSON_MIN_ITEMS
    if max_items is not None:
        cap = min(cap, max_items)
    if items > cap:
        raise ManifestError(f"{where}: up to {items} JSON elements in {len(text)} bytes, more than the {cap} "
                            f"this document may hold (refused before parsing)")
    try:
        return json.loads(text, object_pairs_hook=_unique_members)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from None
    except _DuplicateMember as exc:
        raise ManifestError(f"{where}: member {str(exc)[:100]} appears twice in one object") from None
    except (ValueError, RecursionError) as exc:  # integers over the digit limit, absurd nesting
        raise ManifestError(f"{where}: not acceptable JSON ({type(exc).__name__}: {str(exc)[:100]})") from None


class _DuplicateMember(Exception):
    """A JSON object names one member twice (raised inside json.loads, turned into a ManifestError)."""


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateMember(repr(k))
            seen.add(k)
    return out


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ObjRef:
    """An immutable object: its key under the run prefix, byte size and xxh3-128 (hex) of its bytes.

    `sha256` (hex) is set in signed manifests: xxh3 is not collision resistant, SHA-256 is what the
    signature vouches for."""

    key: str
    size: int
    xxh3: str
    sha256: str | None = None

    @classmethod
    def of(cls, key: str, data: bytes, strong: bool = False) -> "ObjRef":
        """The reference to `data` stored under `key` (with its SHA-256 when `strong`)."""
        import xxhash

        return cls(key, len(data), xxhash.xxh3_128_hexdigest(data), sha256_hex(data) if strong else None)

    @classmethod
    def of_chunks(cls, key: str, chunks: Iterable[Buffer], strong: bool = False) -> "ObjRef":
        """`of` for an object given as a stream of byte chunks (hashed as they come, never joined)."""
        import xxhash

        tag = xxhash.xxh3_128()
        sha = hashlib.sha256() if strong else None
        size = 0
        for chunk in chunks:
            tag.update(chunk)
            if sha is not None:
                sha.update(chunk)
            size += memoryview(chunk).nbytes
        return cls(key, size, tag.hexdigest(), None if sha is None else sha.hexdigest())

    def to_json(self) -> dict:
        out = {"key": self.key, "size": self.size, "xxh3": self.xxh3}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    def matches(self, data: bytes) -> str | None:
        """None if `data` is this object (size, xxh3 and, when set, SHA-256); else what differs."""
        import xxhash

        if len(data) > self.size:
            return f"more than the manifest's {self.size} bytes"
        if len(data) != self.size:
            return f"{len(data)} bytes, manifest says {self.size}"
        tag = xxhash.xxh3_128_hexdigest(data)
        if tag != self.xxh3:
            return f"xxh3 {tag}, manifest says {self.xxh3}"
        if self.sha256 is not None and sha256_hex(data) != self.sha256:
            return f"sha256 {sha256_hex(data)}, manifest says {self.sha256}"
        return None

    def matches_chunks(self, chunks: Iterable[Buffer]) -> str | None:
        """`matches` for an object read as a stream of chunks: hashed as they come, never joined, and refused
        at the first chunk that takes it past the manifest's size."""
        return self.check_chunks(chunks)[0]

    def check_chunks(self, chunks: Iterable[Buffer], strong: bool = False) -> tuple[str | None, "ObjRef | None"]:
        """(what differs or None, the reference to the bytes read): `matches_chunks`, and with `strong` the
        returned reference carries the SHA-256 of those bytes, computed in the same pass (a claimed sha256
        is checked too)."""
        import xxhash

        tag = xxhash.xxh3_128()
        sha = hashlib.sha256() if strong or self.sha256 is not None else None
        size = 0
        for chunk in chunks:
            size += memoryview(chunk).nbytes
            if size > self.size:
                return f"more than the manifest's {self.size} bytes", None
            tag.update(chunk)
            if sha is not None:
                sha.update(chunk)
        if size != self.size:
            return f"{size} bytes, manifest says {self.size}", None
        if tag.hexdigest() != self.xxh3:
            return f"xxh3 {tag.hexdigest()}, manifest says {self.xxh3}", None
        digest = None if sha is None else sha.hexdigest()
        if self.sha256 is not None and digest != self.sha256:
            return f"sha256 {digest}, manifest says {self.sha256}", None
        return None, ObjRef(self.key, size, self.xxh3, digest if strong else self.sha256)

    def read(self, store: Any) -> bytes:
        """The object's bytes from `store` (a relay.store.Store), read no further than one byte past the size
        the manifest gives: what `matches` then refuses, the store cannot make its reader hold more of."""
        return store.get_at_most(self.key, self.size + 1)

    @classmethod
    def parse(cls, obj: Any, where: str, extra: Set[str] = frozenset(),
              key_rule: tuple[Callable[[str], bool], str] | None = None) -> "ObjRef":
        """A REF (§4). Its key must be in the run's layout, or pass `key_rule` (a test and what it asks for:
        a region's own objects, relay.announce)."""
        _only(obj, {"key", "size", "xxh3", "sha256"} | set(extra), where)
        key = _need(obj, "key", str, where)
        if key_rule is not None:
            if not key_rule[0](key):
                raise ManifestError(f"{where}.key: {key[:300]!r} is not {key_rule[1]}")
        elif key.startswith("/") or ".." in key.split("/") or step_of_key(key) is None:
            raise ManifestError(f"{where}.key: {key[:300]!r} is not a deltas/, records/ or snapshots/ key")
        size = _need(obj, "size", int, where)
        if not 0 <= size <= MAX_INT:
            raise ManifestError(f"{where}.size: {str(size)[:40]} is not from 0 to 2**63-1")
        digest = _need(obj, "xxh3", str, where)
        if not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise ManifestError(f"{where}.xxh3: expected 32 hex digits")
        strong = None
        if "sha256" in obj:
            strong = _need(obj, "sha256", str, where)
            if not re.fullmatch(r"[0-9a-f]{64}", strong):
                raise ManifestError(f"{where}.sha256: expected 64 hex digits")
        return cls(key, size, digest, strong)


@dataclass(frozen=True)
class Signature:
    """One Ed25519 signature over Manifest.signed_payload(): the signer's key id and the base64 signature."""

    key_id: str
    sig: str

    def to_json(self) -> dict:
        return {"key_id": self.key_id, "sig": self.sig}

    @classmethod
    def parse(cls, obj: Any, where: str) -> "Signature":
        _only(obj, {"key_id", "sig"}, where)
        kid = _need(obj, "key_id", str, where)
        if not re.fullmatch(r"[0-9a-f]{16}", kid):
            raise ManifestError(f"{where}.key_id: expected 16 hex digits")
        sig = _need(obj, "sig", str, where)
        if not re.fullmatch(r"[A-Za-z0-9+/]{86}==", sig):
            raise ManifestError(f"{where}.sig: expected a base64 Ed25519 signature (64 bytes)")
        return cls(kid, sig)


def _row_range(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 0 <= value[0] < value[1] <= MAX_INT):
        raise ManifestError(f"{where}: a row range is [start, stop] with 0 <= start < stop <= 2**63-1, "
                            f"got {str(value)[:80]}")
    return value[0], value[1]


@dataclass(frozen=True)
class Part:
    """One delta object of a step. `tensors` None: it covers every tensor; else exactly these names.

    `rows` (name -> (start, stop)) marks the named tensors it covers only as those rows (dimension 0)
    of the whole tensor: a sharded trainer's rank holds a row slice, and its payload codes the slice
    under the tensor's name. None when nothing is sliced, so unsliced runs read as before."""

    ref: ObjRef
    tensors: tuple[str, ...] | None = None
    rows: dict[str, tuple[int, int]] | None = field(default=None, hash=False)

    def to_json(self) -> dict:
        out = {**self.ref.to_json(), "tensors": None if self.tensors is None else list(self.tensors)}
        if self.rows is not None:
            out["rows"] = {k: [a, b] for k, (a, b) in self.rows.items()}
        return out

    @classmethod
    def parse(cls, obj: Any, where: str) -> "Part":
        ref = ObjRef.parse(obj, where, {"tensors", "rows"})
        names = _need(obj, "tensors", (list, type(None)), where)
        if names is not None and not all(isinstance(n, str) for n in names):
            raise ManifestError(f"{where}.tensors: expected a list of names")
        if names is not None and len(set(names)) != len(names):
            raise ManifestError(f"{where}.tensors: names a tensor twice")
        rows = None
        if "rows" in obj:
            raw = _need(obj, "rows", dict, where)
            if names is None or not raw or not set(raw) <= set(names):
                raise ManifestError(f"{where}.rows: must name some of the part's listed tensors (and only those)")
            rows = {k: _row_range(v, f"{where}.rows[{k[:80]!r}]") for k, v in raw.items()}
        return cls(ref, None if names is None else tuple(names), rows)


@dataclass(frozen=True)
class Step:
    """A published step: its record, and the delta parts that turn step `parent` into it (None: snapshot only)."""

    step: int
    record: ObjRef
    parent: int | None = None
    parts: tuple[Part, ...] | None = None

    @property
    def delta_parts(self) -> tuple[Part, ...]:
        """The parts of a step that has a delta (every step of a chain: Manifest.chain() checks)."""
        if self.parts is None:
            raise ManifestError(f"step {self.step}: snapshot only, it has no delta")
        return self.parts

    @property
    def delta_bytes(self) -> int:
        return sum(p.ref.size for p in self.parts or ())

    def to_json(self) -> dict:
        return {"step": self.step, "record": self.record.to_json(), "parent": self.parent,
                "parts": None if self.parts is None else [p.to_json() for p in self.parts]}

    @classmethod
    def parse(cls, obj: Any, where: str) -> "Step":
        _only(obj, {"step", "record", "parent", "parts"}, where)
        step = _step_int(_need(obj, "step", int, where), f"{where}.step")
        record = ObjRef.parse(_need(obj, "record", dict, where), f"{where}.record")
        parent = _need(obj, "parent", (int, type(None)), where)
        parts_raw = _need(obj, "parts", (list, type(None)), where)
        if (parent is None) != (parts_raw is None):
            raise ManifestError(f"{where}: 'parent' and 'parts' are both null or both set")
        if parent is not None and not 0 <= parent < step:
            raise ManifestError(f"{where}.parent: {parent} is not an earlier step")
        parts = None
        if parts_raw is not None:
            if not parts_raw:
                raise ManifestError(f"{where}.parts: empty (use null for a snapshot-only step)")
            parts = tuple(Part.parse(p, f"{where}.parts[{i}]") for i, p in enumerate(parts_raw))
        return cls(step, record, parent, parts).checked(where)

    def checked(self, where: str = "step") -> "Step":
        """The step, if its record and delta keys carry its own step number (an entry cannot borrow
        another step's objects); else ManifestError."""
        if self.record.key != record_key(self.step):
            raise ManifestError(f"{where}.record.key: {self.record.key!r}, expected {record_key(self.step)!r}")
        for i, p in enumerate(self.parts or ()):
            if not p.ref.key.startswith("deltas/") or step_of_key(p.ref.key) != self.step:
                raise ManifestError(f"{where}.parts[{i}].key: {p.ref.key!r} is not a delta of step {self.step}")
            for name in p.tensors or ():
                _printable(name, f"{where}.parts[{i}].tensors")
        _disjoint(self.parts or (), where)
        return self


def _disjoint(parts: tuple[Part, ...], where: str) -> None:
    """Parts of one step never cover a tensor (or rows of it) twice: whole in one part, or row ranges
    that do not overlap. Gaps, and a part covering every tensor beside others, are refused by the
    reader (relay.shards.check_tiling), which knows each tensor's rows."""
    whole: set[str] = set()
    ranges: dict[str, list[tuple[int, int]]] = {}
    for p in parts:
        for name in p.tensors or ():
            r = (p.rows or {}).get(name)
            if name in whole or (r is None and name in ranges):
                raise ManifestError(f"{where}.parts: tensor {name[:80]!r} is covered by more than one part")
            if r is None:
                whole.add(name)
            else:
                ranges.setdefault(name, []).append(r)
    for name, rs in ranges.items():
        rs.sort()
        for (_, stop), (start, _) in zip(rs, rs[1:]):
            if start < stop:
                raise ManifestError(f"{where}.parts: rows of tensor {name[:80]!r} overlap ({stop} > {start})")


@dataclass(frozen=True)
class Snapshot:
    """A full checkpoint of one step: its index (HF layout) and shard files."""

    step: int
    index: ObjRef
    files: tuple[ObjRef, ...]

    @property
    def bytes(self) -> int:
        return self.index.size + sum(f.size for f in self.files)

    def to_json(self) -> dict:
        return {"step": self.step, "index": self.index.to_json(), "files": [f.to_json() for f in self.files]}

    @classmethod
    def parse(cls, obj: Any, where: str) -> "Snapshot":
        _only(obj, {"step", "index", "files"}, where)
        step = _step_int(_need(obj, "step", int, where), f"{where}.step")
        index = ObjRef.parse(_need(obj, "index", dict, where), f"{where}.index")
        files = tuple(ObjRef.parse(f, f"{where}.files[{i}]") for i, f in enumerate(_need(obj, "files", list, where)))
        prefix = snapshot_prefix(step)
        for ref in (index, *files):
            if not ref.key.startswith(prefix):
                raise ManifestError(f"{where}: {ref.key!r} is not under {prefix}")
        return cls(step, index, files)


@dataclass
class Manifest:
    """Head step, the snapshots still kept, and every step from the oldest snapshot to the head."""

    run: str
    head: int
    steps: list[Step] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    signatures: tuple[Signature, ...] = ()  # as parsed; to_bytes() writes fresh ones (or none)
    writer: str | None = None  # the publisher that owns the run (PROTOCOL §4.3); None in older manifests

    @property
    def base(self) -> int:
        """The newest snapshot: where a fresh reader starts."""
        return self.snapshots[-1].step

    def step(self, n: int) -> Step | None:
        for s in self.steps:
            if s.step == n:
                return s
        return None

    def step_of_snapshot(self, snap: Snapshot) -> Step:
        """The step entry (the record) of one of this manifest's snapshots; validate() makes sure there is one."""
        s = self.step(snap.step)
        if s is None:
            raise ManifestError(f"manifest: snapshot {snap.step} has no step entry (record)")
        return s

    def snapshot(self, n: int) -> Snapshot | None:
        for s in self.snapshots:
            if s.step == n:
                return s
        return None

    def chain(self, start: int) -> list[Step] | None:
        """The steps after `start` up to the head, if each has a delta from the one before; else None."""
        out = []
        prev = start
        for s in self.steps:
            if s.step <= start:
                continue
            if s.parent != prev or s.parts is None:
                return None
            out.append(s)
            prev = s.step
        return out if prev == self.head else None

    def chain_since_base(self) -> list[Step]:
        return [s for s in self.steps if s.step > self.base]

    def refs(self) -> list[ObjRef]:
        """Every object reference, records first, then deltas, then snapshot files."""
        out = [s.record for s in self.steps]
        out += [p.ref for s in self.steps for p in s.parts or ()]
        out += [r for snap in self.snapshots for r in (snap.index, *snap.files)]
        return out

    def referenced(self) -> set[str]:
        keys = set()
        for s in self.steps:
            keys.add(s.record.key)
            keys.update(p.ref.key for p in s.parts or ())
        for snap in self.snapshots:
            keys.add(snap.index.key)
            keys.update(f.key for f in snap.files)
        return keys

    def trimmed_to(self, floor: int) -> "Manifest":
        """This manifest without what precedes snapshot `floor`: the snapshots and steps from `floor` on,
        the floor step reachable only through its snapshot (its parent is gone). Unsigned: a signature
        covers the whole manifest, so a trimmed copy is new content."""
        snaps = [s for s in self.snapshots if s.step >= floor]
        if not snaps or snaps[0].step != floor:
            raise ValueError(f"trim: step {floor} has no snapshot in the manifest")
        steps = [Step(s.step, s.record) if s.step == floor else s for s in self.steps if s.step >= floor]
        # replace(), not the constructor: fields the manifest gains later carry over
        return dataclasses.replace(self, steps=steps, snapshots=snaps, signatures=())

    def trimmed(self, keep_snapshots: int, floor: int | None = None) -> "Manifest | None":
        """This manifest keeping only the newest `keep_snapshots` snapshots and the steps from the oldest
        of them on (trimmed_to), or from snapshot `floor` if that is older; None if nothing would change."""
        if keep_snapshots < 1:
            raise ValueError("keep_snapshots must be >= 1")
        oldest = self.snapshots[-keep_snapshots:][0].step
        if floor is not None:
            oldest = min(oldest, floor)
        if oldest == self.snapshots[0].step and self.steps[0].step == oldest and self.steps[0].parts is None:
            return None
        return self.trimmed_to(oldest)

    def validate(self) -> "Manifest":
        where = "manifest"
        _hex32(self.run, f"{where}.run", "a run id")
        if self.writer is not None:
            _hex32(self.writer, f"{where}.writer", "a writer id")
        _step_int(self.head, f"{where}.head")
        for s in self.steps:
            s.checked(f"{where}.steps[step {s.step}]")
        if not self.steps:
            raise ManifestError(f"{where}.steps: empty")
        if not self.snapshots:
            raise ManifestError(f"{where}.snapshots: empty (a run starts with a snapshot)")
        for name, items in (("steps", self.steps), ("snapshots", self.snapshots)):
            nums = [x.step for x in items]
            if nums != sorted(set(nums)):
                raise ManifestError(f"{where}.{name}: steps must strictly increase, got {nums[:10]}")
        if self.steps[-1].step != self.head:
            raise ManifestError(f"{where}: head {self.head} is not the last step {self.steps[-1].step}")
        have = {s.step for s in self.steps}
        for snap in self.snapshots:
            if snap.step not in have:
                raise ManifestError(f"{where}: snapshot {snap.step} has no step entry (record)")
        if self.steps[0].step < self.snapshots[0].step:
            raise ManifestError(f"{where}: step {self.steps[0].step} precedes the oldest snapshot "
                                f"{self.snapshots[0].step}")
        for s in self.steps:
            if s.parent is not None and s.parent not in have:
                raise ManifestError(f"{where}: step {s.step} names parent {s.parent}, which is not listed")
        return self

    def _doc(self) -> dict:
        doc = {"format": MANIFEST_FORMAT, "version": VERSION, "run": self.run, "head": self.head,
               "base": self.base, "snapshots": [s.to_json() for s in self.snapshots],
               "steps": [s.to_json() for s in self.steps]}
        if self.writer is not None:
            doc["writer"] = self.writer
        return doc

    def signed_payload(self) -> bytes:
        """What a signature covers: a domain prefix, then canonical JSON of every field but `signatures`
        (PROTOCOL §4.2: keys sorted, no whitespace, strings printable ASCII with only \\ and \" escaped,
        integers in plain decimal), so it is the same bytes for whoever re-serialises the parse."""
        self.validate()
        canon = json.dumps(self._doc(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        return SIGNED_PAYLOAD_PREFIX + canon.encode("ascii")

    def to_bytes(self, signer: Any = None) -> bytes:
        """The manifest as stored. With `signer` (relay.signing.Signer) it carries fresh signatures over
        `signed_payload()`; without, none: signatures parsed earlier may not cover an edited manifest."""
        self.validate()
        doc = self._doc()
        if signer is not None:
            if any(r.sha256 is None for r in self.refs()):
                raise ValueError("a signed manifest needs a sha256 in every object reference")
            doc["signatures"] = [s.to_json() for s in signer.sign(self.signed_payload())]
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str = "manifest") -> "Manifest":
        doc = load_json(data, where, MAX_MANIFEST_BYTES)
        _only(doc, {"format", "version", "run", "head", "base", "snapshots", "steps", "signatures", "writer"}, where)
        if doc.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{where}: format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        version = _need(doc, "version", int, where)
        if version != VERSION:
            raise ManifestError(f"{where}: version {version} is not supported by this reader (knows {VERSION})")
        run = _hex32(_need(doc, "run", str, where), f"{where}.run", "a run id")
        writer = None if "writer" not in doc else _hex32(_need(doc, "writer", str, where), f"{where}.writer",
                                                          "a writer id")
        head = _step_int(_need(doc, "head", int, where), f"{where}.head")
        base = _step_int(_need(doc, "base", int, where), f"{where}.base")
        snaps = [Snapshot.parse(s, f"{where}.snapshots[{i}]")
                 for i, s in enumerate(_need(doc, "snapshots", list, where))]
        steps = [Step.parse(s, f"{where}.steps[{i}]") for i, s in enumerate(_need(doc, "steps", list, where))]
        sigs: tuple[Signature, ...] = ()
        if "signatures" in doc:
            raw = _need(doc, "signatures", list, where)
            if not 1 <= len(raw) <= MAX_SIGNATURES:
                raise ManifestError(f"{where}.signatures: expected 1 to {MAX_SIGNATURES} signatures, got {len(raw)}")
            sigs = tuple(Signature.parse(s, f"{where}.signatures[{i}]") for i, s in enumerate(raw))
        m = cls(run, head, steps, snaps, sigs, writer).validate()
        if m.base != base:
            raise ManifestError(f"{where}.base: {base} but the newest snapshot is {m.base}")
        return m


Slice = tuple[int, int, str]  # rows [start, stop) of a tensor and the digest of those rows


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the trainer published it. `slices`: set when ranks held it as row slices; then
    `digest` is sliced_digest() of them (PROTOCOL §3.1), else digest_elements of the whole tensor."""

    dtype: str
    shape: tuple[int, ...]
    digest: str  # hex of codec.hashing.digest_elements, or of sliced_digest for a sliced tensor
    slices: tuple[Slice, ...] | None = None
    # Signed runs only: BLAKE3-256 hex of the tensor (tensor_blake3), or for a sliced tensor sliced_blake3 of
    # its slices' (`slice_blake3`, one per slice, in order). xxh3 is not collision resistant; this is what a
    # snapshot nobody signed (a region's own, PROTOCOL §8.1) is checked against.
    blake3: str | None = None
    slice_blake3: tuple[str, ...] | None = None

    def weak(self) -> tuple:
        """The xxh3 fields (what every run carries), for comparisons that leave BLAKE3 to strong checks."""
        return self.dtype, self.shape, self.digest, self.slices


def sliced_digest(dtype: str, shape: tuple[int, ...], slices: tuple[Slice, ...]) -> str:
    """The whole digest of a row-sliced tensor (PROTOCOL §3.1): xxh3-128 of SLICED_DIGEST_PREFIX, the
    tensor's header (codec.hashing.header_bytes), then per slice its start and stop as 8-byte
    big-endian integers and its 16 digest bytes. Two tensors agree iff all their slices do."""
    import xxhash

    from codec.hashing import header_bytes

    h = xxhash.xxh3_128()
    h.update(SLICED_DIGEST_PREFIX + header_bytes(dtype, shape))
    for start, stop, digest in slices:
        h.update(start.to_bytes(8, "big") + stop.to_bytes(8, "big") + bytes.fromhex(digest))
    return h.hexdigest()


def tensor_blake3(dtype: str, shape: tuple[int, ...], elems: Any) -> str:
    """A tensor's cryptographic digest (PROTOCOL §3.1): BLAKE3-256 of BLAKE3_PREFIX, the tensor's header
    (codec.hashing.header_bytes) and its raw element bytes, 64 hex digits. Large tensors use every core."""
    import blake3
    import numpy as np

    from codec.hashing import header_bytes

    raw = np.ascontiguousarray(elems).reshape(-1).view(np.uint8)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if raw.nbytes >= BLAKE3_THREADS_FROM else 1)
    h.update(BLAKE3_PREFIX + header_bytes(dtype, shape))
    h.update(raw.data)
    return h.hexdigest()


def sliced_blake3(dtype: str, shape: tuple[int, ...], slices: tuple[Slice, ...], parts: tuple[str, ...]) -> str:
    """The BLAKE3 of a row-sliced tensor: BLAKE3-256 of SLICED_BLAKE3_PREFIX, the header, then per slice its
    start and stop (8-byte big-endian) and the 32 bytes of its tensor_blake3 (`parts`, in slice order)."""
    import blake3

    from codec.hashing import header_bytes

    h = blake3.blake3()
    h.update(SLICED_BLAKE3_PREFIX + header_bytes(dtype, shape))
    for (start, stop, _), part in zip(slices, parts):
        h.update(start.to_bytes(8, "big") + stop.to_bytes(8, "big") + bytes.fromhex(part))
    return h.hexdigest()


def with_blake3(info: TensorInfo, t: Any) -> TensorInfo:
    """`info` with the BLAKE3 digests of tensor `t` (its slices' too, on the same rows, when sliced)."""
    from codec.tensors import element_view

    if info.slices is None:
        return dataclasses.replace(info, blake3=tensor_blake3(info.dtype, info.shape, element_view(t)))
    parts = tuple(tensor_blake3(info.dtype, (b - a, *info.shape[1:]), element_view(t[a:b])) for a, b, _ in info.slices)
    return dataclasses.replace(info, blake3=sliced_blake3(info.dtype, info.shape, info.slices, parts),
                               slice_blake3=parts)


def strong_mismatches(tensors: dict, expected: dict[str, TensorInfo]) -> list[str]:
    """Names whose BLAKE3 differs from `expected`'s (entries without one are not checked here), plus missing
    and extra names."""
    if set(tensors) != set(expected):
        return sorted(set(tensors) ^ set(expected))
    bad = []
    for name, info in expected.items():
        if info.blake3 is None:
            continue
        if with_blake3(info, tensors[name]).blake3 != info.blake3:
            bad.append(name)
    return bad


@dataclass
class Record:
    """The trainer's view of one step: each tensor's dtype, shape and digest, and the file layout."""

    run: str
    step: int
    tensors: dict[str, TensorInfo]
    weight_map: dict[str, str]

    def to_bytes(self) -> bytes:
        doc = {"format": RECORD_FORMAT, "version": VERSION, "run": self.run, "step": self.step,
               "tensors": _tensors_json(self.tensors),
               "weight_map": self.weight_map}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes, where: str = "record") -> "Record":
        doc = load_json(data, where, MAX_RECORD_BYTES)
        _only(doc, {"format", "version", "run", "step", "tensors", "weight_map"}, where)
        if doc.get("format") != RECORD_FORMAT or doc.get("version") != VERSION:
            raise ManifestError(f"{where}: not a {RECORD_FORMAT} v{VERSION} document")
        tensors = _tensor_infos(_need(doc, "tensors", dict, where), f"{where}.tensors")
        weight_map = _need(doc, "weight_map", dict, where)
        if set(weight_map) != set(tensors):
            raise ManifestError(f"{where}.weight_map: must map every tensor to a shard file name")
        bad = [v for v in weight_map.values() if not safe_shard_name(v)]
        if bad:  # a watcher creates these files in DEST: one plain component, nothing else
            raise ManifestError(f"{where}.weight_map: {str(bad[0])[:300]!r} is not a safe shard file name "
                                f"(one path component of [A-Za-z0-9._+-], not starting with '.', "
                                f"ending in .safetensors)")
        return cls(_hex32(_need(doc, "run", str, where), f"{where}.run", "a run id"),
                   _step_int(_need(doc, "step", int, where), f"{where}.step"), tensors, dict(weight_map))


def _tensors_json(tensors: dict[str, TensorInfo]) -> dict:
    out = {}
    for k, v in tensors.items():
        out[k] = {"dtype": v.dtype, "shape": list(v.shape), "digest": v.digest}
        if v.blake3 is not None:
            out[k]["blake3"] = v.blake3
        if v.slices is not None:
            if v.slice_blake3 is not None:
                out[k]["slices"] = [[a, b, d, s] for (a, b, d), s in zip(v.slices, v.slice_blake3)]
            else:
                out[k]["slices"] = [[a, b, d] for a, b, d in v.slices]
    return out


def _slices(raw: Any, shape: tuple[int, ...], where: str, strong: bool = False
            ) -> tuple[tuple[Slice, ...], tuple[str, ...] | None]:
    """A sliced tensor's `slices`: [start, stop, digest] triples tiling its rows, in order; with `strong` (the
    tensor has a blake3) [start, stop, digest, blake3], whose BLAKE3s come back as the second value."""
    if not isinstance(raw, list) or not raw:
        raise ManifestError(f"{where}: expected a non-empty list of [start, stop, digest]")
    if not shape:
        raise ManifestError(f"{where}: a scalar has no rows to slice")
    out: list[Slice] = []
    strongs: list[str] = []
    prev = 0
    form = "[start, stop, digest, blake3] (the tensor has a blake3)" if strong else "[start, stop, digest]"
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(item, list) or len(item) != (4 if strong else 3):
            raise ManifestError(f"{w}: expected {form}")
        start, stop = _row_range(item[:2], w)
        if start != prev:
            raise ManifestError(f"{w}: starts at row {start}, expected {prev} (slices tile the rows in order)")
        out.append((start, stop, _hex32(item[2], w, "a digest")))
        if strong:
            strongs.append(_hex64(item[3], w, "a blake3 digest"))
        prev = stop
    if prev != shape[0]:
        raise ManifestError(f"{where}: slices end at row {prev}, the tensor has {shape[0]}")
    return tuple(out), (tuple(strongs) if strong else None)


def _hex64(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise ManifestError(f"{where}: {what} is 64 lower-case hex digits, got {str(value)[:80]!r}")
    return value


def _tensor_infos(obj: dict, where: str) -> dict[str, TensorInfo]:
    """The `tensors` object of a record or a state file (schema/record.schema.json#/$defs/tensor)."""
    tensors = {}
    for name, t in obj.items():
        w = f"{where}[{name!r}]"
        _only(t, {"dtype", "shape", "digest", "slices", "blake3"}, w)
        shape = _need(t, "shape", list, w)
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_INT for d in shape):
            raise ManifestError(f"{w}.shape: expected integers from 0 to 2**63-1")
        dtype = _need(t, "dtype", str, w)
        if dtype not in _dtype_names():
            raise ManifestError(f"{w}.dtype: {dtype[:40]!r} is not a dtype of docs/FORMAT.md")
        digest = _hex32(_need(t, "digest", str, w), f"{w}.digest", "a digest")
        strong = None if "blake3" not in t else _hex64(t["blake3"], f"{w}.blake3", "a blake3 digest")
        slices = parts = None
        if "slices" in t:
            slices, parts = _slices(t["slices"], tuple(shape), f"{w}.slices", strong is not None)
            if sliced_digest(dtype, tuple(shape), slices) != digest:
                raise ManifestError(f"{w}.digest: not the digest of its slices (PROTOCOL §3.1)")
            if parts is not None and sliced_blake3(dtype, tuple(shape), slices, parts) != strong:
                raise ManifestError(f"{w}.blake3: not the BLAKE3 of its slices (PROTOCOL §3.1)")
        tensors[name] = TensorInfo(dtype, tuple(shape), digest, slices, strong, parts)
    return tensors


PERSIST_MODES = ("full", "journal")
_JOURNAL_FILE = re.compile(r"journal/(\d{1,20})-(\d{1,9})\.drd")


@dataclass(frozen=True)
class JournalEntry:
    """One verified delta payload a journal-mode DEST applies after its base (docs/PROTOCOL.md §6.1): the
    step it reaches, the file (journal/<step>-<part>.drd) with its size and xxh3, and the tensors it covers
    (None: all), as the manifest's part said."""

    step: int
    file: str
    size: int
    xxh3: str
    tensors: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        return {"step": self.step, "file": self.file, "size": self.size, "xxh3": self.xxh3,
                "tensors": None if self.tensors is None else list(self.tensors)}

    @classmethod
    def parse(cls, obj: Any, where: str) -> "JournalEntry":
        _only(obj, {"step", "file", "size", "xxh3", "tensors"}, where)
        for name in ("step", "file", "size", "xxh3", "tensors"):
            if name not in obj:
                raise ManifestError(f"{where}: missing field {name!r}")
        step = _step_int(_need(obj, "step", int, where), f"{where}.step")
        file = _need(obj, "file", str, where)
        found = _JOURNAL_FILE.fullmatch(file)
        if found is None or int(found.group(1)) != step:
            raise ManifestError(f"{where}.file: {file[:100]!r} is not journal/<step>-<part>.drd of step {step}")
        size = _step_int(_need(obj, "size", int, where), f"{where}.size")
        xxh3 = _need(obj, "xxh3", str, where)
        if not _HEX32.fullmatch(xxh3):
            raise ManifestError(f"{where}.xxh3: expected 32 lower-case hex digits")
        names = obj["tensors"]
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)
                                  or len(set(names)) != len(names)):
            raise ManifestError(f"{where}.tensors: null or a list of distinct tensor names")
        return cls(step, file, size, xxh3, None if names is None else tuple(names))


@dataclass
class DestState:
    """DEST/relay-state.json: which step of which run a watcher's directory holds, with the record's
    tensors of that step to check the files against (docs/schema/relay-state.schema.json).

    `persist` "full": the version holds that step's safetensors. "journal": the version holds a base
    (the safetensors of step `base`, whose record tensors are `base_tensors`) and the verified payloads
    of `journal`, applied in order, reach `step`; the state file is that mode's commit point."""

    run: str
    step: int
    url: str
    tensors: dict[str, TensorInfo]
    persist: str = "full"
    base: int | None = None
    base_tensors: dict[str, TensorInfo] | None = None
    journal: tuple[JournalEntry, ...] = ()
    partial: bool = False  # a partial replica: `tensors` is what it holds, not the whole step

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {"run": self.run, "step": self.step, "url": self.url,
                               "tensors": _tensors_json(self.tensors)}
        if self.partial:  # written only for partial replicas, so a full DEST's file reads as before
            doc["partial"] = True
        if self.persist != "full":  # a full-mode state file is written as before the journal existed
            doc["persist"] = self.persist
            doc["base"] = {"step": self.base, "tensors": _tensors_json(self.base_tensors or {})}
            doc["journal"] = [e.to_json() for e in self.journal]
        doc["check"] = _state_check(doc)
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str = "relay-state.json") -> "DestState":
        doc = load_json(data, where, MAX_RECORD_BYTES)
        _only(doc, {"run", "step", "url", "tensors", "partial", "persist", "base", "journal", "check"}, where)
        if isinstance(doc, dict) and "check" in doc:  # absent in state files written before it existed
            check = doc.pop("check")
            if check != _state_check(doc):
                raise ManifestError(f"{where}: its content does not match its check (a damaged state file)")
        partial = False
        if "partial" in doc:
            if doc["partial"] is not True:
                raise ManifestError(f"{where}.partial: true when present")
            partial = True
        state = cls(_hex32(_need(doc, "run", str, where), f"{where}.run", "a run id"),
                    _step_int(_need(doc, "step", int, where), f"{where}.step"), _need(doc, "url", str, where),
                    _tensor_infos(_need(doc, "tensors", dict, where), f"{where}.tensors"), partial=partial)
        persist = doc.get("persist", "full")
        if persist not in PERSIST_MODES:
            raise ManifestError(f"{where}.persist: {str(persist)[:40]!r} is not one of {PERSIST_MODES}")
        if persist == "full":
            if "base" in doc or "journal" in doc:
                raise ManifestError(f"{where}: base and journal belong to persist \"journal\" only")
            return state
        base = _only(_need(doc, "base", dict, where), {"step", "tensors"}, f"{where}.base")
        state.persist = persist
        state.base = _step_int(_need(base, "step", int, f"{where}.base"), f"{where}.base.step")
        state.base_tensors = _tensor_infos(_need(base, "tensors", dict, f"{where}.base"), f"{where}.base.tensors")
        raw = _need(doc, "journal", list, where)
        state.journal = tuple(JournalEntry.parse(e, f"{where}.journal[{i}]") for i, e in enumerate(raw))
        steps = [e.step for e in state.journal]
        if any(b < a for a, b in zip(steps, steps[1:])) or (steps and steps[0] <= state.base):
            raise ManifestError(f"{where}.journal: steps must be above the base and never decrease")
        if len({e.file for e in state.journal}) != len(state.journal):
            raise ManifestError(f"{where}.journal: a file is named twice")
        if (steps[-1] if steps else state.base) != state.step:
            raise ManifestError(f"{where}: the journal ends at step {steps[-1] if steps else state.base}, "
                                f"not at step {state.step}")
        if set(state.base_tensors) != set(state.tensors):
            raise ManifestError(f"{where}.base.tensors: the base and the head hold different tensor names")
        return state


def _state_check(doc: dict) -> str:
    """A state file's `check`: xxh3-128 (hex) of the rest of the document as `DestState.to_bytes` lays it out
    (json.dumps, indent 1, in the document's key order). One flipped bit in a step or a run id, which the
    shards' digests cannot see, makes the version bad instead of mislabelled."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(json.dumps({k: v for k, v in doc.items() if k != "check"}, indent=1).encode())


def _dtype_names() -> frozenset[str]:
    """The dtype names of docs/FORMAT.md (codec.tensors' table; imported late: records parse without torch)."""
    global _DTYPE_NAMES
    if _DTYPE_NAMES is None:
        from codec.tensors import DTYPES

        _DTYPE_NAMES = frozenset(d.name for d in DTYPES)
    return _DTYPE_NAMES


_DTYPE_NAMES: frozenset[str] | None = None


def tensor_infos(tensors: dict, like: dict[str, TensorInfo] | None = None, strong: bool = False
                 ) -> dict[str, TensorInfo]:
    """Each tensor's dtype, shape and digest, with the codec's own hash (codec.hashing.digest_elements),
    and with `strong` (a signed run's record) its BLAKE3 too.

    A name that `like` describes as sliced is digested on the same row boundaries (sliced_digest),
    so a whole tensor assembled from a sharded trainer's slices compares equal to its record."""
    from codec.hashing import digest_elements
    from codec.tensors import dtype_of, element_view

    out = {}
    for name, t in tensors.items():
        dt = dtype_of(t, name)
        shape = tuple(t.shape)
        ref = None if like is None else like.get(name)
        if ref is not None and ref.slices is not None and shape and ref.slices[-1][1] == shape[0]:
            slices = tuple((a, b, digest_elements(dt.name, (b - a, *shape[1:]), element_view(t[a:b])).hex())
                           for a, b, _ in ref.slices)
            out[name] = TensorInfo(dt.name, shape, sliced_digest(dt.name, shape, slices), slices)
        else:
            out[name] = TensorInfo(dt.name, shape, digest_elements(dt.name, shape, element_view(t)).hex())
        if strong:
            out[name] = with_blake3(out[name], t)
    return out


def mismatches(tensors: dict, expected: dict[str, TensorInfo], strong: bool = True) -> list[str]:
    """Names whose dtype, shape or digest differ from `expected` (plus missing and extra names); with
    `strong`, also those whose BLAKE3 differs where `expected` gives one (a signed run's record): every
    snapshot a reader loads is checked so (PROTOCOL §6)."""
    if set(tensors) != set(expected):
        return sorted(set(tensors) ^ set(expected))
    got = tensor_infos(tensors, like=expected)
    bad = [name for name, info in expected.items() if got[name].weak() != info.weak()]
    if strong:
        bad += [n for n in strong_mismatches({k: tensors[k] for k in expected if k not in bad},
                                             {k: v for k, v in expected.items() if k not in bad})]
    return bad
