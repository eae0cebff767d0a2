"""TRL and any transformers Trainer: publish the policy after every optimizer step (docs/TRL.md).

    trainer = GRPOTrainer(..., callbacks=[DeltaRelayCallback("s3://bucket/run")])

`on_step_end` runs after the optimizer step, the scheduler and zero_grad; `state.global_step` there is the
step just taken, and the weights are those the next step (and in GRPO its generation) starts from. The
callback publishes them as that step; the initial weights go out at `on_train_begin` as the trainer's
starting step (0, or the step a resumed run starts from), so rollout hosts begin where training does.

Layouts (`layout="auto"` picks one from the model):
* "main": the model is whole on every process (one process, DDP): the main process publishes through
  relay.Publisher, the others do nothing.
* "sharded": FSDP2 (DTensor Shard(0)/Replicate parameters): every rank publishes its own rows through
  relay.ShardedPublisher; nothing is gathered.
* "gather": the full state is gathered onto rank 0 (torch.distributed.checkpoint, a collective on every
  rank) and rank 0 publishes it through relay.Publisher.
DeepSpeed ZeRO-3 partitions parameters outside torch's DTensor; it is refused with a clear error.

Blocking: with `background=True` (default) the hook copies the weights (its own host buffers, reused
every step; under "sharded" each rank's rows) and hands the copy to one publishing thread; training goes
on while that thread encodes, uploads and commits. The next hook first waits for the previous publish to
finish (backpressure: steps are never dropped or reordered) and re-raises its failure, so a fenced or
failing publisher stops training at the next step instead of silently falling behind. With
`background=False` the hook publishes inline (encode, upload and commit are added to every step).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from transformers import TrainerCallback

from relay.distributed import RowSlice, ShardedPublisher, local_tensors
from relay.publisher import Publisher

__all__ = ["DeltaRelayCallback", "LAYOUTS"]

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "main", "sharded", "gather")


def _unwrap(model: Any) -> torch.nn.Module:
    """The module itself under DDP (whose state_dict keys carry `module.`)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"DeltaRelayCallback: the trainer passed a {type(model).__name__} as the model, not an "
                        f"nn.Module")
    return model


def _has_dtensors(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _is_zero3(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


class DeltaRelayCallback(TrainerCallback):
    """Publishes the trainer's model into `url` after every optimizer step, as the trainer's global step.

    url, storage_options and `publisher_options` (snapshot_every, signing_key, workers, resume, ...) go to
    relay.Publisher ("main", "gather") or relay.ShardedPublisher ("sharded"; `timeout` too). `layout`: see
    the module docstring. `background`: publish on a thread of its own (the hook costs a copy of the
    weights) or inline. `publish_initial`: publish the weights training starts from at on_train_begin.
    """

    def __init__(self, url: str, *, storage_options: dict | None = None, layout: str = "auto",
                 background: bool = True, publish_initial: bool = True, **publisher_options: Any) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"DeltaRelayCallback: layout must be one of {LAYOUTS}, got {layout!r}")
        self.url = url
        self.storage_options = storage_options
        self.layout = layout
        self.background = background
        self.publish_initial = publish_initial
        self.publisher_options = publisher_options
        self.publisher: Publisher | ShardedPublisher | None = None
        self.published: int | None = None  # the last step committed
        self.submitted: int | None = None  # the last step handed to the publisher
        self._resolved: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    # -- the trainer's hooks ------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        module = _unwrap(model)
        self._start(module, state)
        if self.publish_initial:
            self._publish(module, state.global_step, state)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        module = _unwrap(model)
        if self._resolved is None:
            self._start(module, state)
        self._publish(module, state.global_step, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # -- publishing ---------------------------------------------------------------------------
    def _start(self, model: torch.nn.Module, state: Any) -> None:
        if _is_zero3(model):
            raise NotImplementedError(
                "DeltaRelayCallback: DeepSpeed ZeRO-3 partitions the parameters outside torch's DTensor and "
                "deltarelay does not gather them; use FSDP2 (layout 'sharded' or 'gather'), ZeRO-1/2 or DDP")
        layout = self.layout
        if layout == "auto":
            layout = "sharded" if _has_dtensors(model) else "main"
        if layout in ("sharded", "gather") and not torch.distributed.is_initialized():
            raise RuntimeError(f"DeltaRelayCallback: layout {layout!r} needs torch.distributed initialized (the "
                               f"trainer runs under torchrun / accelerate launch)")
        if layout == "main" and _has_dtensors(model):
            raise ValueError("DeltaRelayCallback: layout 'main' with DTensor (FSDP2-sharded) parameters would "
                             "publish one rank's rows as the model; use layout 'sharded' or 'gather'")
        self._resolved = layout
        if layout == "sharded":
            self.publisher = ShardedPublisher(self.url, storage_options=self.storage_options,
                                              **self.publisher_options)
        elif self._publishes(state):
            self.publisher = Publisher(self.url, storage_options=self.storage_options, **self.publisher_options)
        self.submitted = getattr(self.publisher, "step", None)  # a resumed run's head
        if self.background and self.publisher is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltarelay-trl")

    def _publishes(self, state: Any) -> bool:
        """Whether this process holds a publisher: every rank under "sharded", the main process otherwise."""
        if self._resolved == "sharded":
            return True
        if torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return bool(getattr(state, "is_world_process_zero", True))

    def _publish(self, model: torch.nn.Module, step: int, state: Any) -> None:
        full = None
        if self._resolved == "gather":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # a collective: every rank takes part (before any rank may skip), rank 0 receives the full state
            # as fresh CPU tensors of its own
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.publisher is None or (self.submitted is not None and step <= self.submitted):
            return  # not this process's to publish; or a resumed run already holds this step
        if full is not None:
            self._submit(full, step)
        elif self._resolved == "sharded":
            rows = {name: (RowSlice(e.tensor, e.rows[0], e.total_rows) if e.rows is not None else e.tensor)
                    for name, e in local_tensors(model.state_dict()).items()}  # private copies of this rank's rows
            self._submit(rows, step)
        else:
            self.wait()  # the buffers are the previous publish's input until it returns
            self._submit(self._copy(model.state_dict()) if self._pool is not None else model.state_dict(), step)

    def _copy(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state in this callback's own host buffers (allocated once, reused while the tensor set holds)."""
        bufs = self._buffers
        if bufs.keys() != state.keys() or any(bufs[k].shape != t.shape or bufs[k].dtype != t.dtype
                                              for k, t in state.items()):
            bufs = self._buffers = {k: torch.empty(t.shape, dtype=t.dtype, device="cpu") for k, t in state.items()}
        for k, t in state.items():
            bufs[k].copy_(t.detach())
        return bufs

    def _submit(self, state: dict[str, Any], step: int) -> None:
        publisher = self.publisher
        assert publisher is not None
        self.submitted = step
        if self._pool is None:
            publisher.publish(state, step)
            self.published = step
            return
        self.wait()
        self._pending = self._pool.submit(publisher.publish, state, step)
        self._pending_step = step

    def wait(self) -> None:
        """Block until the step handed to the publishing thread is committed; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.result()
        self.published = self._pending_step

    def flush(self) -> None:
        """wait(), then the publisher's background snapshots (relay.Publisher.flush)."""
        self.wait()
        if isinstance(self.publisher, Publisher):
            self.publisher.flush()

    def close(self) -> None:
        """Finish what is pending and close the publisher (on_train_end does this)."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self.publisher is not None:
                self.publisher.close()
            self.publisher, self._resolved, self._buffers = None, None, {}
