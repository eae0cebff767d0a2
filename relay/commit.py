"""The one way to change a run's manifest: read, check who signed it, change, conditional write, repeat.

Every writer (the publisher, rebase, gc) goes through `update_manifest`, so the rules that keep a
signed run trustworthy hold for all of them (docs/SECURITY.md, "Writers"):

* a writer that holds a signing key never signs a manifest it has not verified: the manifest it
  read must carry a valid signature by one of its trusted keys (its own, plus any it was given for
  a rotation), else it refuses. An unsigned manifest is adopted (signed from now on) only when the
  operator says so (`adopt_unsigned`, `--adopt-unsigned`), and that is logged as a warning;
* a writer without a key never rewrites a signed manifest (it would strip the signatures and
  stop every watcher that checks them);
* a write whose outcome the store did not tell (a 5xx after the write, a reset) is followed by a
  re-read; `change` is told so and decides whether its earlier write landed.

A publisher's commit that still raises without a refusal (the store down through every re-read)
may have landed: `CommitOutcome` keeps it until the publisher's next step settles it by reading
the manifest, for every publisher alike (relay.Publisher, relay.distributed.ShardedPublisher).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Generic, TypeVar, overload

from relay.manifest import Manifest, Snapshot, Step, step_of_key
from relay.signing import Signer, SignatureError, TrustedKeys, strengthen
from relay.store import ConflictError, Store, unsure_write

log = logging.getLogger(__name__)

ATTEMPTS = 20  # conditional writes lost in a row before giving up

Change = Callable[[Manifest | None, bool], Manifest | None]


class UnsignedWriteError(ValueError):
    """A writer without a signing key was asked to change a signed run."""


@overload
def writer_keys(signer: Signer, trusted: TrustedKeys | None) -> TrustedKeys: ...


@overload
def writer_keys(signer: Signer | None, trusted: TrustedKeys | None) -> TrustedKeys | None: ...


def writer_keys(signer: Signer | None, trusted: TrustedKeys | None) -> TrustedKeys | None:
    """The keys a signing writer accepts on what it reads: its own, plus `trusted` (a key rotation)."""
    if signer is None:
        return None
    own = [k.public_key() for k in signer.keys]
    return TrustedKeys(own + (list(trusted.keys.values()) if trusted is not None else []))


def check_writable(m: Manifest, where: str, signer: Signer | None, trusted: TrustedKeys | None,
                   adopt_unsigned: bool) -> None:
    """Raise unless a writer with `signer` (or none) may build on `m` (the rules in the module docstring)."""
    if signer is None:
        if m.signatures:
            raise UnsignedWriteError(f"{where}: the run is signed; changing its manifest needs the signing key "
                                     f"(--signing-key), else every watcher that checks signatures stops")
        return
    if m.signatures:
        writer_keys(signer, trusted).verify(m, where)  # never re-sign what no trusted key signed
        return
    if not adopt_unsigned:
        raise SignatureError(
            f"{where}: unsigned, and this writer signs with key(s) {signer.key_ids}: refusing to sign a manifest "
            f"nobody signed (whoever can write the bucket can strip signatures and add steps). If this run was "
            f"published unsigned and you mean to sign it from now on, check it (deltarelay verify --deep) and "
            f"pass --adopt-unsigned (adopt_unsigned=True)")
    log.warning("%s: ADOPTING AN UNSIGNED MANIFEST (head %d, run %s) and signing it with %s, as the operator asked "
                "(--adopt-unsigned): its objects are vouched for from now on", where, m.head, m.run, signer.key_ids)


def update_manifest(store: Store, change: Change, *, signer: Signer | None = None,
                    trusted: TrustedKeys | None = None, adopt_unsigned: bool = False,
                    attempts: int = ATTEMPTS) -> Manifest | None:
    """Commit `change(current, unsure)` with a conditional write, re-reading after every lost race.

    `current` is the parsed manifest (None when the run has none); `unsure` is True when an earlier
    write of this call failed without the store saying whether it landed. `change` returns the new
    manifest, None when there is nothing (more) to do, or raises (ConflictError when the run moved
    in a way it cannot build on). Returns what was committed, or the manifest as read when `change`
    returned None (None if there was none).
    """
    where = f"{store.url}/manifest.json"
    unsure = 0
    for _ in range(attempts):
        got = store.read_manifest()
        current = None if got is None else Manifest.parse(got.data, where)
        if current is not None:
            check_writable(current, where, signer, trusted, adopt_unsigned)
        new = change(current, unsure > 0)
        if new is None:
            return current
        if signer is not None:  # a run signed from now on: vouch for its older objects too, and for no
            # sha256 an unsigned manifest claimed (a bucket writer may have put it there)
            unverified = {r.key for r in current.refs()} if current is not None and not current.signatures else set()
            new = strengthen(store, new, unverified)
        try:
            store.commit_manifest(new.to_bytes(signer=signer), None if got is None else got.etag)
            return new
        except ConflictError:
            log.info("%s: changed while we updated it, re-reading", where)
        except Exception as exc:  # noqa: BLE001 - unsure_write re-raises all but transient errors
            unsure = unsure_write(store.url, exc, unsure)  # the re-read tells whether it landed
    raise ConflictError(f"{where}: {attempts} conditional writes lost in a row")


def extend_run(cur: Manifest | None, unsure: bool, *, url: str, run: str, writer: str, head: int | None,
               entry: Step | None, snap: Snapshot | None, keep_snapshots: int | None = None) -> Manifest | None:
    """A publisher's `change` for update_manifest: `cur` plus a step and/or a snapshot, only while writer
    `writer` owns run `run` (PROTOCOL §4.3) and the head is `head`, the one it last committed. None when
    there is nothing to do: the manifest already holds our entry under our writer id (an earlier write
    of ours that landed unreported), or the snapshot is there. ConflictError when another publisher
    started, took over or extended the run."""
    where = f"{url}/manifest.json"
    if cur is None:
        if head is not None or entry is None or snap is None:
            raise ConflictError(f"{where}: gone (the run was deleted)")
        return Manifest(run, entry.step, [entry], [snap], writer=writer)
    if cur.run != run:
        raise ConflictError(f"{url}: another publisher started run {cur.run} here")
    # A manifest holding exactly our entry is our own write only if it names us as its writer
    # (a 412 can answer botocore's retry of our own landed PUT, so a refusal proves nothing);
    # in a manifest without a writer, only after a write of ours whose outcome was not told.
    ours = cur.writer == writer if cur.writer is not None else unsure
    if ours and (entry is None or cur.step(entry.step) == entry) and (
            snap is None or cur.snapshot(snap.step) == snap):
        # our earlier conditional write landed although the store (or the network) reported a
        # failure: a 5xx after the write, a reset, a timeout. It is ours, not a lost race.
        log.warning("%s: the manifest already holds our commit (one reported as failed had landed); "
                    "carrying on", url)
        return None
    if cur.writer is not None and cur.writer != writer:
        raise ConflictError(f"{url}: another publisher (writer {cur.writer}) took the run over; this "
                            f"one (writer {writer}) is fenced and commits nothing more")
    if cur.head != head:
        raise ConflictError(f"{url}: head is step {cur.head}, this publisher last committed "
                            f"{head}: another publisher extended the run")
    if entry is None and (snap is None or cur.snapshot(snap.step) is not None):
        return None  # the snapshot is there already (a rebase of the same step wrote the same bytes)
    m = dataclasses.replace(cur, steps=list(cur.steps), snapshots=list(cur.snapshots), signatures=(),
                            writer=writer)
    if entry is not None:
        m.steps.append(entry)
        m.head = entry.step
    if snap is not None and m.snapshot(snap.step) is None:
        if m.step(snap.step) is None:
            raise ConflictError(f"{url}: step {snap.step} left the manifest before its snapshot "
                                f"was committed")
        m.snapshots.append(snap)
        m.snapshots.sort(key=lambda s: s.step)
        if keep_snapshots is not None:
            m = m.trimmed(keep_snapshots) or m
    return m


T = TypeVar("T")


def commit_landed(store: Store, run: str, writer: str, step: int, entry: Step | None = None) -> bool:
    """Read the manifest: whether it holds `step` (exactly `entry`, where the caller knows it) in run `run` under
    writer `writer`, i.e. whether a commit of that publisher's landed. A failed read raises."""
    got = store.read_manifest()
    m = None if got is None else Manifest.parse(got.data, f"{store.url}/manifest.json")
    if m is None or m.run != run or m.writer != writer:
        return False
    held = m.step(step)
    return held is not None and (entry is None or held == entry)


@dataclasses.dataclass(frozen=True)
class Unsettled(Generic[T]):
    """A step whose manifest commit raised without a refusal, and `moves`: what moving the publisher to it takes
    if it landed (each publisher's own)."""

    entry: Step
    moves: T


class CommitOutcome(Generic[T]):
    """What a publisher knows of its last commit's fate (PROTOCOL §5.1): a commit refused (ConflictError) did not
    land; any other failure may have (the store applied the write, then lost the answer and every re-read), and
    is kept until the next publish learns which from the manifest, before it builds on either head."""

    def __init__(self) -> None:
        self.pending: Unsettled[T] | None = None

    def failed(self, entry: Step, exc: BaseException, moves: T) -> bool | None:
        """Committing `entry` raised `exc`: False (not committed) for a refusal; else None (it may have landed),
        kept with `moves` until `settle`."""
        if isinstance(exc, ConflictError):
            return False
        self.unsure(entry, moves)
        return None

    def unsure(self, entry: Step, moves: T) -> None:
        """Keep `entry` as a commit that may have landed (another process saw it fail: a sharded publisher's
        rank 0)."""
        self.pending = Unsettled(entry, moves)

    def landed(self, store: Store, run: str, writer: str) -> bool:
        """Read the manifest: whether it holds the pending entry under our run and writer id. A failed read
        raises, and the entry stays pending."""
        u = self.pending
        return u is not None and commit_landed(store, run, writer, u.entry.step, u.entry)

    def settle(self, landed: bool, url: str) -> Unsettled[T] | None:
        """Forget the pending entry, whose fate is now known: the entry if it `landed` (the caller moves the
        publisher to it, then asks `retried`), else None (the publisher carries on from the step before)."""
        u, self.pending = self.pending, None
        if u is None:
            return None
        if not landed:
            log.info("%s: step %d's commit, reported as failed, did not land; carrying on from the step before",
                     url, u.entry.step)
            return None
        log.warning("%s: step %d's commit, reported as failed, had landed; carrying on from it", url, u.entry.step)
        return u

    @staticmethod
    def retried(u: Unsettled[T] | None, step: int) -> bool:
        """Whether publishing `step` is done once the publisher has moved to `u` (a landed step): True for a
        retry of `u`'s step; ValueError for a step below it."""
        if u is None:
            return False
        if step < u.entry.step:
            raise ValueError(f"step {step} does not increase (step {u.entry.step} had landed)")
        return step == u.entry.step


def leftovers_message(store: Store, keys: list[str]) -> str:
    """Why a run cannot start at a prefix that holds objects but no manifest, and what to do."""
    return (f"{store.url}: no manifest, but the run layout holds {len(keys)} object(s) ({', '.join(keys[:3])}"
            f"{', ...' if len(keys) > 3 else ''}): a publisher died before its first commit, or another one is "
            f"starting a run here now. No manifest names them; remove them (every key under records/, deltas/ and "
            f"snapshots/ of this prefix) before starting a run here, or start it at another prefix")


def require_no_leftovers(store: Store) -> None:
    """Refuse to start a run where objects of the run layout exist without a manifest (ConflictError): their
    keys collide with the new run's (records/0.json first), and no publisher may replace them, since only a
    manifest proves whose they are (create_owned). One listing, at start only."""
    left = sorted(store.list_run())
    if left:
        raise ConflictError(leftovers_message(store, left))


def create_owned(store: Store, key: str, write: Callable[[], None], *, run: str, writer: str,
                 head: int | None) -> None:
    """Create an immutable object with `write` for a publisher that owns `run` as `writer` at `head`.

    Other bytes under the key of a step above `head` are a leftover: of a crashed or fenced publisher, or
    of a failed attempt at that step. They are replaced only once the manifest shows the run still ours at
    that head (only the owner commits, so no manifest names such an object); anything else is a
    ConflictError, as is a collision at or below the head."""
    try:
        write()
        return
    except ConflictError:
        step = step_of_key(key)
        if step is None or (head is not None and step <= head):
            raise
    got = store.read_manifest()
    m = None if got is None else Manifest.parse(got.data, f"{store.url}/manifest.json")
    if m is None:
        raise ConflictError(leftovers_message(store, [key]))
    if m.run != run or m.writer != writer or m.head != head:
        raise ConflictError(f"{store.url}/{key}: already exists with other content, and another publisher "
                            f"owns the run (writer {m.writer}, head {m.head})")
    log.warning("%s/%s: replacing a leftover of an uncommitted step (a crashed or fenced publisher, or a failed "
                "attempt at this step, wrote it)", store.url, key)
    store.delete([key])
    write()


__all__ = ["update_manifest", "extend_run", "check_writable", "writer_keys", "require_no_leftovers", "create_owned",
           "UnsignedWriteError", "ATTEMPTS", "CommitOutcome", "Unsettled",
           "commit_landed"]
