"""deltarelay relay: hand each trainer step to rollout hosts through an object store.

    with relay.Publisher("s3://bucket/run") as pub:      # trainer
        pub.publish(model, step)
    relay.Watcher("s3://bucket/run", "/weights").run()   # each rollout host

The store layout and protocol are specified in docs/PROTOCOL.md.
"""

from relay.manifest import Manifest, ManifestError, Record
from relay.ops import gc, rebase, status
from relay.publisher import Publisher, close_publishers, publish
from relay.store import ConflictError, ObjectMissing, open_store
from relay.watcher import Reader, SyncError, SyncTimeout, Watcher

__all__ = ["Publisher", "publish", "close_publishers", "Watcher", "Reader", "ConflictError", "SyncError",
           "SyncTimeout", "ObjectMissing", "ManifestError", "Manifest", "Record", "open_store", "rebase", "gc",
           "status"]
