"""The watcher's directory (DEST, docs/PROTOCOL.md §6.1): reading a version, in either persist mode.

A version directory (DEST/.versions/<step>-<nonce>) holds relay-state.json and either

- persist "full": the step's safetensors in the record's layout plus the HF index; or
- persist "journal": a materialised *base* (the safetensors of an earlier step, as downloaded from a
  snapshot or written by a compaction) plus journal/<step>-<part>.drd, the verified delta payloads that
  lead from the base to the state file's step. The state file names the base step, its tensors' digests
  and every journal entry (size, xxh3); journal files it does not name are a torn tail, never applied.

`open_head(DEST)` resolves DEST/.current once and returns the step it holds, verified; `materialize`
streams a version's head into a plain shard directory for tools that need files. Both verify every byte
(journal files against the state file's size and xxh3, every tensor against the trainer's digests).
"""

from __future__ import annotations

import errno
import os
import stat
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import xxhash

import codec
from relay import checkpoint
from relay.files import fsync_dir
from relay.manifest import INDEX_NAME, DestState, JournalEntry, ManifestError, TensorInfo, load_json, mismatches, \
    safe_shard_name, tensor_infos

STATE_NAME = "relay-state.json"
JOURNAL_DIR = "journal"
VERSION_NAME = re.compile(r"[0-9]+-[0-9a-f]{8}")  # .versions/<step>-<nonce>
STREAM_BYTES = 256 << 20  # compaction and materialize hold about this much of a checkpoint at a time
MAX_INDEX_BYTES = 64 << 20


class BadVersion(Exception):
    """A version proven damaged (state file, shards, journal or digests): the only kind a watcher deletes."""


class DestError(RuntimeError):
    """DEST holds no step that can be read (nothing synced yet, or its version kept vanishing)."""


def read_state(version: Path) -> DestState:
    """The version's state file, parsed strictly; BadVersion if missing or invalid."""
    try:
        return DestState.parse(_read_small(version / STATE_NAME), str(version / STATE_NAME))
    except FileNotFoundError:
        raise BadVersion(f"no {STATE_NAME}") from None
    except ManifestError as exc:  # not JSON, or not the schema
        raise BadVersion(f"{STATE_NAME} is not valid ({exc})") from None


def _not_a_link(path: Path, exc: OSError) -> None:
    """Raise BadVersion when `exc` is O_NOFOLLOW meeting a symlink: the watcher writes only regular files in a
    version, so a link there proves the version is not its own (deleting it unlinks the link, never its target)."""
    if exc.errno == errno.ELOOP:
        raise BadVersion(f"{path.name} is a symlink, not a file the watcher wrote") from None


def _read_small(path: Path, limit: int = MAX_INDEX_BYTES) -> bytes:
    """A small file's bytes (no links followed), refused over `limit` before it is read."""
    try:  # O_NONBLOCK: a FIFO planted here must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        _not_a_link(path, exc)
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BadVersion(f"{path.name} is not a regular file (the watcher writes only those)")
        if os.fstat(f.fileno()).st_size > limit:
            raise BadVersion(f"{path.name}: over {limit} bytes")
        return f.read()


def weight_map(version: Path, names: set[str]) -> dict[str, str]:
    """The version's tensor -> shard file map (its HF index), covering exactly `names`; BadVersion else."""
    try:
        doc = load_json(_read_small(version / INDEX_NAME), INDEX_NAME, MAX_INDEX_BYTES)
        wm = doc["weight_map"]
    except FileNotFoundError:
        raise BadVersion(f"no {INDEX_NAME}") from None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BadVersion(f"{INDEX_NAME} is not valid ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(wm, dict) or set(wm) != names or not all(safe_shard_name(v) for v in wm.values()):
        raise BadVersion(f"{INDEX_NAME}: its weight_map does not place exactly the state's tensors in safe names")
    return dict(wm)


def load_base(version: Path, expected: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """The version's safetensors, read straight into tensors (no mmap) and checked against `expected`."""
    wm = weight_map(version, set(expected))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(wm.values())):
        try:
            part, _ = checkpoint.read_file_into(version / shard)
        except FileNotFoundError as exc:
            raise BadVersion(f"missing file ({exc})") from None
        except checkpoint.NotARegularFile as exc:
            raise BadVersion(f"{exc} (the watcher writes only regular files)") from None
        except checkpoint.SafetensorsError as exc:
            raise BadVersion(f"unreadable shard ({exc})") from None
        except OSError as exc:
            _not_a_link(version / shard, exc)
            raise
        if set(part) != {k for k, s in wm.items() if s == shard}:
            raise BadVersion(f"{shard} holds other tensors than the index places there")
        tensors.update(part)
    bad = mismatches(tensors, expected, strong=False)  # DEST's own files, verified when written: xxh3 finds damage
    if bad:
        raise BadVersion(f"tensors {bad[:5]} do not match the state file")
    return tensors


def journal_payload(version: Path, entry: JournalEntry) -> bytes:
    """A journal file's bytes, checked against the state file's size and xxh3 before use."""
    path = version / entry.file
    try:
        data = _read_small(path, entry.size)
    except FileNotFoundError:
        raise BadVersion(f"{entry.file} is missing") from None
    if len(data) != entry.size or xxhash.xxh3_128_hexdigest(data) != entry.xxh3:
        raise BadVersion(f"{entry.file} does not match the state file (size or xxh3)")
    return data


def steps_of(journal: tuple[JournalEntry, ...]) -> Iterator[list[JournalEntry]]:
    """The journal's entries grouped by step, in order (a step's parts together)."""
    group: list[JournalEntry] = []
    for e in journal:
        if group and e.step != group[0].step:
            yield group
            group = []
        group.append(e)
    if group:
        yield group


def replay(version: Path, state: DestState, tensors: dict[str, torch.Tensor], *, workers: int = 1,
           only: set[str] | None = None) -> None:
    """Apply the version's journal to `tensors` (the base's, or the names `only` of it) in place, each step's
    parts covering every tensor once, and check the result against the state file's head tensors; BadVersion
    (tensors partly applied: the caller drops them) when a file or a digest is wrong."""
    names = set(tensors)
    last: codec.UndoLog | None = None
    for group in steps_of(state.journal):
        log = codec.UndoLog()  # one step's: its verified digests are the head check's when it is the last
        covered: set[str] = set()
        for e in group:
            part = names if e.tensors is None else set(e.tensors) & names
            if covered & part:
                raise BadVersion(f"step {e.step}: journal parts overlap")
            covered |= part
            if not part:
                continue
            payload = journal_payload(version, e)
            whole = only is None and e.tensors is None
            try:
                codec.apply_(tensors if whole else {k: tensors[k] for k in part}, payload, workers=workers,
                             undo=log, only=None if only is None else part)
            except codec.DeltaError as exc:
                raise BadVersion(f"{e.file}: {exc}") from None
        if covered != names:
            raise BadVersion(f"step {group[0].step}: journal parts leave tensors {sorted(names - covered)[:5]}")
        last = log
    expected = {k: state.tensors[k] for k in names}
    verified = last.verified() if last is not None else {}
    unchecked = [k for k in names if k not in verified or verified[k].hex() != expected[k].digest]
    bad = mismatches({k: tensors[k] for k in unchecked}, {k: expected[k] for k in unchecked},
                     strong=False) if unchecked else []
    bad += [k for k in names if k in verified and (tuple(tensors[k].shape) != expected[k].shape)]
    if bad:
        raise BadVersion(f"tensors {sorted(set(bad))[:5]} do not match the state file after the journal")


def name_agrees(version: Path, state: DestState) -> bool:
    """Whether a version's name (<step>-<nonce>: the step it was written at) agrees with its state file: the
    state's step in full mode; in journal mode a step from the base to the state's step (appends move it on).
    A flipped bit in a full version's step is then seen (names not of that form pass)."""
    if not VERSION_NAME.fullmatch(version.name):
        return True
    named = int(version.name.split("-", 1)[0])
    if state.persist == "full":
        return named == state.step
    return state.base is not None and state.base <= named <= state.step


def load_version(version: Path, *, workers: int = 1) -> tuple[DestState, dict[str, torch.Tensor]]:
    """(state, tensors at the state's step) of a version directory, every byte verified.

    BadVersion only when the version is proven bad; anything else (MemoryError, an OSError other than a
    missing file) propagates: the version may be fine."""
    state = read_state(version)
    if not name_agrees(version, state):
        raise BadVersion(f"{STATE_NAME} says step {state.step} (base {state.base}, persist {state.persist}), its "
                         f"version is named for step {version.name.split('-', 1)[0]}")
    if state.persist == "full":
        return state, load_base(version, state.tensors)
    if state.base_tensors is None:
        raise BadVersion("journal state without base tensors")
    tensors = load_base(version, state.base_tensors)
    replay(version, state, tensors, workers=workers)
    return state, tensors


def current_version(dest: str | os.PathLike) -> Path | None:
    """The version DEST/.current names (read once), if it is .versions/<version> and a real directory."""
    d = Path(dest)
    try:
        target = os.readlink(d / ".current")
    except (FileNotFoundError, OSError):
        return None
    head, _, name = target.partition("/")
    if head != ".versions" or not VERSION_NAME.fullmatch(name):
        return None
    path = d / ".versions" / name
    if path.is_symlink() or not path.is_dir():
        return None
    return path


def open_head(dest: str | os.PathLike, *, workers: int = 1, attempts: int = 20) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, tensors) DEST holds, verified, in either persist mode: .current is resolved once per attempt
    and that version read (base plus journal); if the watcher removed it meanwhile (it does right after a
    swap), DEST is resolved again. DestError when DEST holds nothing readable; BadVersion when it is damaged.
    Memory: one copy of the model."""
    for _ in range(attempts):
        version = current_version(dest)
        if version is None:
            raise DestError(f"{dest}: holds no step (no .current naming a version)")
        try:
            state, tensors = load_version(version, workers=workers)
        except BadVersion:
            if current_version(dest) == version:
                raise
            # superseded under the read (the watcher removes the old version right after a swap, its files
            # before the directory itself): resolve again
            continue
        return state.step, tensors
    raise DestError(f"{dest}: the version kept vanishing under the read ({attempts} attempts)")


def _batches(spans: list, limit: int) -> Iterator[list]:
    """Consecutive tensors of a file, in groups of about `limit` bytes (a larger tensor alone)."""
    group: list = []
    size = 0
    for s in spans:
        n = s.end - s.begin
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(s)
        size += n
    if group:
        yield group


def materialize_into(version: Path, state: DestState, out: Path, *, workers: int = 1,
                     journal: tuple[JournalEntry, ...] | None = None, step: int | None = None,
                     expected: dict[str, TensorInfo] | None = None, durable: bool = True,
                     progress: Callable[[], None] | None = None) -> None:
    """Write the version's head (its base with `journal` applied: by default the whole journal, reaching
    the state's step) into the empty directory `out` as full safetensors shards in the base's layout plus
    the index, streamed: about STREAM_BYTES of tensors in memory at a time, read from the version's files
    (never from a live in-memory state). Every tensor is verified against `expected` (default: the state's
    head tensors) before its bytes are written; BadVersion if one fails. Files fsynced when `durable`.
    `progress` is called between batches (a compaction checks there whether to give up)."""
    journal = state.journal if journal is None else journal
    expected = state.tensors if expected is None else expected
    base_tensors = state.base_tensors if state.persist == "journal" else state.tensors
    if base_tensors is None:
        raise BadVersion("journal state without base tensors")
    partial = DestState(state.run, state.step if step is None else step, state.url, expected, state.persist,
                        state.base, base_tensors, journal)
    wm = weight_map(version, set(base_tensors))
    for shard in sorted(set(wm.values())):
        try:
            source = checkpoint.SafetensorsFile(version / shard)
        except OSError as exc:
            _not_a_link(version / shard, exc)
            raise
        with source as src, checkpoint.StreamedWriter(out / shard, src.spans, {"step": str(partial.step)}) as dst:
            if {s.name for s in src.spans} != {k for k, f in wm.items() if f == shard}:
                raise BadVersion(f"{shard} holds other tensors than the index places there")
            for group in _batches(src.spans, STREAM_BYTES):
                tensors = {s.name: src.read(s) for s in group}
                bad = mismatches(tensors, {k: base_tensors[k] for k in tensors}, strong=False)
                if bad:
                    raise BadVersion(f"tensors {bad[:5]} of the base do not match the state file")
                if journal:
                    replay(version, partial, tensors, workers=workers, only=set(tensors))
                for s in group:
                    dst.write(tensors[s.name])
                del tensors
                if progress is not None:
                    progress()
            if durable:
                dst.fsync()
    data = checkpoint.index_bytes_of({k: expected[k] for k in wm}, wm)
    with open(out / INDEX_NAME, "wb") as f:
        f.write(data)
        if durable:
            os.fsync(f.fileno())


def materialize(dest: str | os.PathLike, out: str | os.PathLike, *, workers: int = 1) -> int:
    """Write the step DEST holds (either mode) as a shard directory `out` (created; must not exist), verified
    and streamed; returns the step. Written under a temporary name and renamed, so `out` is whole or absent."""
    target = Path(out)
    if os.path.lexists(target):
        raise FileExistsError(f"{target}: exists; materialize writes a new directory")
    for _ in range(20):
        version = current_version(dest)
        if version is None:
            raise DestError(f"{dest}: holds no step (no .current naming a version)")
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            state = read_state(version)
            materialize_into(version, state, tmp, workers=workers)
            os.rename(tmp, target)
            fsync_dir(target.parent)
            return state.step
        except (BadVersion, FileNotFoundError):
            if current_version(dest) == version:
                raise  # still DEST's version: damaged, not superseded
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    raise DestError(f"{dest}: the version kept vanishing under the read")


def infos(tensors: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """The digests of held tensors (for a state file written from memory)."""
    return tensor_infos(tensors)


__all__ = ["open_head", "materialize", "load_version", "current_version", "BadVersion", "DestError",
           "STATE_NAME", "JOURNAL_DIR"]
