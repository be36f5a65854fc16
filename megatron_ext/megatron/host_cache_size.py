"""``--datastates-host-cache-size auto`` (the default): one rank's host cache sized to its checkpoint.

A host cache smaller than the rank's checkpoint makes every save wait for storage once the
cache is full (backpressure); a real rank writes many GB, far more than a fixed default. With
``auto`` the adapter sizes the cache when it creates the engine:

    size = min(rank bytes + one chunk, MEMORY_SHARE x MemAvailable / ranks on this node)

* *rank bytes*: the bytes of the tensors this rank writes, as known at its first save (the owned
  shards, RNG and common tensors of the state it hands to the engine); when a load creates the
  engine first, this rank's bytes in the loaded checkpoint (``checkpoint_rank_bytes``);
* *one chunk*: the unit of copy and write (``--datastates-chunk-size-mb``), for the file's
  header and the last partial chunk, so the whole checkpoint fits at once;
* the bound: ``MEMORY_SHARE`` (half) of the node's ``MemAvailable`` (``/proc/meminfo``) at that
  moment, divided by the ranks on this node (``LOCAL_WORLD_SIZE``, which torchrun sets; 1
  without it); the other half stays with the trainer, its data loaders and the page cache.
  Where ``MemAvailable`` cannot be read, the physical memory is taken instead.

The engine takes a number of GiB (``EngineConfig.host_cache_size``): ``auto`` is the adapter's
concept, since only the adapter knows the rank's bytes before the engine exists. One log line
says how the size was chosen.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from megatron_ext.engine.config import GIB, MIB, EngineConfig
from megatron_ext.engine.format.codec import Frozen

AUTO = "auto"
#: Share of the node's available memory all its ranks' caches may take together.
MEMORY_SHARE = 0.5
_MIN_BYTES = 16 << 10  # the engine's minimum cache


@dataclasses.dataclass(frozen=True)
class AutoCacheSize:
    """How ``auto`` sized one rank's host cache: the inputs, the bound and the result."""

    rank_bytes: int
    chunk_bytes: int
    mem_available: int | None  # the node's available memory, bytes (None: unknown, no bound)
    local_ranks: int
    source: str  # where rank_bytes came from, for the log line

    @property
    def bound_bytes(self) -> int | None:
        if self.mem_available is None:
            return None
        return int(MEMORY_SHARE * self.mem_available / max(1, self.local_ranks))

    @property
    def nbytes(self) -> int:
        want = self.rank_bytes + self.chunk_bytes
        bound = self.bound_bytes
        return max(_MIN_BYTES, want if bound is None else min(want, bound))

    @property
    def gb(self) -> float:
        """The size as ``EngineConfig.host_cache_size`` takes it (GiB)."""
        return self.nbytes / GIB

    def log_line(self) -> str:
        bound = self.bound_bytes
        if bound is None:
            limit = "no bound (available memory unknown)"
        else:
            limit = (f"bound {_size(bound)} = {MEMORY_SHARE:.0%} of MemAvailable {_size(self.mem_available)} / "
                     f"{self.local_ranks} rank(s) on this node")
        capped = " (capped at the bound: saves larger than it wait for storage)" if (
            bound is not None and self.rank_bytes + self.chunk_bytes > bound) else ""
        return (f"[datastates] host cache auto: {_size(self.nbytes)} = this rank's checkpoint "
                f"{_size(self.rank_bytes)} ({self.source}) + one chunk {_size(self.chunk_bytes)}; {limit}{capped}")


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def auto_host_cache(rank_bytes: int, cfg: Mapping[str, Any], source: str, *, mem_available: int | None = None,
                    local_ranks: int | None = None) -> AutoCacheSize:
    """``auto``'s size for a rank writing ``rank_bytes``, with the engine configuration ``cfg`` (its chunk size).

    ``mem_available`` and ``local_ranks`` default to this node's (``mem_available_bytes``,
    ``local_world_size``).
    """
    chunk_mb = cfg.get("chunk_size_mb") or EngineConfig.chunk_size_mb
    chunk = max(4096, int(chunk_mb * MIB) // 4096 * 4096)
    return AutoCacheSize(rank_bytes=int(rank_bytes), chunk_bytes=chunk,
                         mem_available=mem_available_bytes() if mem_available is None else mem_available,
                         local_ranks=local_world_size() if local_ranks is None else local_ranks, source=source)


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new work (``MemAvailable``), else the physical memory."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """The ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    value = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a nested state (dicts, lists, tuples), each counted once."""
    seen: set[int] = set()
    total = 0
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if id(node) not in seen:
                seen.add(id(node))
                total += node.numel() * node.element_size()
        elif isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, Frozen):
            stack.append(node.value)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def checkpoint_rank_bytes(manifest: Mapping[str, Any], rank: int, world_size: int) -> int:
    """This rank's tensor bytes in a committed checkpoint (its manifest), for the next save's cache.

    Saved with this world size: the rank's own tensor files. Otherwise an estimate: the largest
    rank's bytes, scaled by the saved world size over this one (each rank of a smaller job holds
    the shards of several saved ranks).
    """
    by_rank: dict[int, int] = {}
    for entry in manifest["files"].values():
        by_rank[entry["rank"]] = by_rank.get(entry["rank"], 0) + int(entry["size"])
    if not by_rank:
        return 0
    saved_world = int(manifest.get("world_size") or len(by_rank))
    if saved_world == world_size:
        return by_rank.get(rank, 0)
    return -(-max(by_rank.values()) * saved_world // world_size)
