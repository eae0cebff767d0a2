"""deltarelay codec: lossless, verified deltas between checkpoints of BF16 (and any other) tensors.

    payload = codec.encode(base, target)      # bytes
    target  = codec.decode(base, payload)     # dict[str, torch.Tensor], verified
    codec.apply_(model.state_dict(), payload) # in place, all-or-nothing

The payload format is specified in docs/FORMAT.md.
"""

from ._kernel_cache import keyed_by_sources

with keyed_by_sources():  # every compiled kernel is defined while these imports run
    from .api import apply_, decode, encode
    from .container import CURRENT_VERSION as FORMAT_VERSION
    from .errors import CheckpointMismatchError, DeltaError
    from .inspect import describe

__all__ = ["encode", "decode", "apply_", "describe", "DeltaError", "CheckpointMismatchError", "FORMAT_VERSION"]
