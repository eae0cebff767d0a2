"""deltarelay codec: lossless, verified deltas between checkpoints of BF16 (and any other) tensors.

    payload = codec.encode(base, target)      # bytes
    target  = codec.decode(base, payload)     # dict[str, torch.Tensor], verified
    codec.apply_(model.state_dict(), payload) # in place, all-or-nothing (undo=codec.UndoLog() for chains)
    codec.digests(payload)                    # per tensor: dtype, shape, base and target digests
    codec.warm_up(("apply_",))                # compile the kernels in the background (a fresh host)

    chunks = codec.encode_snapshot(state_dict.items())   # a compressed snapshot object, streamed
    for name, t in codec.decode_snapshot(f): ...          # verified tensors, one at a time

The payload and snapshot object formats are specified in docs/FORMAT.md.

Public API: the names in `__all__`, and three building-block modules whose names without a
leading underscore are public too: `codec.tensors` (the dtype table, zero-copy element views),
`codec.compressors` (the bounded zstd / lz4 / brotli wrappers) and `codec.wire` (bounded LEB128
readers and writers). Everything else (codec.api, codec.container, codec.methods, codec.hashing,
codec.rans, codec.device) is internal and changes without notice. codec.lab (the bench's
baselines and entropy bound) is not runtime: nothing outside it imports it, and it uses only
this public API (tests/test_import_graph.py checks both).
"""

from collections.abc import Mapping as _Mapping

from ._kernel_cache import keyed_by_sources

with keyed_by_sources():  # every compiled kernel is defined while these imports run
    from .api import UndoLog, _check_structure, apply_, decode, encode
    from .container import CURRENT_VERSION as FORMAT_VERSION
    from .container import SUPPORTED_VERSIONS as FORMAT_VERSIONS
    from .errors import CheckpointMismatchError, DeltaError
    from .inspect import TensorDigests, describe, digests
    from .snapshot import (SnapshotEntry, SnapshotError, decode_snapshot, encode_snapshot, read_snapshot_index,
                           write_snapshot)
    from .snapshot import MAGIC as SNAPSHOT_MAGIC
    from .snapshot import VERSION as SNAPSHOT_FORMAT_VERSION
from ._warmup import WarmUp, warm_up


def check_structure(base: _Mapping, target: _Mapping) -> None:
    """Raise CheckpointMismatchError unless `base` and `target` hold the same tensor names, each
    with the same dtype and shape: the first check `encode` makes. For delta formats built on the
    codec's building blocks (codec.lab.baselines) that must refuse what `encode` refuses."""
    _check_structure(base, target)


__all__ = ["encode", "decode", "apply_", "UndoLog", "describe", "digests", "TensorDigests", "check_structure",
           "DeltaError", "CheckpointMismatchError", "FORMAT_VERSION", "FORMAT_VERSIONS", "warm_up", "WarmUp",
           "encode_snapshot", "write_snapshot", "decode_snapshot", "read_snapshot_index", "SnapshotEntry",
           "SnapshotError", "SNAPSHOT_FORMAT_VERSION", "SNAPSHOT_MAGIC"]
