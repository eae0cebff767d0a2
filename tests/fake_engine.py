"""A stand-in engine adapter (the relay.engines.Engine protocol) for tests that need an engine's state in
the watcher's ledger and metrics without a real inference engine (tests/test_engine_vllm.py has that)."""

from __future__ import annotations

from typing import Any


class FakeEngine:
    """Serves whatever step the watcher commits, reporting `pause` seconds per commit."""

    def __init__(self, kind: str = "fake", pause: float | None = None) -> None:
        self.kind = kind
        self.step: int | None = None
        self.pause = pause
        self.staged: int | None = None

    def stage(self, update: Any) -> None:
        self.staged = update.step

    def commit(self, step: int) -> float:
        assert self.staged == step, (self.staged, step)
        self.step, self.staged = step, None
        return self.pause or 0.0

    def abort(self) -> None:
        self.staged = None

    def state(self) -> dict:
        return {"kind": self.kind, "step": self.step,
                "weight_version": None if self.step is None else str(self.step), "status": "serving",
                "last_pause_s": self.pause}
