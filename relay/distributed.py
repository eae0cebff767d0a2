"""Trainer side for torch.distributed trainers: every rank publishes what it holds, rank 0 commits.

One ShardedPublisher per rank. Per step each rank uploads its own delta part
(`deltas/<step>-<rank>.drd`, codec.encode of its previous local tensors to its current ones) or,
when a snapshot is due, its own snapshot files (`snapshots/<step>/rank-RRRRR-of-WWWWW-NNNNN.safetensors`);
then the ranks exchange their object references and tensor digests (all_gather_object on a gloo
group with a timeout), and rank 0 writes the step's record and makes the one manifest commit
(relay.commit.extend_run through update_manifest: writer fence, conflicts, signing). A step
becomes visible only once every rank's objects are in the store; a rank that fails reports its
error in the exchange and nothing is committed; a rank that dies makes every other rank's
collective fail (gloo reports the lost peer, or the timeout ends the wait), and each raises
ShardedPublishError naming the step and the rank. publish() returns on every rank after rank 0's
commit (its outcome is broadcast), so a step is either visible to all or raised on all. A commit
that raised without a refusal may have landed (committed=None on every rank): the next publish
learns its fate from the manifest on rank 0, for every rank, first (relay.commit.CommitOutcome,
as relay.Publisher does), and carries on from the head the store holds.

Layouts: (a) ranks own disjoint whole tensors; (b) ranks hold row slices (dimension 0) of a
tensor: `RowSlice(tensor, start, total_rows)`, or a DTensor with a Shard(0) (or Replicate)
placement on a one-dimensional mesh. A sliced tensor's record entry carries its slices, each with
its digest, and a whole digest made from them (docs/PROTOCOL.md §3.1); its parts carry `rows`.

Resume is refused: a sharded run is published by one job from its first step (the ranks' previous
local states are not in the store in a form a rank can read back alone).
"""

from __future__ import annotations

import datetime
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

import codec
from codec.hashing import digest_elements
from codec.tensors import dtype_of, element_view
from relay.checkpoint import DEFAULT_SHARD_BYTES, index_bytes, shard_plan
from relay.commit import CommitOutcome, commit_landed, create_owned, extend_run, require_no_leftovers, update_manifest
from relay.manifest import (INDEX_NAME, MAX_INT, Manifest, ObjRef, Part, Record, Snapshot, Step, TensorInfo,
                            delta_key, record_key, safe_shard_name, sliced_blake3, sliced_digest, snapshot_prefix,
                            tensor_blake3)
from relay.shards import ROWS_KEY, SLICES_KEY
from relay.signing import Signer, TrustedKeys
from relay.store import open_store

log = logging.getLogger(__name__)


class ShardedPublishError(RuntimeError):
    """A step some rank could not publish (its error, a dead or late rank, a failed commit). `committed`: False
    when the step is not visible; True when rank 0 committed it but a rank lost the others before all heard
    (the step is visible, the publisher unusable); None when this rank cannot tell (it stopped waiting while
    rank 0's commit may still land, or that commit raised without a refusal: the next publish learns which)."""

    def __init__(self, message: str, committed: bool | None = False) -> None:
        super().__init__(message)
        self.committed = committed


# The settings every rank must share: each decides from them alike (a snapshot is due, a wait has ended) or
# writes where they say; a rank that differs would leave the ranks in different collectives, or its
# objects in another store than the manifest that names them.
SHARED_SETTINGS = ("store", "snapshot_every", "snapshot_fraction", "keep_snapshots", "timeout", "world")


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, start + tensor.shape[0]) of a tensor of `total_rows` rows that this rank holds."""

    tensor: torch.Tensor
    start: int
    total_rows: int


@dataclass(frozen=True)
class _Local:
    """One tensor as this rank holds it: a CPU contiguous copy, and its rows if it is a slice."""

    tensor: torch.Tensor
    rows: tuple[int, int] | None  # [start, stop) of the whole tensor's rows
    total_rows: int


@dataclass(frozen=True)
class _Moves:
    """What a rank's state becomes once its step is committed (or found landed later): its tensors, their digests
    and BLAKE3s, and the chain and snapshot counts the next step's schedule reads."""

    step: int
    local: dict[str, _Local]
    digests: dict[str, str]
    strong: dict[str, tuple[str, tuple[int, int] | None, str]]
    delta_bytes: int
    snapshot_bytes: int | None  # the step's snapshot's model bytes, if it is committed with one
    snapshot_retry: bool  # a snapshot was due and not committed: the next step snapshots


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dtensor(name: str, t: Any) -> _Local | None:
    """A DTensor's local part: a Shard(0) slice, a Replicate tensor (published by mesh rank 0 only)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or not isinstance(placements[0], (Replicate, Shard)) or (
            isinstance(placements[0], Shard) and placements[0].dim != 0):
        raise TypeError(f"{name!r}: a DTensor on a {mesh.ndim}-d mesh with placements {placements}; publish "
                        f"takes Shard(0) or Replicate on a one-dimensional mesh (or pass RowSlice)")
    local = t.to_local().detach().to("cpu", copy=True).contiguous()
    if isinstance(placements[0], Replicate):
        return _Local(local, None, local.shape[0] if local.dim() else 0) if mesh.get_local_rank() == 0 else None
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    start = int(offset[0])
    return _Local(local, (start, start + local.shape[0]), int(t.shape[0]))


def local_tensors(state: Any) -> dict[str, _Local]:
    """This rank's tensors from a state_dict or nn.Module: whole tensors, RowSlice or DTensor entries
    (private CPU copies: the trainer keeps mutating its own). Empty slices are left out."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"publish expects a state_dict or an nn.Module, got {type(state).__name__}")
    out: dict[str, _Local] = {}
    for name, t in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state key {name!r} is not a string")
        if isinstance(t, RowSlice):
            local = t.tensor.detach().to("cpu", copy=True).contiguous()
            if not local.dim() or not 0 <= t.start <= t.start + local.shape[0] <= t.total_rows:
                raise ValueError(f"{name!r}: RowSlice rows {t.start}+{tuple(local.shape)[:1]} do not fit "
                                 f"{t.total_rows} rows")
            entry: _Local | None = _Local(local, (t.start, t.start + local.shape[0]), t.total_rows)
        elif _is_dtensor(t):
            entry = _dtensor(name, t)
        elif isinstance(t, torch.Tensor):
            local = t.detach().to("cpu", copy=True).contiguous()
            entry = _Local(local, None, local.shape[0] if local.dim() else 0)
        else:
            raise TypeError(f"state entry {name!r} is a {type(t).__name__}, not a tensor, RowSlice or DTensor")
        if entry is not None and not (entry.rows is not None and entry.rows[0] == entry.rows[1]):
            out[name] = entry
    return out


def _info(name: str, e: _Local, digest: str | None = None) -> tuple[str, tuple[int, ...], str, tuple[int, int] | None]:
    """(dtype, whole shape, digest of what this rank holds, rows) for the exchange; `digest`: that digest where
    it is known (the payload's target digest of the tensor), else it is hashed here."""
    dt = dtype_of(e.tensor, name)
    local_shape = tuple(e.tensor.shape)
    if digest is None:
        digest = digest_elements(dt.name, local_shape, element_view(e.tensor)).hex()
    shape = local_shape if e.rows is None else (e.total_rows, *local_shape[1:])
    return dt.name, shape, digest, e.rows


def whole_infos(step: int, reports: list[dict]) -> dict[str, TensorInfo]:
    """The record's tensors from every rank's (dtype, shape, digest, rows): whole tensors once, sliced
    ones tiled exactly by the ranks' rows. ShardedPublishError when the ranks' tensors do not fit.
    A signed run's reports also give each held tensor's (or slice's) BLAKE3 (`blake3`: name -> hex): the
    record then carries them (a sliced tensor's combined by sliced_blake3)."""
    whole: dict[str, TensorInfo] = {}
    sliced: dict[str, list[tuple[int, int, str, str, tuple[int, ...], int]]] = {}
    strong: dict[tuple[str, int], str] = {}  # (name, first row) -> BLAKE3 of what a rank holds
    order: list[str] = []
    for rank, rep in enumerate(reports):
        for name, value in (rep.get("blake3") or {}).items():
            rows = rep["infos"][name][3]
            strong[(name, 0 if rows is None else rows[0])] = value
        for name, (dtype, shape, digest, rows) in rep["infos"].items():
            if name not in whole and name not in sliced:
                order.append(name)
            if rows is None:
                if name in whole or name in sliced:
                    raise ShardedPublishError(f"step {step}: tensor {name!r} is held whole by rank {rank} and by "
                                              f"another rank")
                whole[name] = TensorInfo(dtype, tuple(shape), digest, blake3=strong.get((name, 0)))
            else:
                if name in whole:
                    raise ShardedPublishError(f"step {step}: tensor {name!r} is held whole and sliced (rank {rank})")
                sliced.setdefault(name, []).append((rows[0], rows[1], digest, dtype, tuple(shape), rank))
    for name, ps in sliced.items():
        ps.sort()
        dtype, shape = ps[0][3], ps[0][4]
        pos = 0
        for start, stop, _, dt, sh, rank in ps:
            if (dt, sh) != (dtype, shape):
                raise ShardedPublishError(f"step {step}: rank {rank} holds {name!r} as {dt} {sh}, another as "
                                          f"{dtype} {shape}")
            if start != pos:
                raise ShardedPublishError(f"step {step}: the ranks' rows of {name!r} "
                                          f"{'overlap' if start < pos else 'leave a gap'} at row {start} "
                                          f"(rank {rank})")
            pos = stop
        if pos != shape[0]:
            raise ShardedPublishError(f"step {step}: the ranks hold rows 0-{pos} of {name!r}, which has {shape[0]}")
        slices = tuple((a, b, d) for a, b, d, *_ in ps)
        parts = tuple(strong.get((name, a), "") for a, *_ in ps)
        if all(parts):
            whole[name] = TensorInfo(dtype, shape, sliced_digest(dtype, shape, slices), slices,
                                     sliced_blake3(dtype, shape, slices, parts), parts)
        else:
            whole[name] = TensorInfo(dtype, shape, sliced_digest(dtype, shape, slices), slices)
    if not whole:
        raise ShardedPublishError(f"step {step}: no rank holds any tensor")
    return {name: whole[name] for name in order}


def _meta(infos: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Storage-free tensors of the whole model's shapes, for shard_plan and index_bytes."""
    from codec.tensors import DTYPES

    torch_of = {d.name: d.torch for d in DTYPES}
    return {k: torch.empty(v.shape, dtype=torch_of[v.dtype], device="meta") for k, v in infos.items()}


class ShardedPublisher:
    """Publishes a torch.distributed trainer's steps into one run; one instance on every rank.

    Call publish(state, step) on every rank with the same step and that rank's tensors (whole,
    RowSlice or DTensor). The ranks talk over a gloo group made at construction (a collective
    call on every rank of the default group; pass `group` to use one of your own, which must run
    CPU collectives) with `timeout` seconds per collective. snapshot_every, snapshot_fraction,
    max_shard_bytes (per rank file), effort, keep_snapshots, signing_key, trusted_keys and
    adopt_unsigned mean what they mean for relay.Publisher; snapshots are written synchronously,
    each rank its own files. The run must be empty (resume is refused, see the module docstring).
    """

    def __init__(self, url: str, *, group: Any = None, timeout: float = 120.0, storage_options: dict | None = None,
                 snapshot_every: int = 25, snapshot_fraction: float = 0.5,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, effort: str = "default",
                 keep_snapshots: int | None = None, signing_key: Any = None, trusted_keys: Any = None,
                 adopt_unsigned: bool = False, resume: bool = False) -> None:
        if resume:
            raise ValueError("resume is not supported for sharded runs: start a new run (a new URL), or rebase "
                             "and publish the head from a single process with relay.Publisher(resume=True)")
        if snapshot_every < 1 or snapshot_fraction <= 0:
            raise ValueError("snapshot_every must be >= 1 and snapshot_fraction > 0")
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError("keep_snapshots must be >= 1")
        if not dist.is_initialized():
            raise RuntimeError("ShardedPublisher needs torch.distributed.init_process_group first")
        self.url = url
        self.timeout = timeout
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.store = open_store(url, storage_options)
        self.snapshot_every, self.snapshot_fraction = snapshot_every, snapshot_fraction
        self.max_shard_bytes, self.effort, self.keep_snapshots = max_shard_bytes, effort, keep_snapshots
        self.signer = None if signing_key is None else Signer(signing_key)
        self.trusted = TrustedKeys.from_option(trusted_keys)
        self._adopt_unsigned = adopt_unsigned
        self.prev: dict[str, _Local] | None = None
        self._digests: dict[str, str] = {}  # the digest (hex) of each tensor of prev: encode need not hash it
        # kernels compile in the background; until they are ready, deltas are coded without them (codec/interim.py)
        self._warm = codec.warm_up(("encode",))
        self.step: int | None = None
        self._last_snapshot_step = 0
        self._last_snapshot_bytes = 0
        self._chain_bytes = 0
        self._snapshot_retry = False
        self._broken: str | None = None
        # a commit that raised without a refusal (it may have landed), with this rank's _Moves to it: on every rank
        self._outcome: CommitOutcome[_Moves] = CommitOutcome()
        # signed runs: name -> (xxh3 digest, rows, BLAKE3) of what this rank published last (and is publishing)
        self._strong_local: dict[str, tuple[str, tuple[int, int] | None, str]] = {}
        self._next_strong: dict[str, tuple[str, tuple[int, int] | None, str]] = {}
        mine = {"store": _store_identity(self.store.url, storage_options), "snapshot_every": snapshot_every,
                "snapshot_fraction": snapshot_fraction, "keep_snapshots": keep_snapshots, "timeout": timeout,
                "world": self.world}
        everyone = self._gather("start: comparing the ranks' settings", mine)
        differ = [(r, k, rep.get(k)) for r, rep in enumerate(everyone) for k in SHARED_SETTINGS
                  if rep.get(k) != everyone[0].get(k)]
        if differ:  # every rank sees the same gathered settings, so all refuse alike
            raise ShardedPublishError(
                f"{url}: the ranks' settings differ from rank 0's ("
                + "; ".join(f"rank {r} {k}={v!r}, rank 0 {everyone[0].get(k)!r}" for r, k, v in differ[:5])
                + "): give every rank the same store, snapshot_every, snapshot_fraction, keep_snapshots and timeout")
        hello: list[Any] = [None, None, None, False]
        if self.rank == 0:
            try:
                if self.store.read_manifest() is not None:
                    raise ValueError(f"{url}: the run already has steps; a sharded run starts empty (resume is "
                                     f"not supported)")
                require_no_leftovers(self.store)
                hello = [None, uuid.uuid4().hex, uuid.uuid4().hex, self.signer is not None]
            except Exception as exc:  # noqa: BLE001 - handed to every rank, raised below
                hello = [f"{type(exc).__name__}: {exc}", None, None, False]
        self._collective("start", lambda: dist.broadcast_object_list(hello, src=self._src(), group=self.group))
        if hello[0] is not None:
            raise ShardedPublishError(f"{url}: rank 0 refused to start: {hello[0]}")
        self.run, self.writer, self.strong = hello[1], hello[2], bool(hello[3])

    def _src(self) -> int:
        """Global rank of the group's rank 0 (what broadcast_object_list's src means)."""
        return dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0

    def _collective(self, what: str, call: Any) -> None:
        """Run one collective; a lost peer or a timeout becomes a ShardedPublishError, and the publisher is
        unusable afterwards (the group may hold a half-finished collective)."""
        try:
            call()
        except Exception as exc:
            self._broken = (f"{what}: rank {self.rank} of {self.world} lost the other ranks "
                            f"(a rank died, or did not answer within {self.timeout:g}s): {type(exc).__name__}: "
                            f"{str(exc)[:300]}")
            raise ShardedPublishError(f"{self.url}: {self._broken}; nothing was committed by this rank") from exc

    def _gather(self, what: str, mine: dict) -> list[dict]:
        out: list[Any] = [None] * self.world
        self._collective(what, lambda: dist.all_gather_object(out, mine, group=self.group))
        return out

    def _failed(self, step: int, reports: list[dict], stage: str) -> None:
        bad = [(r, rep["error"]) for r, rep in enumerate(reports) if rep.get("error")]
        if bad:
            raise ShardedPublishError(f"{self.url}: step {step} not published ({stage}): "
                                      + "; ".join(f"rank {r}: {e}" for r, e in bad))

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, state: Any, step: int) -> None:
        """Publish this rank's part of `step`; returns on every rank once rank 0 has committed it (or raises
        ShardedPublishError on every rank, the step not visible)."""
        if self._broken is not None:
            raise ShardedPublishError(f"{self.url}: this publisher lost its ranks earlier ({self._broken})")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
            raise ValueError(f"step must be an integer from 0 to 2**63-1, got {step!r}")
        if self.step is not None and step <= self.step:
            raise ValueError(f"step {step} does not increase (last published step is {self.step})")
        if self._outcome.pending is not None and self._settle(step):
            return  # this very step had landed: the call is the trainer's retry of it
        mine: dict[str, Any] = {"step": step}
        local: dict[str, _Local] = {}
        try:
            local = local_tensors(state)
            mine.update(self._upload_part(local, step))
        except Exception as exc:  # noqa: BLE001 - reported to every rank through the exchange
            log.error("%s: rank %d cannot publish step %d: %s", self.url, self.rank, step, exc)
            mine["error"] = f"{type(exc).__name__}: {exc}"
        reports = self._gather(f"step {step}: exchanging parts", mine)
        steps = {rep["step"] for rep in reports}
        if len(steps) != 1:
            raise ShardedPublishError(f"{self.url}: the ranks publish different steps {sorted(steps)}")
        self._failed(step, reports, "a rank's part")
        infos = whole_infos(step, reports)  # every rank checks the tiling, so all raise alike
        delta = self.prev is not None and all(rep["part"] != "mismatch" for rep in reports)
        delta_bytes = sum(rep["part"].size for rep in reports if isinstance(rep["part"], ObjRef))
        due = (not delta or self._snapshot_retry or step - self._last_snapshot_step >= self.snapshot_every
               or self._chain_bytes + delta_bytes > self.snapshot_fraction * self._last_snapshot_bytes)
        files: list[dict] | None = None
        if due:
            shot: dict[str, Any] = {}
            try:
                shot = self._upload_snapshot(local, step)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                log.error("%s: rank %d cannot upload its snapshot files of step %d: %s", self.url, self.rank, step,
                          exc)
                shot = {"error": f"{type(exc).__name__}: {exc}"}
            files = self._gather(f"step {step}: exchanging snapshot files", shot)
            if not delta:
                self._failed(step, files, "snapshot files, and no delta reaches the step")
            elif any(f.get("error") for f in files):
                log.error("%s: snapshot of step %d failed on some rank (%s); committing the delta, the next step "
                          "is snapshotted", self.url, step, [f.get("error") for f in files if f.get("error")])
                files = None
        moves = _Moves(step, local, {k: info[2] for k, info in mine["infos"].items()}, self._next_strong,
                       delta_bytes if delta else 0, None if files is None else sum(rep["bytes"] for rep in reports),
                       due and files is None)
        outcome: list[Any] = [None, False, None]  # rank 0's error, whether the step may have landed, its entry
        if self.rank == 0:
            entry = None
            try:
                entry, snap = self._entry(step, infos, reports if delta else None, files)
                self._commit(entry, snap)
            except Exception as exc:  # noqa: BLE001 - handed to every rank, raised below
                log.error("%s: commit of step %d failed: %s", self.url, step, exc)
                committed = False if entry is None else self._outcome.failed(entry, exc, moves)
                outcome = [f"{type(exc).__name__}: {exc}", committed, entry]
        try:
            self._collective(f"step {step}: waiting for rank 0's commit",
                             lambda: dist.broadcast_object_list(outcome, src=self._src(), group=self.group))
        except ShardedPublishError as exc:
            raise self._outcome_lost(step, exc, committed_here=self.rank == 0 and outcome[0] is None) from exc
        if outcome[0] is not None and outcome[1] is None:
            self._outcome.unsure(outcome[2], moves)  # every rank keeps it: the next publish settles it
            raise ShardedPublishError(f"{self.url}: step {step}: rank 0's commit failed without a refusal "
                                      f"({outcome[0]}), so it may have landed; the next publish reads the manifest "
                                      f"to learn which and carries on from there", committed=None)
        if outcome[0] is not None:
            raise ShardedPublishError(f"{self.url}: step {step} not published: rank 0's commit failed: {outcome[0]}")
        self._move(moves)

    def _move(self, m: _Moves) -> None:
        """This rank's state after step `m.step` is committed: the base of the next step's delta."""
        self._chain_bytes += m.delta_bytes
        self._snapshot_retry = m.snapshot_retry
        if m.snapshot_bytes is not None:
            self._last_snapshot_step = m.step
            self._last_snapshot_bytes = m.snapshot_bytes
            self._chain_bytes = 0
        self.prev, self.step = m.local, m.step
        self._digests = m.digests
        self._strong_local, self._next_strong = m.strong, {}

    def _settle(self, step: int) -> bool:
        """Learn whether the step whose commit raised without a refusal landed, before building on either head:
        rank 0 reads the manifest (relay.commit.CommitOutcome) and tells every rank, so all move alike; landed,
        each rank moves to that step as if the commit had been reported. True if `step` is that step (the
        trainer's retry: nothing is left to write). A failed read fails this publish on every rank, and the
        next one reads again."""
        pending = self._outcome.pending
        if pending is None:
            return False
        unknown = step == pending.entry.step  # this publish is the retry of the step whose fate is unknown
        answer: list[Any] = [None, False]
        if self.rank == 0:
            try:
                answer = [None, self._outcome.landed(self.store, self.run, self.writer)]
            except Exception as exc:  # noqa: BLE001 - handed to every rank, raised below
                answer = [f"{type(exc).__name__}: {exc}", False]
        try:
            self._collective(f"step {step}: learning step {pending.entry.step}'s fate",
                             lambda: dist.broadcast_object_list(answer, src=self._src(), group=self.group))
        except ShardedPublishError as exc:
            raise ShardedPublishError(str(exc), committed=None if unknown else False) from exc
        if answer[0] is not None:
            raise ShardedPublishError(
                f"{self.url}: step {step}: rank 0 cannot read the manifest to learn whether step {pending.entry.step}, "
                f"whose commit raised, landed ({answer[0]}); nothing was written, the next publish reads it again",
                committed=None if unknown else False)
        u = self._outcome.settle(bool(answer[1]), self.url)
        if u is not None:
            self._move(u.moves)
        return CommitOutcome.retried(u, step)

    def _upload_part(self, local: dict[str, _Local], step: int) -> dict[str, Any]:
        """This rank's digests, and its delta part uploaded ("mismatch": its tensors changed structure,
        None: it holds nothing or there is no previous step)."""
        part, payload = self._encode_part(local, step)
        # a payload records its tensors' digests (the scan made them): the exchange hashes only without one
        found = {} if payload is None else codec.digests(payload, compiled=self._warm.done())
        infos = {name: _info(name, e, found[name].target if name in found else None) for name, e in local.items()}
        out: dict[str, Any] = {"infos": infos, "part": part, "names": list(local),
                               "blake3": self._blake3_of(local, infos),
                               "rows": {k: e.rows for k, e in local.items() if e.rows is not None},
                               "bytes": sum(e.tensor.numel() * e.tensor.element_size() for e in local.values())}
        if payload is not None:
            ref = ObjRef.of(delta_key(step, self.rank), payload, self.strong)
            self._put(ref.key, payload)
            out["part"] = ref
        return out

    def _encode_part(self, local: dict[str, _Local], step: int) -> tuple[str | None, bytes | None]:
        """(part, payload): this rank's delta from prev, or no payload and why ("mismatch": its tensors changed
        structure; None: it holds nothing or there is no previous step). The bases' digests are known (the last
        step's), so the scan hashes targets only; while the kernels compile, the payload is coded without them."""
        prev = self.prev
        if prev is None:
            return None, None
        if {k: v.rows for k, v in prev.items()} != {k: v.rows for k, v in local.items()}:
            return "mismatch", None  # another tensor set or other rows: only a snapshot reaches the step
        if not local:
            return None, None  # held nothing, holds nothing
        compiled = self._warm.done()
        if not compiled:
            log.info("%s: rank %d: step %d is coded without compiled kernels (they are still compiling)", self.url,
                     self.rank, step)
        try:
            payload = codec.encode({k: v.tensor for k, v in prev.items()}, {k: v.tensor for k, v in local.items()},
                                   effort=self.effort, base_digests=self._digests, compiled=compiled)
        except codec.CheckpointMismatchError as exc:
            log.info("%s: rank %d: step %d changes its tensors (%s); the step is a snapshot", self.url, self.rank,
                     step, exc)
            return "mismatch", None
        return None, payload

    def _blake3_of(self, local: dict[str, _Local], infos: dict[str, tuple]) -> dict[str, str]:
        """Signed runs: the BLAKE3 of each tensor (or slice) this rank holds, reused from the previous step where
        its xxh3 digest and rows did not change (only changed bytes are rehashed). Empty for unsigned runs."""
        if not self.strong:
            return {}
        out = {}
        for name, e in local.items():
            dtype, _, digest, rows = infos[name]
            known = self._strong_local.get(name)
            if known is not None and known[:2] == (digest, rows):
                out[name] = known[2]
            else:
                out[name] = tensor_blake3(dtype, tuple(e.tensor.shape), element_view(e.tensor))
        self._next_strong = {k: (infos[k][2], infos[k][3], v) for k, v in out.items()}
        return out

    def _upload_snapshot(self, local: dict[str, _Local], step: int) -> dict[str, Any]:
        """This rank's snapshot files (slices under the tensor's name, their rows in the metadata)."""
        tensors = {k: e.tensor for k, e in local.items()}
        plan = shard_plan(tensors, self.max_shard_bytes) if tensors else {}
        names = sorted(set(plan.values()))
        rename = {n: f"rank-{self.rank:05d}-of-{self.world:05d}-{i + 1:05d}.safetensors" for i, n in enumerate(names)}
        refs, layout = [], {}
        for shard in names:
            file = rename[shard]
            if not safe_shard_name(file):  # the pattern above always is; a guard for edits
                raise ValueError(f"{file!r} is not a safe shard name")
            part = {k: tensors[k] for k, s in plan.items() if s == shard}
            rows = {k: list(local[k].rows) for k in part if local[k].rows is not None}  # type: ignore[arg-type]
            meta = {"step": str(step)}
            if rows:
                meta[ROWS_KEY] = json.dumps(rows, separators=(",", ":"), sort_keys=True)
            data = st_save(part, metadata=meta)
            ref = ObjRef.of(snapshot_prefix(step) + file, data, self.strong)
            self._put(ref.key, data)
            refs.append(ref)
            layout.update({k: (file, local[k].rows) for k in part})
        return {"files": refs, "layout": layout}

    def _outcome_lost(self, step: int, exc: ShardedPublishError, committed_here: bool) -> ShardedPublishError:
        """The error for a rank that lost the others while rank 0's outcome was broadcast: the commit may have
        landed (a commit slower than the timeout does), so say what the manifest shows, never "nothing was
        committed" unless that is known."""
        reason = self._broken or str(exc)
        committed: bool | None = True if committed_here else None
        if not committed_here:
            try:
                if commit_landed(self.store, self.run, self.writer, step):
                    committed = True
            except Exception as read_exc:  # noqa: BLE001 - only the message depends on it
                log.warning("%s: cannot read the manifest to learn step %d's fate: %s", self.url, step, read_exc)
        if committed:
            return ShardedPublishError(f"{self.url}: step {step} was committed (it is visible), but {reason}; this "
                                       f"publisher is unusable", committed=True)
        return ShardedPublishError(f"{self.url}: step {step}: {reason}; not in the manifest when this rank looked, "
                                   f"but rank 0's commit may still land", committed=None)

    def _put(self, key: str, data: bytes) -> None:
        """Create an immutable object. Other bytes under the key of a step above our head are what a failed
        attempt at that step left (a rank's error, then a retry with other tensors): replaced while this run
        is still ours at that head (relay.commit.create_owned)."""
        create_owned(self.store, key, lambda: self.store.put_immutable(key, data), run=self.run,
                     writer=self.writer, head=self.step)

    def _entry(self, step: int, infos: dict[str, TensorInfo], parts: list[dict] | None,
               files: list[dict] | None) -> tuple[Step, Snapshot | None]:
        """Rank 0: the record and the snapshot index in the store; the manifest entries that name them."""
        meta = _meta(infos)
        record = Record(self.run, step, infos, shard_plan(meta, DEFAULT_SHARD_BYTES))
        data = record.to_bytes()
        rec_ref = ObjRef.of(record_key(step), data, self.strong)
        self._put(rec_ref.key, data)
        entry = Step(step, rec_ref)
        if parts is not None:
            entry = Step(step, rec_ref, self.step, tuple(
                Part(rep["part"], tuple(rep["names"]), dict(rep["rows"]) or None)
                for rep in parts if isinstance(rep["part"], ObjRef)))
        snap = None
        if files is not None:
            weight_map: dict[str, str] = {}
            slices: dict[str, list[list[Any]]] = {}
            for rep in files:
                for name, (file, rows) in rep["layout"].items():
                    if rows is None:
                        weight_map[name] = file
                    else:
                        slices.setdefault(name, []).append([rows[0], rows[1], file])
            extra: dict[str, Any] = {"step": step}
            if slices:
                extra[SLICES_KEY] = {k: sorted(v) for k, v in slices.items()}
            index = index_bytes(meta, weight_map, **extra)
            index_ref = ObjRef.of(snapshot_prefix(step) + INDEX_NAME, index, self.strong)
            self._put(index_ref.key, index)
            refs = sorted((r for rep in files for r in rep["files"]), key=lambda r: r.key)
            snap = Snapshot(step, index_ref, tuple(refs))
        return entry, snap

    def _commit(self, entry: Step, snap: Snapshot | None) -> None:
        """Rank 0: the one manifest commit of a step (and its snapshot), on the head this publisher holds."""
        head = self.step

        def add(cur: Manifest | None, unsure: bool) -> Manifest | None:
            return extend_run(cur, unsure, url=self.url, run=self.run, writer=self.writer, head=head, entry=entry,
                              snap=snap, keep_snapshots=self.keep_snapshots)

        update_manifest(self.store, add, signer=self.signer, trusted=self.trusted,
                        adopt_unsigned=self._adopt_unsigned)
        if self.signer is not None:
            self._adopt_unsigned = False

    def close(self) -> None:
        """Nothing runs in the background; kept for symmetry with relay.Publisher."""

    def __enter__(self) -> "ShardedPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store_identity(url: str, options: dict | None) -> tuple[str, str | None]:
    """What tells two ranks' stores apart: the normalised URL and the endpoint an S3 client is pointed at
    (credentials are left out)."""
    opts = options or {}
    client = opts.get("client_kwargs")
    endpoint = opts.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, dict) else None)
    return url, None if endpoint is None else str(endpoint)


__all__ = ["ShardedPublisher", "ShardedPublishError", "RowSlice", "local_tensors", "whole_infos"]
