"""Inference-engine adapters: how a watcher puts each verified step into a running engine.

A watcher (relay.watcher.Watcher(engine=...)) hands every step it persisted to an Engine in two
phases, so that the engine never serves half a step and pauses only for the apply:

1. stage(update): load what the step changes into the engine's staging area while it keeps
   serving the old step (read the changed tensors from DEST, validate names);
2. commit(step): pause, apply the staged tensors, set the engine's weight version to the step,
   resume. A commit that fails leaves the engine on its previous step, serving, and raises
   EngineError; abort() drops a staged update that will not be committed.

state() is a JSON-able summary (kind, step, weight_version, status, last_pause_s, ...) for a
fleet ledger; its "step" is the step the engine is known to serve, None once that is unknown (an
engine that restarted, a commit whose outcome is unknown): a watcher then re-pushes its held step
whole. Adapters: relay.engines.vllm (in-process `LLM` and `vllm serve` over HTTP). An
engine adapter module imports its engine lazily: the runtime never needs the engine's package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from relay.manifest import TensorInfo

__all__ = ["Engine", "EngineError", "Update", "changed_names"]


def _tolerate_vllm_kernel_scan() -> None:
    """Let vLLM start in a process that imported numba (the codec does).

    At engine start vLLM 0.32's CPU platform rebinds kernels by scanning every module attribute with
    `vars(value).get("kernel")`; llvmlite's `binding.ffi.lib` answers any attribute, `__dict__` too,
    with a C-function wrapper, so the scan raises AttributeError and the engine never starts. An empty
    `__dict__` entry in the lib's function table (consulted first, never used by llvmlite) makes
    vars(lib) an empty mapping. Applied on import (relay imports this package), before any engine starts."""
    try:
        from llvmlite.binding import ffi

        ffi.lib._fntab.setdefault("__dict__", {})
    except (ImportError, AttributeError):  # another llvmlite: nothing to tolerate, or nothing we know
        pass


_tolerate_vllm_kernel_scan()


class EngineError(RuntimeError):
    """The engine did not take the step: it stays on (and serves) the step it held before."""


@dataclass(frozen=True)
class Update:
    """One verified step for an engine.

    `tensors` is the watcher's live held state (valid until its next sync: copy what must outlive
    it); `files` the version directory that holds this step as a complete safetensors checkpoint
    (the watcher's persist="full" DEST), stable until the watcher persists a newer step;
    `changed` the names whose record entry differs from the step the engine holds, or None when
    the engine's step is unknown (its first update: everything moves); `previous` the version
    directory of the step the engine holds (the watcher keeps it until the engine takes a newer
    step: what a failed commit rolls back to), None when unknown."""

    step: int
    run: str
    tensors: Mapping[str, torch.Tensor]
    files: Path
    changed: frozenset[str] | None
    previous: Path | None = None


def changed_names(held: Mapping[str, TensorInfo] | None, new: Mapping[str, TensorInfo]) -> frozenset[str] | None:
    """Names of `new` whose dtype, shape or digest differ from `held` (the record of the step an engine
    holds), from the records alone: no tensor is hashed. None when nothing is known of the held step,
    or when it had names the new step lacks (a partial load could not remove them)."""
    if held is None or set(held) - set(new):
        return None
    return frozenset(k for k, info in new.items() if held.get(k) != info)


@runtime_checkable
class Engine(Protocol):
    """What a watcher drives (see the module docstring for the contract of each phase)."""

    def stage(self, update: Update) -> None:
        """Prepare `update` while the engine serves its current step; raise EngineError to refuse it."""
        ...

    def commit(self, step: int) -> float:
        """Pause, apply the staged update of `step`, set the weight version, resume; return the pause
        in seconds. On failure the engine is back on its previous step, serving (EngineError)."""
        ...

    def abort(self) -> None:
        """Drop a staged update (the watcher will not commit it)."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-able: at least kind, step, weight_version, status and last_pause_s."""
        ...
