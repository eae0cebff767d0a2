"""Operator actions on a run: rebase (a new snapshot at the head), gc (drop what the last K snapshots
do not need) and status. Each manifest change is a conditional read-modify-write that is retried
when a publisher commits in between, so operators can act on a live run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

from relay import announce, commit, fanout
from relay.checkpoint import declares_compressed
from relay.manifest import Manifest, step_of_key
from relay.publisher import upload_snapshot
from relay.signing import Signer, TrustedKeys
from relay.store import ConflictError, Store, open_store
from relay.watcher import Reader

log = logging.getLogger(__name__)



class ReplayedManifestError(ValueError):
    """The store's manifest is older than what its own records and deltas show (a replay): an operator move
    on it would trim, delete and sign by a stale view of the run."""


def refuse_replayed(url: str, m: Manifest, listed: Mapping[str, int], move: str) -> None:
    """Raise ReplayedManifestError if `listed` (the store's keys) holds records or deltas of two or more
    steps above `m`'s head. One step above is a publisher's step in flight (its objects land before its
    commit); more than one was committed by a manifest newer than `m`, which was then copied back."""
    above = sorted({s for k in listed if k.startswith(("records/", "deltas/"))
                    and (s := step_of_key(k)) is not None and s > m.head})
    if len(above) >= 2:
        raise ReplayedManifestError(
            f"{url}/manifest.json: head is step {m.head}, but the store holds records and deltas of steps "
            f"{_steps(above)} above it: an older manifest was copied back (a replay), or a relay copied steps it "
            f"has not committed yet. {move} refused, nothing changed: acting on it would trim, delete and re-sign "
            f"by a stale manifest. Restore the newest manifest (or let the relay commit), then run it again. If no "
            f"newer manifest ever existed (the bucket's object versions tell), these are leftovers of steps whose "
            f"commits failed: delete records/ and deltas/ of steps above {m.head}, then run it again")


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


def _signer(signing_key: Any) -> Signer | None:
    return None if signing_key is None or isinstance(signing_key, Signer) else Signer(signing_key)


def _run_snapshot_format(store: Store, m: Manifest) -> str:
    """The format of the run's newest snapshot whose index reads and matches (a region that keeps only its own
    snapshots, or a damaged index the reader routed around, has none readable): "safetensors" failing all."""
    for snap in reversed(m.snapshots):
        try:
            data = snap.index.read(store)
        except Exception as exc:  # noqa: BLE001 - another snapshot decides
            log.info("%s: snapshot %d's index unreadable (%s); the format is taken from an older one", store.url,
                     snap.step, exc)
            continue
        if snap.index.matches(data) is None:
            return "compressed" if declares_compressed(data) else "safetensors"
    return "safetensors"


def update_manifest(store: Store, change: Callable[[Manifest], Manifest | None], signer: Signer | None = None,
                    *, trusted: Any = None, adopt_unsigned: bool = False) -> Manifest:
    """Apply `change` to the current manifest and commit it conditionally (relay.commit.update_manifest).

    `change` returns the new manifest, or None when there is nothing to do; a write that landed
    unreported is found by re-running it on the re-read manifest. A signed run is only changed
    with a `signer`, and a signer only changes a manifest its own or `trusted` keys signed (an
    unsigned one only with `adopt_unsigned`).
    """
    def step(cur: Manifest | None, unsure: bool) -> Manifest | None:
        if cur is None:
            raise FileNotFoundError(f"{store.url}/manifest.json: no run here")
        return change(cur)

    out = commit.update_manifest(store, step, signer=signer, trusted=TrustedKeys.from_option(trusted),
                                 adopt_unsigned=adopt_unsigned)
    if out is None:  # None only when there is no manifest, and then step() raised
        raise AssertionError("unreachable: update_manifest without a manifest")
    return out


def rebase(url: str, storage_options: dict | None = None, *, max_shard_bytes: int | None = None,
           timeout: float | None = 600.0, signing_key: Any = None, trusted_keys: Any = None,
           adopt_unsigned: bool = False) -> int:
    """Materialise the head from the base and its chain (verified), store it as a snapshot, make it the base.

    Returns the step that now has a snapshot. The snapshot keeps the layout the trainer recorded
    for that step unless `max_shard_bytes` asks for another cap. `timeout`: how long to wait for objects
    the manifest names that are not there yet (None: for ever), as `deltarelay rebase --timeout`.
    """
    store = open_store(url, storage_options)
    signer = _signer(signing_key)
    trusted = TrustedKeys.from_option(trusted_keys)
    got = store.read_manifest()
    if got is None:
        raise FileNotFoundError(f"{url}/manifest.json: no run here")
    first = Manifest.parse(got.data, f"{url}/manifest.json")
    commit.check_writable(first, f"{url}/manifest.json", signer, trusted, adopt_unsigned)
    shown = {**store.list("records/"), **store.list("deltas/")}  # what the run has committed, whatever its manifest
    refuse_replayed(url, first, shown, "rebase")
    # a signed run is read back only through manifests our keys signed: we are about to sign its head
    reader_keys = commit.writer_keys(signer, trusted) if first.signatures else None
    m, tensors, rec = Reader(store, trusted_keys=reader_keys).reach(None, None, timeout=timeout)
    if m.snapshot(rec.step) is not None:
        log.info("%s: step %d already has a snapshot", url, rec.step)
        return rec.step
    weight_map = rec.weight_map
    if max_shard_bytes is not None:
        from relay.checkpoint import shard_plan

        weight_map = shard_plan(tensors, max_shard_bytes)
    # the run's own snapshot format (its newest snapshot's): a publisher uploading the same step's snapshot
    # at the same time then writes the same bytes under the same keys, and neither sees a conflict
    snap = upload_snapshot(store, rec.step, tensors, weight_map, strong=signer is not None,
                           snapshot_format=_run_snapshot_format(store, m))

    def add(cur: Manifest) -> Manifest | None:
        if cur.run != m.run:
            raise ConflictError(f"{url}: the run changed ({m.run} -> {cur.run}) during rebase")
        refuse_replayed(url, cur, shown, "rebase")
        if cur.snapshot(snap.step) is not None:
            return None
        if cur.step(snap.step) is None:
            raise ConflictError(f"{url}: step {snap.step} was collected during rebase")
        cur.snapshots = sorted([*cur.snapshots, snap], key=lambda s: s.step)
        return cur

    update_manifest(store, add, signer, trusted=trusted, adopt_unsigned=adopt_unsigned)
    log.info("%s: rebased onto a snapshot of step %d (%d bytes)", url, snap.step, snap.bytes)
    return snap.step


def _start_present(m: Manifest, snap: Any, present: Mapping[str, int]) -> bool:
    """Whether every object a reader starting from trainer snapshot `snap` needs is `present`: the snapshot's
    index and files, its step's record (a start is checked against it), and, when a chain leads from it to
    the head, the chain's deltas and the head's record (intermediate records are never read)."""
    step = m.step(snap.step)
    if step is None or step.record.key not in present:
        return False
    if not all(r.key in present for r in (snap.index, *snap.files)):
        return False
    chain = m.chain(snap.step)
    if not chain:
        return True
    return chain[-1].record.key in present and all(p.ref.key in present for s in chain for p in s.parts or ())


def servable_floor(m: Manifest, keep: int, present: Mapping[str, int], ann: announce.Announcement | None
                   ) -> int | None:
    """The newest snapshot step of `m` that gc may trim to while keeping `keep` starting points that readers of
    this store can use: the trainer's snapshots whose objects, and those of their chain to the head, are all
    `present` (_start_present), and the region's announced snapshots that a reader can start from (readers
    use both, whoever wrote them). The manifest starts at a trainer snapshot, so the floor is the newest one at
    or before the oldest start kept; None if no start is servable at all."""
    own = {s.step for s in m.snapshots if _start_present(m, s, present)}
    starts = sorted(own | set(fanout.servable_from(m, ann)))
    if not starts:
        return None
    oldest = starts[-keep:][0]
    below = [s.step for s in m.snapshots if s.step <= oldest]
    return max(below) if below else None


def gc(url: str, keep_snapshots: int, storage_options: dict | None = None, *, signing_key: Any = None,
       trusted_keys: Any = None, adopt_unsigned: bool = False, regional_only: bool = False,
       dry_run: bool = False) -> dict:
    """Keep the newest `keep_snapshots` snapshots and the steps from the oldest of them on; delete the rest.

    A watcher holding any step from the oldest kept snapshot on still has its chain to the head.
    The manifest is committed first, objects are deleted after, so no fresh manifest names a
    deleted object. Unreferenced objects above the head, and unreferenced snapshot files from the
    oldest kept snapshot on, are left alone: they may belong to an upload in progress.
    A regional store's own snapshots (PROTOCOL §8.1) are collected too, by the same rule: the newest
    `keep_snapshots` stay announced, the objects of the others are deleted (relay.announce.collect).
    `regional_only` leaves the manifest alone (a signed run's region: only the trainer's key changes it).
    The manifest is never trimmed past what this store can serve (`servable_floor`): a snapshot whose
    objects have not arrived (a replicated region) is no start. A manifest older than the store's own records
    and deltas show (a replay) is refused (refuse_replayed): nothing is trimmed, deleted or signed by it.
    `dry_run` changes nothing and returns what would be deleted: "doomed", {key: bytes}, regional keys too.
    """
    if keep_snapshots < 1:
        raise ValueError("keep_snapshots must be >= 1")
    store = open_store(url, storage_options)
    regional = announce.collect(store, keep_snapshots, dry_run=dry_run)
    if regional_only:
        log.info("%s: gc kept regional snapshots %s, %s %d objects", url, regional["regional_snapshots"],
                 "would delete" if dry_run else "deleted", regional["regional_deleted"])
        return {"url": url, "snapshots": None, "deleted": regional["regional_deleted"],
                "freed_bytes": regional["regional_freed_bytes"], "doomed": regional["regional_doomed"],
                "dry_run": dry_run, **regional}
    before: set[str] = set()
    # what this store holds: a snapshot whose objects are not all here serves nobody. Also what is deleted
    # below: an object written after this listing is not, which only ever spares more
    present = store.list_run()
    ann = announce.read_announcement(store)[0]

    def trim(m: Manifest) -> Manifest | None:
        refuse_replayed(url, m, present, "gc")
        before.clear()
        before.update(m.referenced())
        floor = servable_floor(m, keep_snapshots, present, ann)
        if floor is None:
            log.warning("%s: gc: no snapshot a reader of this store can start from is present; the manifest is "
                        "left as it is", url)
            return None
        return m.trimmed(keep_snapshots, floor)

    if dry_run:
        got = store.read_manifest()
        if got is None:
            raise FileNotFoundError(f"{url}/manifest.json: no run here")
        current = Manifest.parse(got.data, f"{url}/manifest.json")
        commit.check_writable(current, f"{url}/manifest.json", _signer(signing_key),
                              TrustedKeys.from_option(trusted_keys), adopt_unsigned)
        m = trim(current) or current  # what the real gc would commit (refused where it would be refused)
    else:
        m = update_manifest(store, trim, _signer(signing_key), trusted=trusted_keys, adopt_unsigned=adopt_unsigned)
    oldest = m.snapshots[0].step
    now = m.referenced()
    listed = present

    def garbage(key: str) -> bool:
        step = step_of_key(key)
        if key in now or step is None:
            return False
        if step < oldest or key in before:
            return True
        # a delta or record of a committed step that the manifest no longer names (trimmed by a
        # publisher's keep_snapshots, or left by a publisher that lost a race); snapshot files are
        # spared: a background snapshot or a rebase may still be uploading them
        return step <= m.head and not key.startswith("snapshots/")

    doomed = sorted(k for k in listed if garbage(k))
    if not dry_run:
        store.delete(doomed)
    freed = sum(listed[k] for k in doomed)
    log.info("%s: gc kept snapshots %s, %s %d objects (%d bytes); regional snapshots %s, %d objects", url,
             [s.step for s in m.snapshots], "would delete" if dry_run else "deleted", len(doomed), freed,
             regional["regional_snapshots"], regional["regional_deleted"])
    return {"url": url, "snapshots": [s.step for s in m.snapshots],
            "deleted": len(doomed) + regional["regional_deleted"],
            "freed_bytes": freed + regional["regional_freed_bytes"],
            "doomed": {**{k: listed[k] for k in doomed}, **regional["regional_doomed"]}, "dry_run": dry_run,
            **regional}


def status(url: str, storage_options: dict | None = None) -> dict:
    """Head, base, chain length and bytes of one run (reads only the manifest)."""
    store = open_store(url, storage_options)
    got = store.read_manifest()
    if got is None:
        raise FileNotFoundError(f"{url}/manifest.json: no run here")
    m = Manifest.parse(got.data, f"{url}/manifest.json")
    chain = m.chain_since_base()
    return {"url": url, "run": m.run, "writer": m.writer, "head": m.head, "base": m.base, "chain_length": len(chain),
            "chain_bytes": sum(s.delta_bytes for s in chain), "base_bytes": m.snapshots[-1].bytes,
            "snapshots": [s.step for s in m.snapshots], "steps_listed": len(m.steps)}
