"""deltarelay relay: hand each trainer step to rollout hosts through an object store.

    with relay.Publisher("s3://bucket/run") as pub:      # trainer
        pub.publish(model, step)
    relay.Watcher("s3://bucket/run", "/weights").run()   # each rollout host
    relay.ShardedPublisher("s3://bucket/run")            # on every rank of a torch.distributed trainer

The store layout and protocol are specified in docs/PROTOCOL.md.

Public API: the names in `__all__`, `relay.checkpoint` (safetensors checkpoints, single file or
Hugging Face shards: load, save, Layout), `relay.traffic` (bytes moved per store, by kind) and
`relay.cli.main`. The rest is internal. relay.lab
(demo, bench, corpus generator) is not runtime: nothing outside it imports it, it uses only this
public API and codec's, and its commands reach `deltarelay` through the `deltarelay.commands`
entry point group (tests/test_import_graph.py, tests/test_cli_commands.py).
"""

from relay.distributed import RowSlice, ShardedPublisher, ShardedPublishError
from relay.fleet import FleetTimeout, wait_for_fleet
from relay.manifest import Manifest, ManifestError, Record
from relay.ops import gc, rebase, status
from relay.publisher import Published, Publisher, close_publishers, publish
from relay.regional import Materialiser
from relay.store import ConflictError, ObjectMissing, open_store
from relay.watcher import Reader, SyncError, SyncTimeout, Watcher

__all__ = ["Publisher", "Published", "publish", "close_publishers", "ShardedPublisher", "ShardedPublishError",
           "RowSlice", "Watcher", "Reader", "ConflictError", "SyncError", "SyncTimeout", "ObjectMissing",
           "ManifestError", "Manifest", "Record", "open_store", "rebase", "gc", "status", "Materialiser",
           "FleetTimeout",
           "wait_for_fleet"]
