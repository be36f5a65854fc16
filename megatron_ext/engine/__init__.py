"""The checkpoint engine: tensors in, durable committed files out. Knows nothing of Megatron.

A save goes one way through these steps, each stage handed the next one and one shared
``SaveContext`` (context.py):

1. ``CheckpointEngine.save`` (engine.py), on the training thread: encode the state's non-tensor
   part, plan the safetensors layout from shapes and dtypes, queue a ``FileJob``. Nothing is copied.
2. ``SnapshotScheduler`` (snapshot.py): copy each file chunk by chunk into host-cache slots and
   hand every filled slot (a ``Chunk``, messages.py) to the writer at once. A save given a
   ``CopyGate`` (copy_gate.py) is copied only once the caller opens it.
   ``CheckpointEngine.wait_snapshot`` returns when the copies are done.
3. ``RankWriter`` (flush.py): checksum and write each chunk to the first level (node-local if
   configured, else shared), fsync, and pass the durable file on.
4. ``LevelStager`` (flush.py), only with a node-local level: copy the file to the shared level.
5. ``Committer`` (commit.py), after ``CheckpointEngine.commit``: rank report and status
   (coordination.py); rank 0 joins the ranks' shares into the manifest, the commit marker, and
   decides; then the commit's callbacks.
6. ``RetentionStage`` (retention.py): delete what the keep policy no longer keeps, only where
   this job holds the directory's lock (ownership.py).

Overload decisions (overload.py) may drop a checkpoint between steps 2 and 5; its ``Discard``
follows its chunks through steps 3 and 4. The read side is ``CommittedCheckpoint`` (committed.py).
"""

from .codec import EncodeError, UnsafeCheckpointError, add_safe_classes, safe_classes
from .commit import list_committed, read_manifest
from .config import ConfigError, EngineConfig, OnFailure, OverloadPolicy
from .copy_gate import CopyGate
from .engine import CheckpointEngine
from .jobs import CheckpointError

__all__ = [
    "CheckpointEngine", "CheckpointError", "ConfigError", "CopyGate", "EncodeError", "EngineConfig", "OnFailure",
    "OverloadPolicy", "UnsafeCheckpointError", "add_safe_classes", "list_committed", "read_manifest", "safe_classes",
]
