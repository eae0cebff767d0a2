"""vLLM adapter: each verified step goes into a live vLLM engine without a restart.

Two halves. WorkerExtension runs inside vLLM's workers (pass
`worker_extension_cls="relay.engines.vllm.WorkerExtension"` to `LLM(...)` or
`--worker-extension-cls` to `vllm serve`); it stages a step's changed tensors from the watcher's
DEST version directory and applies them with vLLM's own reload path (reload_weights, which
re-runs the post-load processing the CPU and GPU backends apply, layer by layer), restoring the
layers it touched if the apply fails. A driver calls it through collective_rpc: VLLMEngine for
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
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
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
    reload_weights and vllm_config are its."""

    _deltarelay_staged: tuple[int, list[tuple[str, torch.Tensor]], list[str]] | None = None

    def deltarelay_stage(self, spec: str) -> dict:
        """Read the tensors of the step in spec's "files" that its "changed" names touch (whole layers;
        all tensors when "changed" is null or the model's layers cannot be told apart) into memory,
        while the engine keeps serving. spec: {"step": int, "files": dir, "changed": [names] | null}."""
        from safetensors import safe_open

        req = json.loads(spec)
        step, files, changed = int(req["step"]), Path(req["files"]), req.get("changed")
        self._deltarelay_staged = None
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        shards = _shard_files(files)
        names = [n for ns in shards.values() for n in ns]
        if not names:
            raise ValueError(f"{files}: no safetensors tensors to load for step {step}")
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        layers = {layer_of(n, packed) for n in names}
        modules = dict(model.named_modules())
        if changed is None or layers - set(modules):
            load = sorted(names)  # the first update, or names that are not module paths here: everything
        else:
            unknown = sorted(set(changed) - set(names))
            if unknown:
                raise ValueError(f"{files}: step {step} lacks changed tensor(s) {unknown[:5]}")
            load = widen_to_layers(changed, names, packed)
        where = {n: shard for shard, ns in shards.items() for n in ns}
        wanted = set(load)
        staged: dict[str, torch.Tensor] = {}
        for shard in sorted({where[n] for n in load}):
            with safe_open(str(files / shard), framework="pt") as f:
                for n in f.keys():
                    if n in wanted:
                        staged[n] = f.get_tensor(n)  # a copy in memory: the file may go with the next step
        touched = sorted({layer_of(n, packed) for n in load} & set(modules))
        self._deltarelay_staged = (step, [(n, staged[n]) for n in load], touched)
        return {"step": step, "tensors": len(load), "bytes": sum(t.nbytes for t in staged.values()),
                "layers": len(touched), "of_tensors": len(names)}

    def deltarelay_abort(self) -> None:
        """Drop a staged step."""
        self._deltarelay_staged = None

    def deltarelay_commit(self, spec: str) -> dict:
        """Apply the staged step (spec: {"step": int}) with vLLM's reload path; if that fails, every
        layer is put back as it was (the touched ones from copies taken first) and the error raised."""
        step = int(json.loads(spec)["step"])
        staged, self._deltarelay_staged = self._deltarelay_staged, None
        if staged is None or staged[0] != step:
            raise ValueError(f"step {step} was not staged (staged: {None if staged is None else staged[0]})")
        _, weights, touched = staged
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        modules = dict(model.named_modules())
        backup = {layer: {k: v.detach().clone() for k, v in _own_tensors(modules[layer])} for layer in touched}
        t0 = time.perf_counter()
        # a partial reload makes vLLM warn of every layer it leaves as is ("Failed to load weights",
        # "Following weights were not loaded"): expected here, so those two loggers keep errors only
        quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except BaseException:
            _restore(model, backup)
            raise
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        return {"step": step, "tensors": len(weights), "layers": len(touched), "apply_s": time.perf_counter() - t0}


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _restore(model: torch.nn.Module, backup: dict[str, dict[str, torch.Tensor]]) -> None:
    """After a failed reload_weights: give every layer its kernel tensors back (vLLM's layerwise reload
    moved them aside and may have left layers on the meta device), unwrap the loaders it wrapped, then
    copy the touched layers' values back from `backup`."""
    from vllm.model_executor.model_loader.reload import layerwise

    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None:
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(module, info)
        for t in layerwise.get_layer_tensors(module).values():
            if hasattr(t, "weight_loader"):
                t.weight_loader = layerwise._get_original_loader(t)
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    modules = dict(model.named_modules())
    with torch.no_grad():
        for layer, tensors in backup.items():
            live = dict(_own_tensors(modules[layer]))
            for k, v in tensors.items():
                live[k].copy_(v)


class _Driver:
    """The engine-side protocol of relay.engines.Engine over vLLM's collective_rpc; subclasses say how
    to reach the engine (in-process LLM, HTTP)."""

    kind = "vllm"

    def __init__(self) -> None:
        self.step: int | None = None  # the step the engine serves (set by a commit)
        self.staged: int | None = None
        self.status = "starting"
        self.last_pause_s: float | None = None
        self.last_apply_s: float | None = None
        self.last_stage: dict | None = None
        self.last_error: str | None = None

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

    # -- relay.engines.Engine --------------------------------------------------------------------
    def stage(self, update: Update) -> None:
        spec = json.dumps({"step": update.step, "files": str(update.files),
                           "changed": None if update.changed is None else sorted(update.changed)})
        try:
            got = self._rpc(RPC_STAGE, spec)
        except Exception as exc:  # any failure of the call: a refused stage
            self.staged, self.last_error = None, f"stage of step {update.step}: {exc}"
            raise EngineError(f"vLLM engine refused to stage step {update.step} ({exc}); it serves step "
                              f"{self.step}") from exc
        self.staged, self.last_stage = update.step, (got[0] if got else None)

    def commit(self, step: int) -> float:
        if self.staged != step:
            raise EngineError(f"vLLM engine: step {step} is not staged (staged: {self.staged})")
        self.staged = None
        t0 = time.perf_counter()
        try:
            self._pause()
            try:
                got = self._rpc(RPC_COMMIT, json.dumps({"step": step}))
                self._reset_prefix_cache()  # cached KV of the old weights must not serve the new step
                self._set_version(str(step))
            finally:
                self._resume()
        except Exception as exc:  # the worker restored its layers
            self.status, self.last_error = "failed", f"commit of step {step}: {exc}"
            raise EngineError(f"vLLM engine did not take step {step} ({exc}); it serves step {self.step}") from exc
        self.last_pause_s = time.perf_counter() - t0
        self.last_apply_s = got[0].get("apply_s") if got and isinstance(got[0], dict) else None
        self.step, self.status, self.last_error = step, "serving", None
        return self.last_pause_s

    def abort(self) -> None:
        if self.staged is not None:
            self.staged = None
            try:
                self._rpc(RPC_ABORT)
            except Exception as exc:  # noqa: BLE001 - nothing staged can be committed anyway
                log.warning("vLLM engine: dropping the staged step failed: %s", exc)

    def state(self) -> dict[str, Any]:
        try:
            version = self.weight_version()
        except Exception as exc:  # noqa: BLE001 - the ledger shows an unreachable engine, it does not fail
            version, self.status = None, "unreachable"
            self.last_error = str(exc)
        return {"kind": self.kind, "step": self.step, "weight_version": version, "status": self.status,
                "last_pause_s": self.last_pause_s, "last_apply_s": self.last_apply_s,
                "last_stage": self.last_stage, "last_error": self.last_error}


class VLLMEngine(_Driver):
    """An in-process `vllm.LLM` built with worker_extension_cls="relay.engines.vllm.WorkerExtension".

    LLM is synchronous: sync the watcher from the thread that calls llm.generate (between batches);
    a commit then pauses nothing in flight and its pause is the apply."""

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm

    def _rpc(self, method: str, *args: str) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def _pause(self) -> None:
        pass  # nothing is generating while this thread commits (see the class docstring)

    def _resume(self) -> None:
        pass

    def _set_version(self, version: str) -> None:
        self.llm.llm_engine.set_weight_version(version)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def weight_version(self) -> str | None:
        return self.llm.llm_engine.get_weight_version()


class VLLMServer(_Driver):
    """`vllm serve` (started with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls
    relay.engines.vllm.WorkerExtension) driven over HTTP: stage, /pause, commit, /reset_prefix_cache,
    /update_weight_version, /resume. pause_mode is vLLM's: "abort" in-flight requests (default),
    "wait" for them, or "keep" them frozen until resume. `token`: the server's --api-key, if any."""

    kind = "vllm-http"

    def __init__(self, url: str, *, pause_mode: str = "abort", timeout: float = 600.0,
                 token: str | None = None) -> None:
        super().__init__()
        if pause_mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_mode must be abort, wait or keep, got {pause_mode!r}")
        self.url, self.pause_mode, self.timeout, self.token = url.rstrip("/"), pause_mode, timeout, token

    def _call(self, method: str, path: str, body: dict | None = None, query: dict | None = None) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            raise EngineError(f"{method} {url}: HTTP {exc.code} {detail}") from None
        except OSError as exc:  # refused, reset, timed out
            raise EngineError(f"{method} {url}: {exc}") from None
        return json.loads(raw) if raw.strip() else None

    def _rpc(self, method: str, *args: str) -> list[Any]:
        got = self._call("POST", "/collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout})
        return (got or {}).get("results") or []

    def _pause(self) -> None:
        self._call("POST", "/pause", query={"mode": self.pause_mode})

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
