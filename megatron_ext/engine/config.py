"""Engine configuration.

A superset of DeepSpeed's ``"datastates_ckpt"`` section: DeepSpeed users pass that dict as is,
Megatron users get the same keys from command-line flags. Every problem is reported at start-up,
never in the middle of a run.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import math
import os
from typing import Any, Mapping

from .errors import CheckpointError, ConfigError
from .files import private_dir, probe_write

GIB = 1 << 30
MIB = 1 << 20

# Keys that DeepSpeed's own datastates section may carry; accepted and, where they have no
# meaning here, ignored.
_DEEPSPEED_COMPAT_KEYS = {"parser_threads"}

class OverloadPolicy(enum.StrEnum):
    """What a save does when the host cache is full of checkpoints still flushing (``overload_policy``)."""

    WAIT = "wait"
    SUPERSEDE = "supersede"


class OnFailure(enum.StrEnum):
    """What a failed flush or commit does to the run (``on_failure``)."""

    STOP = "stop"
    CONTINUE = "continue"



#: Bounds checked before any conversion (a size in bytes, a deadline): beyond them nothing works anyway.
_MAX_CACHE_GB = float(1 << 20)
_MAX_TIMEOUT_S = 1e7  # about 116 days


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
    #: "auto" probes each level's root, True requires O_DIRECT, False never uses it (writes). Restore
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
    on_failure: OnFailure = OnFailure.STOP
    #: When a snapshot finds the host cache full because earlier checkpoints are still flushing:
    #: "wait" (backpressure: training waits for the flush) or "supersede" (pending checkpoints that
    #: have not started flushing are dropped for the newer one, and a snapshot still waiting for
    #: cache space when ``wait_snapshot`` is called is abandoned; training never waits for a flush).
    overload_policy: OverloadPolicy = OverloadPolicy.WAIT
    #: With "supersede": if the newest checkpoint committed in this run is more than this many
    #: versions older than a new save, that save waits instead (None: no bound).
    max_durable_age: int | None = None
    #: Retention: keep the newest ``keep_last`` committed checkpoints (None keeps all) ...
    keep_last: int | None = None
    #: ... plus those whose version is a multiple of ``keep_every``.
    keep_every: int | None = None
    #: Rank 0 removes uncommitted checkpoint directories a crashed run left, at start-up.
    remove_partial_on_start: bool = True
    #: Exact classes ("package.module.ClassName") whose enum members, named tuples and plain objects
    #: the sidecar may hold, beyond ``codec.add_safe_classes``'s (codec.py; adapters add their own).
    safe_classes: tuple[str, ...] = ()
    #: Threads reading a checkpoint file in parallel at restore (O_DIRECT per ``o_direct``).
    restore_threads: int = 4
    #: Checksum and write in the I/O worker process (save/io_worker.py), which takes none of the
    #: training process's GIL; False: on the engine's threads in this process.
    flush_process: bool = True
    #: Also send each rank's files to the host memory of a rank on the next node (replica.py), so a
    #: lost node is recovered from its peers' memory instead of the shared file system.
    peer_replica: bool = False
    #: Ranks per node for the peer mapping; None: torchrun's LOCAL_WORLD_SIZE. Smaller values
    #: simulate several nodes on one machine.
    ranks_per_node: int | None = None
    #: Host-memory directory for the replicas this node holds, created private (0700, checked before
    #: every use); None: ``/dev/shm/megatron_ext-<uid>/replicas-<hash of save_dir>``.
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
    def from_dict(cls, section: Mapping[str, Any] | None, *, probe: bool = True, **overrides: Any) -> "EngineConfig":
        """Build from a ``datastates_ckpt``-style dict; unknown keys are an error naming them.

        ``probe`` also creates the configured directories and proves them writable (``validate``);
        one found full passes, as at the engine's start (it frees crashed saves' files first).
        """
        if section is not None and not isinstance(section, Mapping):
            raise ConfigError(f"the datastates configuration must be an object, got {section!r}")
        data = dict(section or {})
        data.update({k: v for k, v in overrides.items() if v is not None})
        if "object_modules" in data:
            raise ConfigError("object_modules (module prefixes) was replaced by safe_classes: list the exact "
                              "classes, e.g. [\"deepspeed.runtime.fp16.loss_scaler.LossScaler\"]")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known - _DEEPSPEED_COMPAT_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown datastates_ckpt key(s) {unknown}; known keys: {sorted(known)}"
            )
        cfg = cls(**data)
        if probe:
            cfg.validate(full_ok=True)
        return cfg

    def __post_init__(self) -> None:
        """Every construction path (``EngineConfig(...)``, ``from_dict``, ``dataclasses.replace``) is checked."""
        _number(self.host_cache_size, "host_cache_size")
        if not self.host_cache_size > 0:
            raise ConfigError(f"host_cache_size must be > 0 GB, got {self.host_cache_size}")
        if self.host_cache_size > _MAX_CACHE_GB:  # bounded before any conversion to bytes
            raise ConfigError(f"host_cache_size {self.host_cache_size} GB is absurd (the bound is {_MAX_CACHE_GB:g})")
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
        for name in ("save_dir", "local_dir", "replica_dir", "telemetry_path"):
            object.__setattr__(self, name, _path(getattr(self, name), name))
        if self.telemetry_path is not None:
            try:
                self.telemetry_path.format(rank=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigError(f"telemetry_path {self.telemetry_path!r}: only {{rank}} may be substituted ({exc})") from None
        names = self.safe_classes
        if isinstance(names, list):
            names = tuple(names)
        if type(names) is not tuple or not all(type(n) is str and n for n in names):
            raise ConfigError(f"safe_classes must be a list of class names (\"package.module.Class\"), got {self.safe_classes!r}")
        object.__setattr__(self, "safe_classes", names)
        self.allowed_classes()  # each name must be a class defined under exactly that name
        for name in ("pickle_fallback", "remove_partial_on_start", "peer_replica", "flush_process"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, choices in (("on_failure", OnFailure), ("overload_policy", OverloadPolicy)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in set(choices):
                raise ConfigError(f"{name} must be one of {[str(c) for c in choices]}, got {value!r}")
            object.__setattr__(self, name, choices(value))
        age = self.max_durable_age
        if age is not None and (type(age) is not int or age < 0):
            raise ConfigError(f"max_durable_age must be a whole number >= 0 (versions), got {age!r}")
        for name in ("keep_last", "keep_every"):
            check_retention_count(name, getattr(self, name))
        if type(self.restore_threads) is not int or not 1 <= self.restore_threads <= 64:
            raise ConfigError(f"restore_threads must be a whole number in [1, 64], got {self.restore_threads!r}")
        if self.peer_replica and self.overload_policy == "supersede":
            # Replication pairs ranks checkpoint by checkpoint in commit order; a checkpoint skipped
            # at different moments on different ranks would break the pairing.
            raise ConfigError("peer_replica cannot be combined with overload_policy \"supersede\"; use \"wait\"")
        value = self.ranks_per_node
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"ranks_per_node must be a whole number >= 1, got {value!r}")
        if self.parser_threads is not None and type(self.parser_threads) is not int:
            raise ConfigError(f"parser_threads must be a whole number, got {self.parser_threads!r}")
        if not (type(self.o_direct) is bool or self.o_direct == "auto"):
            raise ConfigError(f"o_direct must be true, false or \"auto\", got {self.o_direct!r}")
        for name in ("snapshot_timeout_s", "persist_timeout_s"):
            value = getattr(self, name)
            _number(value, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
            if value > _MAX_TIMEOUT_S:
                raise ConfigError(f"{name} must be at most {_MAX_TIMEOUT_S:g} seconds (every wait is bounded), got {value}")
        self._check_directories_apart()

    def _check_directories_apart(self) -> None:
        """Two levels in one directory would overwrite each other's files: equal or nested is an error."""
        dirs = [(n, getattr(self, n)) for n in ("save_dir", "local_dir") + (("replica_dir",) if self.peer_replica else ())
                if getattr(self, n) is not None]
        for i, (name_a, a) in enumerate(dirs):
            for name_b, b in dirs[i + 1:]:
                real_a, real_b = os.path.realpath(a), os.path.realpath(b)
                if real_a == real_b:
                    raise ConfigError(f"{name_a} and {name_b} are the same directory ({real_a}); they must differ")
                if os.path.commonpath([real_a, real_b]) in (real_a, real_b):
                    inner, outer = (name_a, name_b) if len(real_a) > len(real_b) else (name_b, name_a)
                    raise ConfigError(f"{inner} lies inside {outer} ({a} vs {b}); keep the levels apart")

    def validate(self, rank: int = 0, *, full_ok: bool = False) -> list[tuple[str, str]]:
        """Create the configured directories and prove each writable by a real write (telemetry's
        too: root's ``os.access`` says yes even under ``/proc``), else ConfigError. A configured
        ``replica_dir`` is created private (``files.private_dir``).

        ``full_ok``: a probe that fails only for want of space (ENOSPC, EDQUOT) is returned as
        ``(what, path)`` instead of refused: the engine removes what crashed saves left there
        before it probes again (save/space.py); a crashed save's partial files must not block
        the restart that frees them."""
        full: list[tuple[str, str]] | None = [] if full_ok else None
        for name in ("save_dir", "local_dir"):
            path = getattr(self, name)
            if path is not None:
                check_writable_dir(path, name, full=full)
        if self.peer_replica and self.replica_dir is not None:
            check_writable_dir(self.replica_dir, "replica_dir", private=True, full=full)
        telemetry = self.telemetry_file(rank)
        if telemetry is not None:
            _check_creatable_dir(os.path.dirname(os.path.abspath(telemetry)), "telemetry_path directory", full=full)
            if os.path.lexists(telemetry):
                try:  # opened for appending as the engine will; nothing is written
                    if not os.path.isfile(telemetry):
                        raise IsADirectoryError(0, "not a regular file")
                    os.close(os.open(telemetry, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK))
                except OSError as exc:
                    raise ConfigError(f"telemetry_path {telemetry!r} exists and is not a writable file: "
                                      f"{exc.strerror or exc}") from None
        return full or []

    def telemetry_file(self, rank: int) -> str | None:
        """This rank's telemetry file: ``telemetry_path`` with {rank}, else under ``save_dir``, else none."""
        path = self.telemetry_path
        if path is None and self.save_dir is not None:
            path = os.path.join(self.save_dir, "datastates_telemetry", "rank-{rank:05d}.jsonl")
        return path.format(rank=rank) if path is not None else None

    def allowed_classes(self) -> dict:
        """The ``safe_classes`` as classes (imports their modules: a configuration is trusted input)."""
        from .format.codec import resolve_class_names

        try:
            return resolve_class_names(self.safe_classes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_retention_count(name: str, value: Any) -> None:
    """``keep_last`` / ``keep_every``, wherever accepted: None or a whole number >= 1 (0 would keep
    everything, -1 act as 1, "2" fail later in the background)."""
    if value is not None and (type(value) is not int or value < 1):
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")


def _number(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


def _path(value: Any, name: str) -> str | None:
    """A configured path as a non-empty string (``os.PathLike`` accepted), else ConfigError."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if type(value) is not str or not value or "\0" in value:
        raise ConfigError(f"{name} must be a path (a non-empty string), got {value!r}")
    return value


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _no_room(exc: OSError, what: str, path: str, full: list | None) -> bool:
    """A probe failed for want of space and the caller defers that (``validate(full_ok=True)``)."""
    if full is not None and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full.append((what, path))
        return True
    return False


def _check_creatable_dir(path: str, what: str, full: list | None = None) -> None:
    """``path`` is a directory that takes files, or could be created in one, proven by a real write
    in it or in its nearest existing ancestor (``files.probe_write``); nothing is left behind."""
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(0, f"{existing} is not a directory")
        probe_write(existing)
    except OSError as exc:
        if _no_room(exc, what, existing, full):
            return
        raise ConfigError(f"{what} {path!r} is not a writable directory ({exc.strerror or exc})") from None


def check_writable_dir(path: str, what: str = "directory", private: bool = False, full: list | None = None) -> None:
    """Create ``path`` if needed (``private``: 0700, checked as ``files.private_dir`` does) and
    prove by a real write that a file can be made there, else ConfigError (``full``: see ``validate``)."""
    try:
        if private:
            private_dir(path, what)
        else:
            os.makedirs(path, exist_ok=True)
        probe_write(path)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        if _no_room(exc, what, os.path.abspath(path), full):
            return
        raise ConfigError(f"{what} {path!r} is not writable: {exc.strerror or exc}") from exc
