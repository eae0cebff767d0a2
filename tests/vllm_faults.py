"""A worker extension for tests/test_engine_vllm.py that breaks an apply midway, on request.

vLLM imports it in its workers (worker_extension_cls="vllm_faults.FaultyExtension", with tests/ on
the path): everything is relay.engines.vllm.WorkerExtension's, except that after
`deltarelay_test_fail_after(n)` the next apply's weights stream raises after n tensors, as a disk
or network fault would while vLLM is reloading layer after layer, and `deltarelay_test_digest()`
hashes the weights the engine computes with (what a fresh engine on the same checkpoint must hold
bit for bit; tests/vllm_reference.py records it for every step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from relay.engines.vllm import WorkerExtension


class FaultyExtension(WorkerExtension):
    _fail_after: int | None = None

    def deltarelay_test_fail_after(self, n: str) -> None:
        """Arm the fault: the next apply (only) raises after int(n) tensors reached vLLM."""
        self._fail_after = int(n)

    def _deltarelay_weights(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        n, self._fail_after = self._fail_after, None
        for i, item in enumerate(weights):
            if n is not None and i == n:
                raise OSError(f"injected fault: the weights stream broke after {n} of {len(weights)} tensors")
            yield item

    def deltarelay_test_digest(self) -> str:
        """SHA-256 over the weights the engine computes with, by name: its state_dict after vLLM's post-load
        processing, and, for each linear layer whose weights vLLM's CPU backend moved out of the module into a
        packed GEMM operand (the parameter left empty), that layer applied to the identity matrix, which gives
        back the weight (transposed, plus the bias) exactly: products by one, sums of zeros."""
        h = hashlib.sha256()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        for name, t in sorted(model.state_dict().items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for name, module in sorted(model.named_modules()):
            gemm = getattr(module, "cpu_linear", None)
            if gemm is None:
                continue
            k = getattr(module, "input_size_per_partition", None) or module.embedding_dim
            with torch.no_grad():
                probe = gemm(torch.eye(k, dtype=module.weight.dtype), module.weight, getattr(module, "bias", None))
            h.update(f"{name}@eye:{probe.dtype}:{tuple(probe.shape)}:".encode())
            h.update(probe.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
