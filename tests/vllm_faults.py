"""A worker extension for tests/test_engine_vllm.py that breaks an apply midway, on request.

vLLM imports it in its workers (worker_extension_cls="vllm_faults.FaultyExtension", with tests/ on
the path): everything is relay.engines.vllm.WorkerExtension's, except that after
`deltarelay_test_fail_after(n)` the next apply's weights stream raises after n tensors, as a disk
or network fault would while vLLM is reloading layer after layer.
"""

from __future__ import annotations

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
