"""Errors the codec raises. Every refusal names the tensor (when there is one) and the reason."""

from __future__ import annotations


class DeltaError(ValueError):
    """A payload that cannot be trusted: corrupt, truncated, forged, or made for another base.

    Raised before any output is produced or any tensor is left modified.
    """

    def __init__(self, reason: str, *, tensor: str | None = None) -> None:
        self.reason = reason
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: {reason}" if tensor is not None else reason)


class CheckpointMismatchError(ValueError):
    """Base and target cannot be diffed: different tensor names, shapes or dtypes.

    Callers that hit this publish a full snapshot instead of a delta.
    """
