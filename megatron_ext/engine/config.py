"""Engine configuration.

A superset of DeepSpeed's ``"datastates_ckpt"`` section: DeepSpeed users pass that dict as is,
Megatron users get the same keys from command-line flags. Every problem is reported at start-up,
never in the middle of a run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Any, Mapping

GIB = 1 << 30
MIB = 1 << 20

# Keys that DeepSpeed's own datastates section may carry; accepted and, where they have no
# meaning here, ignored.
_DEEPSPEED_COMPAT_KEYS = {"parser_threads"}

#: What a save does when the host cache is full of checkpoints still flushing (see ``overload_policy``).
OVERLOAD_WAIT = "wait"
OVERLOAD_SUPERSEDE = "supersede"
OVERLOAD_POLICIES = (OVERLOAD_WAIT, OVERLOAD_SUPERSEDE)


class ConfigError(ValueError):
    """A bad engine configuration, reported before any checkpoint is taken."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; see ``docs/ARCHITECTURE.md`` for each knob's effect."""

    #: Size of the one host buffer all snapshots stream through, in GB (GiB), as in DeepSpeed.
    host_cache_size: float = 1.0
    #: Unit of copying and writing, in MiB. Shrunk automatically for tiny caches.
    chunk_size_mb: float = 16.0
    #: Default root directory of checkpoints (the shared level); callers may pass another per save.
    save_dir: str | None = None
    #: Optional node-local directory: ranks flush here first, a background stage copies to the root.
    local_dir: str | None = None
    #: "auto" probes each directory, True requires O_DIRECT, False never uses it (writes). Restore
    #: reads are buffered with kernel read-ahead unless True (``fast_read``).
    o_direct: bool | str = "auto"
    #: Seconds any single wait may take before it fails with an error instead of hanging.
    snapshot_timeout_s: float = 600.0
    persist_timeout_s: float = 1800.0
    #: JSON-lines telemetry file ({rank} is replaced); None: ``<save_dir>/datastates_telemetry/rank-RRRRR.jsonl``.
    telemetry_path: str | None = None
    #: Store non-tensor objects the safe encoder does not know with pickle (loaded only on request).
    pickle_fallback: bool = False
    #: After a failed flush or commit: "stop" (every later engine call raises it) or "continue"
    #: (that checkpoint is abandoned, reported in the log and telemetry; training goes on).
    on_failure: str = "stop"
    #: When a snapshot finds the host cache full because earlier checkpoints are still flushing:
    #: "wait" (backpressure: training waits for the flush) or "supersede" (pending checkpoints that
    #: have not started flushing are dropped for the newer one, and a snapshot still waiting for
    #: cache space when ``wait_snapshot`` is called is abandoned; training never waits for a flush).
    overload_policy: str = "wait"
    #: With "supersede": if the newest checkpoint committed in this run is more than this many
    #: versions older than a new save, that save waits instead (None: no bound).
    max_durable_age: int | None = None
    #: Retention: keep the newest ``keep_last`` committed checkpoints (None keeps all) ...
    keep_last: int | None = None
    #: ... plus those whose version is a multiple of ``keep_every``.
    keep_every: int | None = None
    #: Rank 0 removes uncommitted checkpoint directories a crashed run left, at start-up.
    remove_partial_on_start: bool = True
    #: Module prefixes whose plain objects and named tuples are stored field by field (codec.py).
    object_modules: tuple[str, ...] = ()
    #: Threads reading a checkpoint file in parallel at restore (O_DIRECT per ``o_direct``).
    restore_threads: int = 4
    #: Also send each rank's files to the host memory of a rank on the next node (replica.py), so a
    #: lost node is recovered from its peers' memory instead of the shared file system.
    peer_replica: bool = False
    #: Ranks per node for the peer mapping; None: torchrun's LOCAL_WORLD_SIZE. Smaller values
    #: simulate several nodes on one machine.
    ranks_per_node: int | None = None
    #: Host-memory directory for the replicas this node holds; None: ``/dev/shm/megatron_ext-replicas-<hash of save_dir>``.
    replica_dir: str | None = None
    #: Ignored, accepted for DeepSpeed compatibility.
    parser_threads: int | None = None

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_size * GIB)

    @property
    def chunk_bytes(self) -> int:
        """Chunk size: a multiple of 4 KiB, and at most a quarter of the cache so copy and flush overlap."""
        want = int(self.chunk_size_mb * MIB)
        want = min(want, self.host_cache_bytes // 4)
        return max(4096, want // 4096 * 4096)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, **overrides: Any) -> "EngineConfig":
        """Build from a ``datastates_ckpt``-style dict; unknown keys are an error naming them."""
        data = dict(section or {})
        data.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - _DEEPSPEED_COMPAT_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown datastates_ckpt key(s) {unknown}; known keys: {sorted(known)}"
            )
        if isinstance(data.get("object_modules"), list):
            data["object_modules"] = tuple(data["object_modules"])
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError for sizes that cannot work and directories that cannot be written."""
        _number(self.host_cache_size, "host_cache_size")
        if not (self.host_cache_size > 0):
            raise ConfigError(f"host_cache_size must be > 0 GB, got {self.host_cache_size}")
        if self.host_cache_bytes < 4 * 4096:
            raise ConfigError(f"host_cache_size {self.host_cache_size} GB is below the 16 KiB minimum")
        ram = _physical_memory_bytes()
        if ram and self.host_cache_bytes > ram * 0.9:
            raise ConfigError(
                f"host_cache_size {self.host_cache_size} GB exceeds 90% of this node's "
                f"{ram / GIB:.1f} GB of memory"
            )
        _number(self.chunk_size_mb, "chunk_size_mb")
        if not (0 < self.chunk_size_mb <= 4096):
            raise ConfigError(f"chunk_size_mb must be in (0, 4096], got {self.chunk_size_mb}")
        if isinstance(self.object_modules, str) or not all(isinstance(m, str) and m for m in self.object_modules):
            raise ConfigError(f"object_modules must be a list of module prefixes, got {self.object_modules!r}")
        if self.on_failure not in ("stop", "continue"):
            raise ConfigError(f"on_failure must be \"stop\" or \"continue\", got {self.on_failure!r}")
        if self.overload_policy not in OVERLOAD_POLICIES:
            raise ConfigError(f"overload_policy must be one of {list(OVERLOAD_POLICIES)}, got {self.overload_policy!r}")
        age = self.max_durable_age
        if age is not None and (isinstance(age, bool) or not isinstance(age, int) or age < 0):
            raise ConfigError(f"max_durable_age must be a whole number >= 0 (versions), got {age!r}")
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if isinstance(self.restore_threads, bool) or not isinstance(self.restore_threads, int) \
                or not 1 <= self.restore_threads <= 64:
            raise ConfigError(f"restore_threads must be a whole number in [1, 64], got {self.restore_threads!r}")
        if not isinstance(self.peer_replica, bool):
            raise ConfigError(f"peer_replica must be true or false, got {self.peer_replica!r}")
        if self.peer_replica and self.overload_policy == "supersede":
            # Replication pairs ranks checkpoint by checkpoint in commit order; a checkpoint skipped
            # at different moments on different ranks would break the pairing.
            raise ConfigError("peer_replica cannot be combined with overload_policy \"supersede\"; use \"wait\"")
        value = self.ranks_per_node
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"ranks_per_node must be a whole number >= 1, got {value!r}")
        if self.o_direct not in (True, False, "auto"):
            raise ConfigError(f"o_direct must be true, false or \"auto\", got {self.o_direct!r}")
        for name in ("snapshot_timeout_s", "persist_timeout_s"):
            value = getattr(self, name)
            _number(value, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
        for name in ("save_dir", "local_dir") + (("replica_dir",) if self.peer_replica else ()):
            path = getattr(self, name)
            if path is not None:
                check_writable_dir(path, name)


def _number(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_writable_dir(path: str, what: str = "directory") -> None:
    """Create ``path`` if needed and prove a file can be written there, else ConfigError."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".datastates-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} is not writable: {exc.strerror or exc}") from exc
