"""vLLM adapter: each verified step goes into a live vLLM engine without a restart.

Two halves. WorkerExtension runs inside vLLM's workers (pass
`worker_extension_cls="relay.engines.vllm.WorkerExtension"` to `LLM(...)` or
`--worker-extension-cls` to `vllm serve`); it stages a step's changed tensors from the watcher's
DEST version directory, checks them against the step the engine serves, and applies them with
vLLM's own reload path (reload_weights, which re-runs the post-load processing the CPU and GPU
backends apply, layer by layer); an apply that fails midway is rolled back through the same path
from the previous step's files. A driver calls it through collective_rpc: VLLMEngine for
an in-process `vllm.LLM`, VLLMServer for `vllm serve` over its HTTP API (VLLM_SERVER_DEV_MODE=1:
/collective_rpc, /pause, /resume, /update_weight_version, /reset_prefix_cache).

Only changed tensors move: a step's changed names (from the records, relay.engines.changed_names)
are widened to whole vLLM layers (q/k/v into qkv_proj, gate/up into gate_up_proj, per the model's
packed_modules_mapping), since vLLM processes a layer once all its tensors are loaded; a model
whose names do not map onto its layers this way is reloaded whole. vllm is imported only inside
the workers, which already run it: this module needs no vllm to import.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from relay.engines import EngineError, Update

__all__ = ["VLLMEngine", "VLLMServer", "WorkerExtension", "layer_of", "widen_to_layers"]

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
RPC_STAGE, RPC_COMMIT, RPC_ABORT = "deltarelay_stage", "deltarelay_commit", "deltarelay_abort"


def layer_of(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM module a checkpoint tensor is loaded into: its own module, or the fused module that
    `packed` (a model's packed_modules_mapping, e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    folds it into."""
    module = name.rpartition(".")[0]
    head, _, last = module.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            return f"{head}.{fused}" if head else fused
    return module


def widen_to_layers(changed: Iterable[str], names: Iterable[str], packed: dict[str, list[str]]) -> list[str]:
    """Every name of `names` that lands in a layer one of `changed` lands in, grouped by layer (vLLM
    buffers a layer's tensors until the last arrives: grouped, one layer is buffered at a time)."""
    by_layer: dict[str, list[str]] = {}
    for n in sorted(names):
        by_layer.setdefault(layer_of(n, packed), []).append(n)
    touched = {layer_of(n, packed) for n in changed}
    return [n for layer in sorted(touched) for n in by_layer.get(layer, [])]


def _shard_files(files: Path) -> dict[str, list[str]]:
    """shard file -> tensor names of a safetensors checkpoint directory (index, else every *.safetensors)."""
    from safetensors import safe_open

    index = files / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            out.setdefault(shard, []).append(name)
        return out
    shards = {}
    for p in sorted(files.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            shards[p.name] = list(f.keys())
    return shards


class WorkerExtension:
    """Methods vLLM mixes into its worker class (worker_extension_cls); called through collective_rpc.

    Arguments and results are JSON strings and dicts, so the same calls work over `vllm serve`'s
    /collective_rpc (which passes strings only). `self` is the vLLM worker: model_runner,
    reload_weights and vllm_config are its. Only vLLM's public worker and reload API is used: a failed
    apply is rolled back by finishing vLLM's interrupted reload (finalize_layerwise_reload) and
    reloading the previous step's values of the touched layers through the same reload_weights."""

    _deltarelay_staged: tuple[int, list[tuple[str, torch.Tensor]], Path | None] | None = None

    def deltarelay_stage(self, spec: str) -> dict:
        """Read the tensors of the step in spec's "files" that its "changed" names touch (whole layers;
        all tensors when "changed" is null or the model's layers cannot be told apart) into memory,
        while the engine keeps serving, and check them against the step the engine serves ("previous",
        its version directory; null: the engine's own checkpoint, as started): same names, shapes and
        dtypes, so an apply cannot fail on bad input and a failed one can be rolled back; and against the
        record of "step" in the directory's state file (_check_labelled), so that nothing but that step's
        weights is ever served as it.
        spec: {"step": int, "files": dir, "changed": [names] | null, "previous": dir | null}."""
        req = json.loads(spec)
        step, files, changed = int(req["step"]), Path(req["files"]), req.get("changed")
        previous = Path(req["previous"]) if req.get("previous") else None
        self._deltarelay_staged = None
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        shards = _shard_files(files)
        names = [n for ns in shards.values() for n in ns]
        if not names:
            raise ValueError(f"{files}: no safetensors tensors to load for step {step}")
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        layers = {layer_of(n, packed) for n in names}
        if changed is None or layers - {name for name, _ in model.named_modules()}:
            load = widen_to_layers(names, names, packed)  # the first update, or names that are not module paths
        else:
            unknown = sorted(set(changed) - set(names))
            if unknown:
                raise ValueError(f"{files}: step {step} lacks changed tensor(s) {unknown[:5]}")
            load = widen_to_layers(changed, names, packed)
        _check_fits(step, files, load, previous, self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        staged = dict(_read(files, load))  # a copy in memory: the files may go with the next step
        _check_labelled(step, files, staged)
        self._deltarelay_staged = (step, [(n, staged[n]) for n in load], previous)
        return {"step": step, "tensors": len(load), "bytes": sum(t.nbytes for t in staged.values()),
                "layers": len({layer_of(n, packed) for n in load}), "of_tensors": len(names)}

    def deltarelay_abort(self) -> None:
        """Drop a staged step."""
        self._deltarelay_staged = None

    def deltarelay_commit(self, spec: str) -> dict:
        """Apply the staged step (spec: {"step": int}) with vLLM's reload path. If that fails, the engine is
        rolled back to the step it served and the result says so ("error", "rolled_back_to"); if the
        rollback fails too, RuntimeError (the engine's weights are then unknown)."""
        step = int(json.loads(spec)["step"])
        staged, self._deltarelay_staged = self._deltarelay_staged, None
        if staged is None or staged[0] != step:
            raise ValueError(f"step {step} was not staged (staged: {None if staged is None else staged[0]})")
        _, weights, previous = staged
        t0 = time.perf_counter()
        try:
            with _quiet_partial_reload():
                self.reload_weights(weights_iterator=self._deltarelay_weights(weights),  # type: ignore[attr-defined]
                                    is_checkpoint_format=True)
        except Exception as exc:  # noqa: BLE001 - rolled back below, reported in the result
            error = f"{type(exc).__name__}: {exc}"
            log.error("deltarelay: applying step %d failed (%s); rolling back", step, error)
            self._deltarelay_roll_back(step, [n for n, _ in weights], previous, error)
            return {"step": step, "error": error, "rolled_back_to": "previous" if previous else "checkpoint",
                    "apply_s": time.perf_counter() - t0}
        return {"step": step, "tensors": len(weights), "apply_s": time.perf_counter() - t0}

    def _deltarelay_weights(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """What reload_weights reads the staged tensors from (a subclass may wrap it: tests inject faults)."""
        return iter(weights)

    def _deltarelay_roll_back(self, step: int, names: list[str], previous: Path | None, error: str) -> None:
        """Put the engine back on the step it served after a reload of `names` failed midway: finish vLLM's
        interrupted layerwise reload (every layer back on real tensors, its loaders unwrapped), then
        reload the previous values of `names` (whole layers, from `previous`; without it the engine's own
        checkpoint, whole) through reload_weights, which redoes the backend's processing of each."""
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        except ImportError as exc:
            raise RuntimeError(f"applying step {step} failed ({error}) and this vLLM lacks "
                               f"vllm.model_executor.model_loader.reload.finalize_layerwise_reload (or "
                               f"vllm.config.set_current_vllm_config), which the rollback needs: the engine "
                               f"may hold a mix of two steps; restart it") from exc
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = self.vllm_config  # type: ignore[attr-defined]
        try:
            with set_current_vllm_config(config), _quiet_partial_reload():
                finalize_layerwise_reload(model, config.model_config)
                if previous is None:
                    self.reload_weights(is_checkpoint_format=True)  # type: ignore[attr-defined]
                else:
                    self.reload_weights(weights_iterator=_read(previous, names),  # type: ignore[attr-defined]
                                        is_checkpoint_format=True)
        except Exception as exc:
            raise RuntimeError(f"applying step {step} failed ({error}) and so did the rollback to the step the "
                               f"engine served ({type(exc).__name__}: {exc}): its weights are unknown") from exc


@contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """A partial reload makes vLLM warn of every layer it leaves as is ("Failed to load weights",
    "Following weights were not loaded"): expected here, so those two loggers keep errors only."""
    quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _read(files: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `names` from the checkpoint directory `files`, in that order (vLLM processes a
    layer once all its tensors arrived: the caller groups them by layer)."""
    from safetensors import safe_open

    where = {n: shard for shard, ns in _shard_files(files).items() for n in ns}
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"{files}: lacks tensor(s) {missing[:5]}")
    with ExitStack() as stack:
        opened = {shard: stack.enter_context(safe_open(str(files / shard), framework="pt"))
                  for shard in sorted({where[n] for n in names})}
        for n in names:
            yield n, opened[where[n]].get_tensor(n)


def _headers(files: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of a safetensors checkpoint directory, from the file headers (no tensor read)."""
    from safetensors import safe_open

    out = {}
    for shard, names in _shard_files(files).items():
        with safe_open(str(files / shard), framework="pt") as f:
            for n in names:
                s = f.get_slice(n)
                out[n] = (s.get_dtype(), list(s.get_shape()))
    return out


def _check_fits(step: int, files: Path, load: list[str], previous: Path | None, model_path: str) -> None:
    """Refuse a step whose tensors differ in name, dtype or shape from the step the engine serves (the
    version directory `previous`: it must hold every one of them, the rollback reads them there), or,
    for a first update, from the engine's own checkpoint where that is a local directory."""
    if previous is None and not (Path(model_path).is_dir() and _shard_files(Path(model_path))):
        return  # an engine started from a hub id: vLLM's own loader checks what it loads
    ref = _headers(previous if previous is not None else Path(model_path))
    new = _headers(files)
    problems = []
    if previous is not None:
        missing = [n for n in load if n not in ref]
        if missing:
            problems.append(f"the step the engine serves ({previous}) lacks {missing[:5]}")
    problems += [f"{n}: {new[n][0]} {new[n][1]}, the engine's step has {ref[n][0]} {ref[n][1]}"
                 for n in load if n in ref and ref[n] != new[n]]
    if problems:
        raise ValueError(f"{files}: step {step} does not fit the model the engine serves: {'; '.join(problems[:5])}")


def _check_labelled(step: int, files: Path, staged: dict[str, torch.Tensor]) -> None:
    """Refuse tensors that are not the step they would be served as: `files` must be a watcher's full version
    of `step` (its relay-state.json says so; a journal version's safetensors are its base, an older step), and
    every tensor read must match that state's record digests. The engine's weight version then names what it
    computes with, whatever a directory happens to hold."""
    from relay import dest
    from relay.manifest import mismatches

    try:
        state = dest.read_state(files)
    except (dest.BadVersion, OSError) as exc:
        raise ValueError(f"{files}: not a watcher's version of step {step} ({exc}); refused") from None
    if state.persist != "full" or state.step != step or state.partial:
        raise ValueError(f"{files}: its state file says step {state.step}, persist {state.persist}"
                         f"{', partial' if state.partial else ''}: not a complete checkpoint of step {step}; refused")
    bad = mismatches(staged, {n: state.tensors[n] for n in staged if n in state.tensors}, strong=False)
    if bad:
        raise ValueError(f"{files}: tensor(s) {bad[:5]} do not match the record of step {step}; refused")


CHECKPOINT_VERSION = "default"  # vLLM's weight version of an engine as started from its checkpoint


def _agreed(step: int, got: list[Any]) -> dict:
    """The one outcome of a commit every worker reports: with tensor parallelism each worker applies (or rolls
    back) its own shard, and workers that disagree leave the engine on a mix of two steps. RuntimeError (the
    engine's weights unknown) when a worker's answer is missing, malformed, or differs from the others'."""
    if not got or not all(isinstance(r, dict) for r in got):
        raise RuntimeError(f"the workers answered {got!r} to the commit of step {step}, not one result each")
    outcomes = {(bool(r.get("error")), r.get("rolled_back_to")) for r in got}
    if len(outcomes) != 1:
        raise RuntimeError(f"the workers disagree on step {step}: " + "; ".join(
            f"worker {i}: {r.get('error') or 'applied'}" for i, r in enumerate(got)) + ": the engine holds a mix")
    errors = [r["error"] for r in got if r.get("error")]
    apply_s = [r["apply_s"] for r in got if isinstance(r.get("apply_s"), (int, float))]
    out = dict(got[0])
    if errors:
        out["error"] = errors[0] if len(set(errors)) == 1 else "; ".join(sorted(set(errors)))
    if apply_s:
        out["apply_s"] = max(apply_s)
    return out


class _Driver:
    """The engine-side protocol of relay.engines.Engine over vLLM's collective_rpc; subclasses say how
    to reach the engine (in-process LLM, HTTP).

    The driver knows which step the engine serves only while the engine carries that step as its
    weight version: state() finds an engine that restarted (or was relabelled) and forgets its step,
    and so does a commit whose outcome is unknown (a transport error, a failed rollback); the next
    update is then whole (a watcher re-pushes its held step)."""

    kind = "vllm"

    def __init__(self) -> None:
        self.step: int | None = None  # the step the engine serves (set by a commit)
        self.files: Path | None = None  # that step's version directory: what a failed commit rolls back to
        self.staged: int | None = None
        self._staged_files: Path | None = None
        self._staged_partial = False  # the staged update moves only the tensors changed since self.step
        self.status = "starting"
        self.last_pause_s: float | None = None
        self.last_apply_s: float | None = None
        self.last_stage: dict | None = None
        self.last_error: str | None = None
        self._lock = threading.Lock()  # a commit and state()'s check of the weight version never interleave
        self._must_resume = False  # a resume failed: the engine stays paused until one succeeds

    # -- what a subclass provides ----------------------------------------------------------------
    def _rpc(self, method: str, *args: str) -> list[Any]:
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _set_version(self, version: str) -> None:
        raise NotImplementedError

    def _reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def weight_version(self) -> str | None:
        raise NotImplementedError

    def _version_if_free(self) -> tuple[str | None, bool]:
        """(the engine's weight version, True), or (None, False) when asking now would have to wait for
        another thread's call: what state() reports from. A transport that takes concurrent calls asks."""
        return self.weight_version(), True

    def _busy_status(self) -> tuple[str, str | None]:
        """state()'s status while another thread's call is in flight, and what to report as its error."""
        return "updating", None

    # -- relay.engines.Engine --------------------------------------------------------------------
    def stage(self, update: Update) -> None:
        whole = self.step is None or update.changed is None  # the engine's step unknown: everything moves
        previous = None if whole else (update.previous or self.files)
        spec = json.dumps({"step": update.step, "files": str(update.files),
                           "changed": None if whole or update.changed is None else sorted(update.changed),
                           "previous": None if previous is None else str(previous)})
        try:
            if self._must_resume:  # a resume that failed at the last commit: the engine must serve again first
                self._resume()
                self._must_resume = False
            got = self._rpc(RPC_STAGE, spec)
        except Exception as exc:  # any failure of the call: a refused stage
            self.staged, self.last_error = None, f"stage of step {update.step}: {exc}"
            raise EngineError(f"vLLM engine refused to stage step {update.step} ({exc}); it serves step "
                              f"{self.step}") from exc
        self.staged, self._staged_files, self.last_stage = update.step, update.files, (got[0] if got else None)
        self._staged_partial = not whole

    def commit(self, step: int) -> float:
        if self.staged != step:
            raise EngineError(f"vLLM engine: step {step} is not staged (staged: {self.staged})")
        files, self.staged = self._staged_files, None
        with self._lock:
            t0 = time.perf_counter()
            self._must_resume = True  # from here until a resume succeeds, the engine may be paused
            try:
                self._pause()
            except Exception as exc:  # nothing applied; a pause that timed out may still take effect: resume
                self._resume_after(exc)
                self.last_error = f"pause for step {step}: {exc}"
                raise EngineError(f"vLLM engine did not pause for step {step} ({exc}); it serves step "
                                  f"{self.step}") from exc
            if self._staged_partial:
                self._check_still_serving(step)
            try:
                try:
                    result = _agreed(step, self._rpc(RPC_COMMIT, json.dumps({"step": step})))
                    if not result.get("error") or result.get("rolled_back_to") == "checkpoint":
                        self._reset_prefix_cache()  # cached KV of the old weights must not serve the new ones
                        self._set_version(CHECKPOINT_VERSION if result.get("error") else str(step))
                finally:
                    self._resume()
                    self._must_resume = False
            except Exception as exc:  # applied or not, labelled or not: unknown
                self._forget("unknown", f"commit of step {step}: {exc}")
                raise EngineError(f"vLLM engine: committing step {step} failed ({exc}); its weights are unknown "
                                  f"and the next update reloads them whole") from exc
            self.last_pause_s = time.perf_counter() - t0
        self.last_apply_s = result.get("apply_s")
        if result.get("error"):
            if result.get("rolled_back_to") == "checkpoint":
                self._forget("failed", f"commit of step {step}: {result['error']}")
                raise EngineError(f"vLLM engine did not take step {step} ({result['error']}); it rolled back to "
                                  f"its own checkpoint (weight version {CHECKPOINT_VERSION!r})")
            self.last_error = f"commit of step {step}: {result['error']}"
            raise EngineError(f"vLLM engine did not take step {step} ({result['error']}); it rolled back and "
                              f"serves step {self.step}")
        self.step, self.files, self.status, self.last_error = step, files, "serving", None
        return self.last_pause_s

    def _check_still_serving(self, step: int) -> None:
        """(Paused, under the lock) before a partial update: the engine must still carry the step it was staged
        against. One that restarted meanwhile (unnoticed: a probe that failed reads as "unreachable" and keeps
        the step) serves its checkpoint, and the changed tensors alone would leave it a mix of both."""
        try:
            version = self.weight_version()
        except Exception as exc:  # noqa: BLE001 - unknown counts as not serving it
            version = f"unknown ({exc})"
        if version == str(self.step):
            return
        try:
            self._rpc(RPC_ABORT)
        except Exception as exc:  # noqa: BLE001 - nothing staged is committed either way
            log.warning("vLLM engine: dropping the staged step failed: %s", exc)
        self._resume_after(RuntimeError("a refused partial update"))
        self._forget("lost", f"the engine carries weight version {version!r}, not step {self.step} (restarted, or "
                             f"relabelled): step {step}'s changed tensors alone would leave it a mix")
        raise EngineError(f"vLLM engine no longer serves step {self.step} (weight version {version!r}); step "
                          f"{step} is not applied, the next update reloads it whole")

    def abort(self) -> None:
        if self.staged is not None:
            self.staged = None
            try:
                self._rpc(RPC_ABORT)
            except Exception as exc:  # noqa: BLE001 - nothing staged can be committed anyway
                log.warning("vLLM engine: dropping the staged step failed: %s", exc)

    def state(self) -> dict[str, Any]:
        note = None
        try:
            if self._lock.acquire(blocking=False):
                try:
                    version, asked = self._version_if_free()
                    if asked and self.step is not None and version != str(self.step):
                        self._forget("lost", f"the engine carries weight version {version!r}, not step {self.step} "
                                             f"(restarted, or relabelled): its next update is whole")
                    status = "paused" if self._must_resume else self.status
                finally:
                    self._lock.release()
            else:  # a commit is under way (another thread): report, check the version next time
                (version, asked), status = self._version_if_free(), "updating"
            if not asked:
                status, note = self._busy_status()
                if self.step is not None:
                    version = str(self.step)  # not asked (a call in flight): the version it was last known to carry
        except Exception as exc:  # noqa: BLE001 - the ledger shows an unreachable engine, it does not fail
            version, status, self.last_error = None, "unreachable", str(exc)
        return {"kind": self.kind, "step": self.step, "weight_version": version, "status": status,
                "last_pause_s": self.last_pause_s, "last_apply_s": self.last_apply_s,
                "last_stage": self.last_stage, "last_error": note or self.last_error}

    def _forget(self, status: str, error: str) -> None:
        """The engine's weights are no longer known to be a step's: the next update is whole."""
        self.step, self.files, self.status, self.last_error = None, None, status, error
        log.warning("vLLM engine: %s", error)

    def _resume_after(self, exc: BaseException) -> None:
        try:
            self._resume()
            self._must_resume = False
        except Exception as again:  # noqa: BLE001 - the caller raises `exc`; the next stage resumes first
            log.warning("vLLM engine: resuming after %s failed too: %s", exc, again)


class VLLMEngine(_Driver):
    """An in-process `vllm.LLM` built with worker_extension_cls="relay.engines.vllm.WorkerExtension".

    LLM is synchronous: sync the watcher from the thread that calls llm.generate (between batches);
    a commit then pauses nothing in flight and its pause is the apply.

    The LLM's engine client is not thread-safe: with the engine core in a process of its own (vLLM's
    default) every call is a multipart ZMQ send on one socket, and two threads sending at once
    interleave their frames; the core's input thread dies on the garbled message and every later
    call waits forever. A watcher calls from two threads (its sync, and the fleet heartbeat's
    state()), so every call here holds one lock, and state() never waits for it: while a stage or
    commit is in flight it reports the version last known, with status "updating", or "stuck" once
    that call has run for `stuck_after` seconds (vLLM's client has no timeout to give up with: a dead
    engine core holds the call forever, and the fleet ledger then says so)."""

    def __init__(self, llm: Any, *, stuck_after: float = 900.0) -> None:
        super().__init__()
        if stuck_after <= 0:
            raise ValueError(f"stuck_after must be positive, got {stuck_after}")
        self.llm = llm
        self.stuck_after = stuck_after
        self._calls = threading.Lock()  # one call into the LLM at a time (see the class docstring)
        self._in_flight: tuple[str, float] | None = None  # the call holding _calls, and since when

    @contextmanager
    def _call(self, what: str) -> Iterator[None]:
        with self._calls:
            self._in_flight = (what, time.monotonic())
            try:
                yield
            finally:
                self._in_flight = None

    def _busy_status(self) -> tuple[str, str | None]:
        flight = self._in_flight
        if flight is None or time.monotonic() - flight[1] < self.stuck_after:
            return "updating", None
        return "stuck", (f"{flight[0]} has run for {time.monotonic() - flight[1]:.0f} s without an answer (the "
                         f"engine core may be dead: restart the engine)")

    def _rpc(self, method: str, *args: str) -> list[Any]:
        with self._call(method):
            return self.llm.collective_rpc(method, args=args)

    def _pause(self) -> None:
        pass  # nothing is generating while this thread commits (see the class docstring)

    def _resume(self) -> None:
        pass

    def _set_version(self, version: str) -> None:
        with self._call("set_weight_version"):
            self.llm.llm_engine.set_weight_version(version)

    def _reset_prefix_cache(self) -> None:
        with self._call("reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def weight_version(self) -> str | None:
        with self._call("get_weight_version"):
            return self.llm.llm_engine.get_weight_version()

    def _version_if_free(self) -> tuple[str | None, bool]:
        if not self._calls.acquire(blocking=False):
            return None, False
        try:
            return self.llm.llm_engine.get_weight_version(), True
        finally:
            self._calls.release()


class VLLMServer(_Driver):
    """`vllm serve` (started with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls
    relay.engines.vllm.WorkerExtension) driven over HTTP: stage, /pause, commit, /reset_prefix_cache,
    /update_weight_version, /resume. pause_mode is vLLM's: "abort" in-flight requests (default),
    "wait" for them, or "keep" them frozen until resume. `token`: the server's --api-key, if any."""

    kind = "vllm-http"

    def __init__(self, url: str, *, pause_mode: str = "abort", timeout: float = 600.0,
                 control_timeout: float = 30.0, token: str | None = None) -> None:
        super().__init__()
        if pause_mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_mode must be abort, wait or keep, got {pause_mode!r}")
        if timeout <= 0 or control_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got timeout={timeout}, control_timeout={control_timeout}")
        self.url, self.pause_mode, self.token = url.rstrip("/"), pause_mode, token
        # stage/commit (reading, applying) and the pause (mode "wait" drains in-flight requests) may take long;
        # the version, cache and resume calls answer at once: a hung server holds a watcher or a ledger
        # report at most control_timeout there
        self.timeout, self.control_timeout = timeout, control_timeout

    def _call(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
              timeout: float | None = None) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.control_timeout if timeout is None else timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            hint = " (is the server started with VLLM_SERVER_DEV_MODE=1?)" if exc.code == 404 else ""
            raise EngineError(f"{method} {url}: HTTP {exc.code} {detail}{hint}") from None
        except OSError as exc:  # refused, reset, timed out
            raise EngineError(f"{method} {url}: {exc} (is `vllm serve` up there?)") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise EngineError(f"{method} {url}: not a JSON answer: {raw[:200]!r}") from None

    def _rpc(self, method: str, *args: str) -> list[Any]:
        got = self._call("POST", "/collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout},
                         timeout=self.timeout)
        return (got or {}).get("results") or []

    def _pause(self) -> None:
        self._call("POST", "/pause", query={"mode": self.pause_mode}, timeout=self.timeout)

    def _resume(self) -> None:
        self._call("POST", "/resume")

    def _set_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": version})

    def _reset_prefix_cache(self) -> None:
        got = self._call("POST", "/reset_prefix_cache", query={"reset_running_requests": "true"})
        if not (got or {}).get("success", False):
            raise EngineError(f"{self.url}: the prefix cache could not be reset ({got})")

    def weight_version(self) -> str | None:
        return (self._call("GET", "/weight_info") or {}).get("weight_version")
