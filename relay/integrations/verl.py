"""verl: a checkpoint-engine backend that moves the actor's weights to the rollout replicas through deltarelay
(docs/VERL.md). A verl user picks it by configuration:

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltarelay
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=relay.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarelay.url=s3://bucket/run

verl's CheckpointEngineManager drives every backend alike (verl/checkpoint_engine/base.py, 0.9.x): `prepare` on
every actor and rollout worker, `build_topology` once, `init_process_group` on each with its share, then the
actor workers' `send_weights(per-tensor generator, global_steps)` alongside the rollout workers'
`receive_weights(global_steps)` (whose (name, tensor) pairs go to verl's own rollout adapter), then
`finalize`. Here the store is the transport: no process group, no topology. The actor rank that verl builds
with `is_master=True` publishes the full tensors as `global_steps` through relay.Publisher (the other actor
ranks drain the generator, whose per-tensor gathers are collectives they must join); each rollout worker
runs a relay.Watcher on `source_url` (its region's store, `url` by default) until it holds that step,
verified, and yields its tensors. verl builds rollout workers' engines without `is_master`: that is how the
two sides are told apart (None).

Only backends named `delta_sharded` receive verl's training engine (per-rank shards); this one receives the
full tensors verl gathers, so the publish is from one rank (relay.ShardedPublisher needs the per-rank
shards: a custom checkpoint_manager_class or an upstream change would give it them).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from typing import Any, AsyncGenerator

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from relay.publisher import Publisher
from relay.watcher import SyncTimeout, Watcher

__all__ = ["BACKEND", "DeltaRelayCheckpointEngine"]

log = logging.getLogger(__name__)

BACKEND = "deltarelay"


@CheckpointEngineRegistry.register(BACKEND)
class DeltaRelayCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine: the actor master publishes each step to `url`; rollout workers watch
    `source_url` (default `url`) into `dest` (default a temporary directory per worker).

    engine_kwargs (`...checkpoint_engine.engine_kwargs.deltarelay`): url, storage_options, source_url,
    source_storage_options, dest, timeout (seconds a rollout worker waits for the step), publisher (a dict of
    relay.Publisher options: snapshot_every, signing_key, resume, ...), watcher (relay.Watcher options).
    `bucket_size` is verl's (every backend gets it) and unused: nothing is bucketed.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, *, url: str,
                 storage_options: dict | None = None, source_url: str | None = None,
                 source_storage_options: dict | None = None, dest: str | None = None, timeout: float = 600.0,
                 publisher: dict | None = None, watcher: dict | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError("deltarelay checkpoint engine: engine_kwargs.deltarelay.url (the run's store URL) is "
                             "required")
        if not timeout > 0:
            raise ValueError(f"deltarelay checkpoint engine: timeout must be > 0 seconds, got {timeout!r}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.role = "rollout" if is_master is None else "actor"
        self.url, self.storage_options = url, storage_options
        self.source_url = source_url or url
        self.source_storage_options = source_storage_options if source_url else storage_options
        self.dest = dest
        self.timeout = timeout
        self.publisher_options = dict(publisher or {})
        self.watcher_options = dict(watcher or {})
        self._publisher: Publisher | None = None
        self._watcher: Watcher | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    # -- the manager's protocol: the store is the transport, so there is no group to build -----
    def prepare(self) -> dict[str, Any]:
        return {"backend": BACKEND, "role": self.role}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"deltarelay checkpoint engine: init_process_group takes no topology, got {sorted(kwargs)}")

    def finalize(self) -> None:
        """Between syncs: background snapshots go on (relay.Publisher); the watcher keeps its held step."""

    # -- actor ------------------------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the gathered weights as `global_steps` (the master rank; the others drain the generator)."""
        if self.role != "actor":
            raise RuntimeError("deltarelay checkpoint engine: send_weights on a rollout worker's engine")
        state: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_master:  # a host copy: verl may reuse the gathered buffer for the next tensor
                state[name] = tensor.detach().to("cpu", copy=True)
        if not self.is_master:
            return {}
        if self._publisher is None:
            self._publisher = Publisher(self.url, storage_options=self.storage_options, **self.publisher_options)
        pub = self._publisher
        step = global_steps if global_steps is not None else (-1 if pub.step is None else pub.step) + 1
        if pub.step is not None and step <= pub.step:
            raise ValueError(f"deltarelay checkpoint engine: global_steps {step} does not follow the last published "
                             f"step {pub.step} of {self.url}")
        before, t0 = pub.bytes_uploaded, time.perf_counter()
        await asyncio.to_thread(pub.publish, state, step)
        return {"deltarelay/step": float(step), "deltarelay/publish_s": time.perf_counter() - t0,
                "deltarelay/bytes_uploaded": float(pub.bytes_uploaded - before)}

    # -- rollout ----------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Sync the watcher until it holds `global_steps` (the head when None), verified; yield its tensors."""
        if self.role != "rollout":
            raise RuntimeError("deltarelay checkpoint engine: receive_weights on an actor worker's engine")
        tensors = await asyncio.to_thread(self._reach, global_steps)
        for name, tensor in tensors.items():
            yield name, tensor

    def _reach(self, step: int | None) -> dict[str, torch.Tensor]:
        if self._watcher is None:
            dest = self.dest
            if dest is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="deltarelay-verl-")
                dest = self._tmp.name
            self._watcher = Watcher(self.source_url, dest, storage_options=self.source_storage_options,
                                    **self.watcher_options)
        w = self._watcher
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            held: int | None
            try:
                held = w.sync(timeout=max(left, 0.001))
            except SyncTimeout:
                held = w.step
            if step is None or (held is not None and held >= step):
                break
            if time.monotonic() >= deadline:
                raise SyncTimeout(f"deltarelay checkpoint engine: {self.source_url} did not reach step {step} "
                                  f"within {self.timeout:g}s (the watcher holds {held})")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        if step is not None and held != step:
            log.warning("%s: rollout asked for step %s and the store's head is already %s; loading %s",
                        self.source_url, step, held, held)
        assert w.tensors is not None
        return w.tensors
