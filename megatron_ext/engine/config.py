"""Engine configuration.

A superset of DeepSpeed's ``"datastates_ckpt"`` section: DeepSpeed users pass that dict as is,
Megatron users get the same keys from command-line flags. Each field is the one declaration of its
knob (``_knob``): the flags (``engine_flags``) and docs/ENGINE.md's table (``config_table_markdown``) are
made from it. Every problem is reported at start-up, never in the middle of a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import errno
import math
import os
import re
import types
import typing
from typing import Any, Mapping

from .errors import CheckpointError, ConfigError
from . import object_store
from .files import private_dir, probe_write
from .object_store import is_object_url

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
_MAX_CACHE_GIB = float(1 << 20)
_MAX_TIMEOUT_S = 1e7  # about 116 days


#: Metadata keys of an ``EngineConfig`` field (``_knob``): its one declaration, from which the
#: ``--datastates-*`` flags (``engine_flags``), docs/ENGINE.md's table (``config_table_markdown``) and
#: the DeepSpeed ``"datastates_ckpt"`` keys (the field names, ``from_dict``) are made.
HELP, UNIT, NONE_MEANS, OLD_FLAGS, OFF_FLAGS, FLAG_ELSEWHERE, NO_FLAG, METAVAR = (
    "help", "unit", "none_means", "old_flags", "off_flags", "flag_elsewhere", "no_flag", "metavar")
FLAG_PREFIX = "--datastates-"


def _knob(default: Any, help: str, *, unit: str | None = None, none_means: str | None = None,
          old_flags: tuple[str, ...] = (), off_flags: tuple[str, ...] = (), flag_elsewhere: str | None = None,
          no_flag: str | None = None, metavar: str | None = None) -> Any:
    """One field with its metadata: ``help`` (markdown: the meaning in docs/ENGINE.md's table), ``unit`` (GiB, MiB,
    seconds), ``none_means`` (what a None default stands for), ``old_flags`` (earlier spellings of
    its flag, still accepted), ``off_flags`` (earlier flags that set a boolean to false),
    ``flag_elsewhere`` (the framework's own flag sets it) or ``no_flag`` (why there is none)."""
    return dataclasses.field(default=default, metadata={
        HELP: help, UNIT: unit, NONE_MEANS: none_means, OLD_FLAGS: old_flags, OFF_FLAGS: off_flags,
        FLAG_ELSEWHERE: flag_elsewhere, NO_FLAG: no_flag, METAVAR: metavar})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know, each knob declared once (``_knob``); see ``docs/ARCHITECTURE.md`` for its effect.

    Construction checks the values alone; ``check_node`` adds the checks that read this node (its
    memory, the safe classes' modules), run at start-up by ``from_dict`` and the engine.
    """

    host_cache_size: float = _knob(
        1.0, "host cache: the one buffer all snapshots stream through, allocated once in the background", unit="GiB")
    chunk_size_mb: float = _knob(
        16.0, "unit of copy and write; at most a quarter of the cache (shrunk for tiny caches)", unit="MiB")
    save_dir: str | None = _knob(
        None, "default checkpoint root (the shared level): a directory, or an object store as "
              "s3://bucket/prefix (docs/ARCHITECTURE.md, \"The object-store level\"); callers may pass another per save",
        flag_elsewhere="--save")
    local_dir: str | None = _knob(
        None, "node-local level (e.g. NVMe scratch): ranks flush here first, a background stage copies to "
              "`save_dir`; restarts read it when every rank finds its files", metavar="DIR")
    o_direct: bool | str = _knob(
        "auto", "`true` requires O_DIRECT, `false` never uses it, `\"auto\"` probes each level's root once for "
                "writes (a directory under it that refuses O_DIRECT is probed on its own) and reads buffered with "
                "kernel read-ahead at restore", metavar="true|false|auto")
    snapshot_timeout_s: float = _knob(
        600.0, "longest `wait_snapshot` may block before it raises", unit="seconds")
    persist_timeout_s: float = _knob(
        1800.0, "longest a flush or commit may take before it raises on every rank (a rank that never reports "
                "is named) instead of hanging", unit="seconds", old_flags=("--datastates-timeout",))
    telemetry_path: str | None = _knob(
        None, "JSON lines, one per checkpoint and level (`{rank}` is replaced); its directory is proven at "
              "start-up by writing a file there (so `/proc`, which root's `os.access` calls writable, is refused "
              "then)", none_means="`<save_dir>/datastates_telemetry/rank-{rank:05d}.jsonl`; none with an object-store `save_dir`",
        metavar="PATH")
    pickle_fallback: bool = _knob(
        False, "store non-tensor objects the safe encoder does not know with pickle (loaded only with "
               "`allow_pickle=True`; DeepSpeed: `\"allow_pickle\": true` in `datastates_ckpt`)")
    on_failure: OnFailure = _knob(
        OnFailure.STOP, "after a failed flush or commit (disk full, I/O error, a rank that never reports): "
                        "`\"stop\"` (every later engine call raises it) or `\"continue\"` (that checkpoint is "
                        "abandoned, logged and in telemetry; training goes on)")
    overload_policy: OverloadPolicy = _knob(
        OverloadPolicy.WAIT, "host cache full of checkpoints still flushing: `\"wait\"` (backpressure: training "
                             "waits for the flush) or `\"supersede\"` (pending checkpoints that have not started "
                             "flushing are dropped for the newer one, and a snapshot still waiting for cache space "
                             "at `wait_snapshot` is abandoned; training never waits for storage; docs/ARCHITECTURE.md)")
    max_durable_age: int | None = _knob(
        None, "with `\"supersede\"`: a save waits when the newest checkpoint committed in this run is more than "
              "this many versions (Megatron-LM: iterations) older", none_means="no bound", metavar="VERSIONS")
    keep_last: int | None = _knob(
        None, "retention: keep the newest K committed checkpoints (in `latest()`'s order), plus those `keep_every` "
              "keeps; the rest is deleted in the background. Where versioned checkpoints exist, unversioned ones "
              "beside them (named exports) are never deleted. A whole number >= 1, here and in "
              "`commit(keep_last=)` (anything else is a `ConfigError` at the call)", none_means="keep all",
        metavar="K")
    keep_every: int | None = _knob(
        None, "retention, with `keep_last`: also keep every checkpoint whose version is a multiple of M",
        metavar="M")
    remove_partial_on_start: bool = _knob(
        True, "rank 0, holding the directory's lock, removes uncommitted checkpoint directories left by a crash "
              "(and data files a committed checkpoint's manifest does not name) when the engine starts; a "
              "`save_dir` such a crash filled is probed for space only after that")
    safe_classes: tuple[str, ...] = _knob(
        (), "exact classes (`\"package.module.ClassName\"`) whose enum members, named tuples and plain objects "
            "the sidecar may hold, beyond `add_safe_classes(...)`; the adapters ship their own lists "
            "(docs/FORMAT.md). Their modules are imported at start-up (a configuration is trusted input). "
            "Replaces `object_modules` (module prefixes), which is now an error", metavar="CLASS")
    restore_threads: int = _knob(
        4, "threads per rank reading a checkpoint file in parallel at restore, each one contiguous region "
           "(O_DIRECT per `o_direct`)", metavar="N")
    flush_process: bool = _knob(
        True, "the flush's checksums and writes run in an I/O worker process over the host cache's shared "
              "memory, so none of them takes the training process's GIL (docs/ARCHITECTURE.md, \"The GIL\"); "
              "`false`: on the engine's threads in the training process, for systems that forbid starting a "
              "process", off_flags=("--datastates-flush-in-process",))
    peer_replica: bool = _knob(
        False, "also keep each rank's files in the host memory of the rank with the same local index on the next "
               "node; `open_checkpoint`/`load` become collectives that recover a lost node from there "
               "(docs/ARCHITECTURE.md, docs/RELIABILITY.md). Cannot be combined with `\"supersede\"`")
    ranks_per_node: int | None = _knob(
        None, "ranks per node for the peer mapping; smaller values simulate several nodes on one machine",
        none_means="`LOCAL_WORLD_SIZE`", metavar="N")
    commit_fan_in: int | None = _knob(
        None, "ranks per group of the commit: each group's first rank joins and checks its group's reports and "
              "forwards them to rank 0 as one, so rank 0's work per checkpoint grows with the number of groups, not "
              "of ranks (docs/FORMAT.md, \"Commit protocol\"); a value of at least the world size makes every rank "
              "report to rank 0. Every rank must use the same value",
        none_means="the square root of the world size, rounded up", metavar="N")
    replica_dir: str | None = _knob(
        None, "host-memory directory for the replicas a node holds (with `peer_replica`), created private "
              "(0700) and checked before every use: another user's directory, one open to others or a symbolic "
              "link on its path is refused", none_means="`/dev/shm/megatron_ext-<uid>/replicas-<hash of save_dir>`",
        metavar="DIR")
    parser_threads: int | None = _knob(
        None, "accepted for DeepSpeed compatibility, ignored", none_means="—",
        no_flag="a DeepSpeed key only, ignored")

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
        cfg = cls(**data).check_node()
        if probe:
            cfg.validate(full_ok=True)
        return cfg

    def check_node(self) -> "EngineConfig":
        """The start-up checks that look beyond the values: the cache fits this node's physical memory,
        and each of ``safe_classes`` is a class defined under exactly that name (its module is imported:
        a configuration is trusted input). ``from_dict`` and the engine run it; returns ``self``."""
        ram = _physical_memory_bytes()
        if ram and self.host_cache_bytes > ram * 0.9:
            raise ConfigError(
                f"host_cache_size {self.host_cache_size} GiB exceeds 90% of this node's "
                f"{ram / GIB:.1f} GB of memory"
            )
        self.allowed_classes()
        return self

    def __post_init__(self) -> None:
        """Every construction path (``EngineConfig(...)``, ``from_dict``, ``dataclasses.replace``) checks the
        values; reading the node and importing modules is ``check_node``'s, so constructing has no side effects."""
        _number(self.host_cache_size, "host_cache_size")
        if not self.host_cache_size > 0:
            raise ConfigError(f"host_cache_size must be > 0 GiB, got {self.host_cache_size}")
        if self.host_cache_size > _MAX_CACHE_GIB:  # bounded before any conversion to bytes
            raise ConfigError(f"host_cache_size {self.host_cache_size} GiB is absurd (the bound is {_MAX_CACHE_GIB:g})")
        if self.host_cache_bytes < 4 * 4096:
            raise ConfigError(f"host_cache_size {self.host_cache_size} GiB is below the 16 KiB minimum")
        _number(self.chunk_size_mb, "chunk_size_mb")
        if not (0 < self.chunk_size_mb <= 4096):
            raise ConfigError(f"chunk_size_mb must be in (0, 4096], got {self.chunk_size_mb}")
        for name in ("save_dir", "local_dir", "replica_dir", "telemetry_path"):
            object.__setattr__(self, name, _path(getattr(self, name), name, object_ok=name == "save_dir"))
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
        if self.peer_replica and is_object_url(self.save_dir):
            raise ConfigError("peer_replica is not available with an object-store save_dir (s3://) yet; "
                              "use a node-local level (local_dir) for fast restarts instead")
        value = self.ranks_per_node
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"ranks_per_node must be a whole number >= 1, got {value!r}")
        value = self.commit_fan_in
        if value is not None and (type(value) is not int or value < 2):
            raise ConfigError(f"commit_fan_in must be a whole number >= 2, got {value!r}")
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
                if getattr(self, n) is not None and not is_object_url(getattr(self, n))]
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
        before it probes again (save/lifecycle/space.py); a crashed save's partial files must not block
        the restart that frees them."""
        full: list[tuple[str, str]] | None = [] if full_ok else None
        for name in ("save_dir", "local_dir"):
            path = getattr(self, name)
            if is_object_url(path):
                check_object_root(path, name)
            elif path is not None:
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
        if path is None and self.save_dir is not None and not is_object_url(self.save_dir):
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


def _path(value: Any, name: str, object_ok: bool = False) -> str | None:
    """A configured path as a non-empty string (``os.PathLike`` accepted), else ConfigError;
    ``object_ok``: an ``s3://bucket/prefix`` URL too (the object-store level), in its one spelling."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if type(value) is not str or not value or "\0" in value:
        raise ConfigError(f"{name} must be a path (a non-empty string), got {value!r}")
    if object_ok and is_object_url(value):
        try:
            return object_store.normalize(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    refusal = url_refusal(value, name, object_ok)
    if refusal is not None:
        raise ConfigError(refusal)
    return value


def url_refusal(path: str, what: str, object_ok: bool = False) -> str | None:
    """Why ``path``, given as ``what``, is refused: it is a URL that is not an accepted object-store
    root (``msc://``, ``gs://``..., or ``s3://`` where only a path fits), which ``os.makedirs`` would
    make a local directory named ``s3:``. None for a path (or, with ``object_ok``, an ``s3://`` URL)."""
    match = _URL_SCHEME.match(path)
    if match is None or (object_ok and is_object_url(path)):
        return None
    if object_ok:
        return (f"{what} {path!r} is a {match.group(1).lower()}:// URL; the object-store level takes "
                "s3://bucket/prefix (any S3-compatible server, AWS_ENDPOINT_URL), else give a POSIX path")
    return (f"{what} {path!r} is a {match.group(1).lower()}:// URL; it must be a POSIX path (node-local, Lustre, "
            "GPFS, NFS): only the shared level (save_dir) may be an s3:// object store")


_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # RFC 3986's scheme, then the authority's "//"


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


def check_object_root(url: str, what: str) -> None:
    """At start-up: the bucket exists, the credentials are accepted and writes are allowed, else one
    line saying which (``object_store.probe_root``: a probe object written and deleted)."""
    try:
        object_store.probe_root(url)
    except ImportError:
        raise ConfigError(f"{what} {url!r}: the object-store level needs boto3 (pip install 'megatron_ext[s3]')") from None
    except OSError as exc:
        raise ConfigError(f"{what} {url!r}: {exc.strerror or exc}") from None


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


# ------------------------------------------------------------------ the declaration's other forms
@dataclasses.dataclass(frozen=True)
class EngineFlag:
    """One command-line flag made from an ``EngineConfig`` field: ``parser.add_argument(*options, **kwargs)``."""

    key: str
    options: tuple[str, ...]
    kwargs: dict


def flag_name(key: str) -> str:
    """The flag a key gets: ``--datastates-`` and the key with dashes."""
    return FLAG_PREFIX + key.replace("_", "-")


def default_text(field: dataclasses.Field, markdown: bool = False) -> str:
    """A field's default as users write it (``1``, ``"auto"``, ``false``, ``[]``), or what None stands for."""
    value = field.default
    if value is None:
        text = field.metadata[NONE_MEANS] or "none"
        return text if markdown else text.replace("`", "")
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):  # the enums are str enums
        text = f'"{value}"'
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, tuple):
        text = "[" + ", ".join(f'"{v}"' for v in value) + "]"
    else:
        text = str(value)
    return f"`{text}`" if markdown and isinstance(value, (bool, str, tuple)) else text


def flag_help(field: dataclasses.Field) -> str:
    """A flag's help: the field's help as plain text, its unit and its default (``%`` escaped for argparse)."""
    unit = field.metadata[UNIT]
    tail = f"{unit}; default: {default_text(field)}" if unit else f"default: {default_text(field)}"
    return f"{field.metadata[HELP]} ({tail}).".replace("`", "").replace("%", "%%")


def _parse_o_direct(text: str) -> bool | str:
    value = text.strip().lower()
    if value in ("true", "false", "auto"):
        return {"true": True, "false": False}.get(value, "auto")
    raise argparse.ArgumentTypeError(f"true, false or auto, not {text!r}")


def engine_flags(dest_prefix: str = "datastates_") -> list[EngineFlag]:
    """The ``--datastates-*`` flags of every field that has one, each field's value in ``dest_prefix + key``
    (None when absent: the engine's default applies). Earlier spellings are aliases of the same flag."""
    hints = typing.get_type_hints(EngineConfig)
    flags = []
    for field in dataclasses.fields(EngineConfig):
        meta = field.metadata
        if meta[NO_FLAG] or meta[FLAG_ELSEWHERE]:
            continue
        dest = dest_prefix + field.name
        hint = hints[field.name]
        kinds = ([k for k in typing.get_args(hint) if k is not type(None)]
                 if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint])
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": flag_help(field)}
        unit = meta[UNIT]
        metavar = meta[METAVAR] or ("SECONDS" if unit == "seconds" else unit)
        if kinds == [bool]:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif len(kinds) == 1 and issubclass(typing.get_origin(kinds[0]) or kinds[0], enum.Enum):
            kwargs["choices"] = [str(c) for c in kinds[0]]
        elif kinds == [bool, str]:
            kwargs.update(type=_parse_o_direct, metavar=metavar)
        elif typing.get_origin(kinds[0]) is tuple:
            kwargs.update(type=str, nargs="+", metavar=metavar)
        else:
            kwargs.update(type=kinds[0], metavar=metavar)
        flags.append(EngineFlag(field.name, (flag_name(field.name),) + meta[OLD_FLAGS], kwargs))
        for off in meta[OFF_FLAGS]:
            flags.append(EngineFlag(field.name, (off,), {
                "dest": dest, "action": "store_const", "const": False, "default": None,
                "help": f"the earlier spelling of --no-{flag_name(field.name)[2:]}."}))
    return flags


def config_table_markdown() -> str:
    """docs/ENGINE.md's table of configuration keys, made from the fields (tests/test_config_declared_once.py)."""
    rows = ["| key | default | unit | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(EngineConfig):
        meaning = field.metadata[HELP]
        if field.metadata[FLAG_ELSEWHERE]:
            meaning += f" (Megatron-LM: `{field.metadata[FLAG_ELSEWHERE]}`)"
        rows.append(f"| `{field.name}` | {default_text(field, markdown=True)} | {field.metadata[UNIT] or ''} "
                    f"| {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"
