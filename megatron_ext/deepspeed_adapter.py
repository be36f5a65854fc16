"""DeepSpeed adapter: the ``CheckpointEngine`` that DeepSpeed's ``datastates_ckpt`` section loads.

DeepSpeed 0.19 imports ``from datastates import CheckpointEngine`` and calls
``CheckpointEngine(deepspeed_config, rank)``, ``save(state_dict, path)``,
``load(path, map_location)`` and ``wait(persist=True)``. It treats the engine as *decoupled*:
at the next step boundary, right before the model update, it calls ``wait`` and then rank 0
writes ``<save_dir>/latest`` with a plain ``open('w')``.

The choice made here (docs/DEEPSPEED.md): ``wait`` blocks only until the snapshot is in host
memory (the optimizer may then update), and asks for the commit, which completes in the
background. ``latest`` can therefore name a tag whose bytes are not durable yet, or be torn by a
crash. Loading never trusts it: a tag without a manifest (not committed) is replaced by the
newest committed tag in the same directory, with a warning. ``"commit_wait": "durable"`` makes
``wait`` block until the commit instead, for users who want ``latest`` always durable.

Paths map to the engine as ``<save_dir>/<tag>/<file>`` -> root ``save_dir``, checkpoint ``tag``,
name ``<file>``. ``save`` also leaves a small JSON pointer file at the exact path DeepSpeed asked
for, because DeepSpeed finds model files by globbing for them before it calls ``load``; the data
itself is in ``<file>.<run>.safetensors`` and is only trusted through the tag's manifest.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any


from megatron_ext.engine import CheckpointEngine as _Engine, CheckpointError, list_committed, read_manifest
from megatron_ext.engine.config import ConfigError, EngineConfig

log = logging.getLogger("megatron_ext.deepspeed")

POINTER_FORMAT = "megatron_ext.datastates.pointer"
_ADAPTER_KEYS = {"commit_wait"}


def _section(deepspeed_config: Any) -> dict:
    """The ``datastates_ckpt`` dict from a DeepSpeedConfig, a full config dict, or the section itself."""
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("datastates_ckpt", deepspeed_config)
    else:
        section = getattr(getattr(deepspeed_config, "datastates_config", None), "config", None)
    if section is None or section is True:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"datastates_ckpt must be an object, got {section!r}")
    return dict(section)


def _split(path: str) -> tuple[str, str, str]:
    path = os.path.abspath(path)
    tag_dir, name = os.path.split(path)
    root, tag = os.path.split(tag_dir)
    return root, tag, name


class CheckpointEngine:
    """What DeepSpeed's ``DataStatesCheckpointEngine`` drives; backed by megatron_ext's engine."""

    def __init__(self, deepspeed_config: Any, rank: int):
        section = _section(deepspeed_config)
        self.commit_wait = section.pop("commit_wait", "snapshot")
        if self.commit_wait not in ("snapshot", "durable"):
            raise ConfigError(f"datastates_ckpt.commit_wait must be \"snapshot\" or \"durable\", got {self.commit_wait!r}")
        section.setdefault("object_modules", ["deepspeed."])
        config = EngineConfig.from_dict(section)
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = rank
        self.engine = _Engine(config, rank=rank, world_size=world)
        self._uncommitted: list[tuple[str, str]] = []  # (root, tag) saved here, commit not yet asked

    # -- the four calls DeepSpeed makes -------------------------------------------------------
    def save(self, state_dict: Any, path: str) -> None:
        root, tag, name = _split(path)
        if (root, tag) not in self._uncommitted:
            self._uncommitted.append((root, tag))
        self.engine.save(state_dict, tag, name, root=root)
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        with open(os.path.join(root, tag, name), "w", encoding="utf-8") as f:  # tiny; no fsync needed
            json.dump({"format": POINTER_FORMAT, "checkpoint": tag, "name": name,
                       "note": "data: see manifest.json in this directory"}, f)

    def load(self, path: str, map_location: Any = None) -> Any:
        root, tag, name = _split(path)
        manifest = read_manifest(os.path.join(root, tag)) if tag else None
        if manifest is None or name not in manifest["files"]:
            fallback = [t for t, m in list_committed(root) if name in m["files"]]
            if not fallback:
                raise CheckpointError(f"no committed checkpoint under {root} holds {name!r} (asked for tag {tag!r})")
            log.warning("[datastates] tag %r under %s is not committed (its bytes may not be durable); "
                        "loading the newest committed tag %r instead", tag, root, fallback[-1])
            tag = fallback[-1]
        return self.engine.load(tag, name, root=root, map_location=map_location)

    def wait(self, persist: bool = True) -> None:
        self.engine.wait_snapshot()
        if not persist:
            return
        for root, tag in self._agree_on_tags():
            self.engine.commit(tag, root=root)
        self._uncommitted.clear()
        if self.commit_wait == "durable":
            self.engine.wait_persisted()

    # -- helpers ------------------------------------------------------------------------------
    def _agree_on_tags(self) -> list[tuple[str, str]]:
        """Ranks that saved nothing (e.g. data-parallel ranks without ZeRO) still join each commit.

        DeepSpeed calls ``wait`` on every rank at the same point of the step, so a collective here
        is in order; it runs only when something was saved somewhere.
        """
        import torch.distributed as dist

        mine = list(self._uncommitted)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        gathered: list[list[tuple[str, str]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        ordered: list[tuple[str, str]] = []
        for tags in gathered:
            for key in tags or []:
                key = tuple(key)
                if key not in ordered:
                    ordered.append(key)
        return ordered

    def shutdown(self) -> None:
        self.engine.shutdown()


__all__ = ["CheckpointEngine"]
