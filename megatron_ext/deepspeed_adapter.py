"""DeepSpeed adapter: ``DeepSpeedDataStatesEngine``, what DeepSpeed's ``datastates_ckpt`` section loads.

DeepSpeed 0.19 imports ``from datastates import CheckpointEngine`` (the top-level ``datastates``
module names this class so) and calls
``CheckpointEngine(deepspeed_config, rank)``, ``save(state_dict, path)``,
``load(path, map_location)`` and ``wait(persist=True)``. It means to call ``wait`` at the next step
boundary (its "decoupled" commit) and then write ``<save_dir>/latest``. At 0.19.8 that never
happens: its DataStates wrapper does not implement ``get_commit_info``, so the per-step commit
returns early, ``wait`` runs only at clean-up and ``latest`` is never written. This adapter
therefore does not rely on it (docs/DEEPSPEED.md):

* **Lazy wait.** A global ``torch.optim`` step pre-hook calls ``wait_snapshot`` before any
  optimizer mutates parameters: the moment DeepSpeed meant, and no earlier. It does not wait for
  the flush, only for the snapshot.
* **Commit.** The same hook then asks for the commit of every tag saved since the last step; the
  commit completes in the background. With ZeRO (stage >= 1) every rank saves its optimizer
  partition, so every rank knows every tag. Without ZeRO, data-parallel ranks other than 0 save
  nothing and cannot know the tag: then the ranks agree on the tags with one small all-gather in
  the step hook, every step (the price of that configuration, documented).
* **latest.** Rank 0 writes ``<save_dir>/latest`` itself, atomically, once a tag is committed, so
  it never names a tag whose bytes are not durable. Should DeepSpeed write an uncommitted tag
  there (a fixed wrapper, or a torn write), loading falls back to the newest committed tag.

Paths map to the engine as ``<save_dir>/<tag>/<file>`` -> root ``save_dir``, checkpoint ``tag``,
name ``<file>``. ``save`` also leaves a small JSON pointer file at the exact path DeepSpeed asked
for, because DeepSpeed finds model files by globbing for them before it calls ``load``; the data
itself is in ``<file>.<run>.safetensors`` and is only trusted through the tag's manifest.
``"commit_wait": "durable"`` makes ``wait`` block until the commit, for callers who want that.

**Loading is safe by default.** A DeepSpeed checkpoint is untrusted input: ``load`` decodes it with
the engine's allow-list codec (DeepSpeed's own classes are ``DEEPSPEED_SAFE_CLASSES``) and refuses a
pickle, naming its class, the file and ``"datastates_ckpt": {"allow_pickle": true}``, the only
switch that unpickles (sidecar pickles and Transformer Engine's extra state alike).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed, read_manifest
from megatron_ext.engine.config import EngineConfig
from megatron_ext.engine.errors import ConfigError, UnsafeCheckpointError
from megatron_ext.engine.files import atomic_write
from megatron_ext.te_extra_state import check_extra_state

log = logging.getLogger("megatron_ext.deepspeed")

POINTER_FORMAT = "megatron_ext.datastates.pointer"
_ADAPTER_KEYS = {"commit_wait", "allow_pickle"}

#: The exact DeepSpeed classes DeepSpeed 0.19.8's checkpoints hold, found by saving real checkpoints
#: (2 CPU ranks: ZeRO 0, 1, 2 and 3; fp32, bf16 and fp16; with and without the WarmupLR scheduler).
#: ZeRO 0 holds none; ZeRO 1-3 hold the ZeRO stage, the loss scaler (dynamic under fp16) and, for
#: ZeRO 1-2, ``fragment_address`` records. Everything else in them is plain values, tensors,
#: ``OrderedDict``, ``torch.Size`` and ``torch.dtype``. Extend with ``"safe_classes"`` in the
#: ``datastates_ckpt`` section (docs/DEEPSPEED.md).
DEEPSPEED_SAFE_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


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


def _refusal(where: str, exc: UnsafeCheckpointError) -> str:
    """The engine's refusal in DeepSpeed's terms: the file DeepSpeed asked for, the class, and the config key."""
    classes = ", ".join(exc.classes) or "an unnamed class"
    if exc.pickled:
        return (f"{where} (data in {exc.file}) holds a pickled object of class {classes} at {exc.place}; "
                "DeepSpeed checkpoints are loaded without unpickling. If you trust this checkpoint, set "
                '"datastates_ckpt": {"allow_pickle": true} in the DeepSpeed config')
    return (f"{where} (data in {exc.file}) holds an object of class {classes} at {exc.place}, which is not on "
            "the allow-list. If you trust this checkpoint, allow the class: "
            f'"datastates_ckpt": {{"safe_classes": ["{classes}"]}} in the DeepSpeed config '
            '("allow_pickle" does not import classes)')


def _split(path: str) -> tuple[str, str, str]:
    path = os.path.abspath(path)
    tag_dir, name = os.path.split(path)
    root, tag = os.path.split(tag_dir)
    return root, tag, name


class DeepSpeedDataStatesEngine:
    """What DeepSpeed's ``DataStatesCheckpointEngine`` drives; backed by megatron_ext's ``CheckpointEngine``."""

    def __init__(self, deepspeed_config: Any, rank: int):
        section = _section(deepspeed_config)
        self.commit_wait = section.pop("commit_wait", "snapshot")
        if self.commit_wait not in ("snapshot", "durable"):
            raise ConfigError(f"datastates_ckpt.commit_wait must be \"snapshot\" or \"durable\", got {self.commit_wait!r}")
        self.allow_pickle = section.pop("allow_pickle", False)
        if type(self.allow_pickle) is not bool:
            raise ConfigError(f"datastates_ckpt.allow_pickle must be true or false, got {self.allow_pickle!r}")
        user_classes = section.get("safe_classes", [])
        if not isinstance(user_classes, list):
            raise ConfigError(f"datastates_ckpt.safe_classes must be a list of class names, got {user_classes!r}")
        section["safe_classes"] = list(DEEPSPEED_SAFE_CLASSES) + [c for c in user_classes if c not in DEEPSPEED_SAFE_CLASSES]
        config = EngineConfig.from_dict(section, probe=False)
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = rank
        self.engine = CheckpointEngine(config, rank=rank, world_size=world)
        self._telemetry_default = config.telemetry_path is None and config.save_dir is None
        self._uncommitted: list[tuple[str, str]] = []  # (root, tag) saved here, commit not yet asked
        self._armed = False  # whether a save happened, so the step hook has something to do
        # With ZeRO every rank saves its optimizer partition, so no rank needs to learn tags from others.
        zero_stage = getattr(deepspeed_config, "zero_optimization_stage", 0) or 0
        self._all_ranks_save = world == 1 or zero_stage >= 1
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        # Runs before the engine's own exit hook (registered earlier): the last tag gets its "latest".
        atexit.register(self._commit_at_exit)

    # -- the four calls DeepSpeed makes -------------------------------------------------------
    def save(self, state_dict: Any, path: str) -> None:
        root, tag, name = _split(path)
        self._telemetry_under(root)
        if (root, tag) not in self._uncommitted:
            self._uncommitted.append((root, tag))
        self._armed = True
        step = re.fullmatch(r"global_step(\d+)", tag)  # DeepSpeed's default tags: the version is the step
        self.engine.save(state_dict, tag, name, root=root, version=int(step.group(1)) if step else None)
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        with open(os.path.join(root, tag, name), "w", encoding="utf-8") as f:  # tiny; no fsync needed
            json.dump({"format": POINTER_FORMAT, "checkpoint": tag, "name": name,
                       "note": "data: see manifest.json in this directory. DeepSpeed's zero_to_fp32.py cannot read "
                               "these files; for consolidated weights run: megatron-ext export "
                               f"{os.path.join(root, tag)} --to safetensors OUT"}, f)

    def load(self, path: str, map_location: Any = None) -> Any:
        root, tag, name = _split(path)
        try:
            manifest = read_manifest(os.path.join(root, tag)) if tag else None
        except CheckpointError as exc:  # damaged or foreign: an older committed tag may still do
            log.warning("[datastates] %s", exc)
            manifest = None
        if manifest is None or name not in manifest["files"]:
            fallback = [t for t, m in list_committed(root) if name in m["files"]]
            if not fallback:
                raise CheckpointError(f"no committed checkpoint under {root} holds {name!r} (asked for tag {tag!r})")
            log.warning("[datastates] tag %r under %s is not committed (its bytes may not be durable); "
                        "loading the newest committed tag %r instead", tag, root, fallback[-1])
            tag = fallback[-1]
        where = os.path.join(root, tag, name)
        try:
            # Safe decoding unless the config trusts the checkpoint: DeepSpeed's own objects are on the
            # allow-list (DEEPSPEED_SAFE_CLASSES), so only what someone chose to pickle needs the opt-in.
            state = self.engine.load(tag, name, root=root, map_location=map_location, allow_pickle=self.allow_pickle)
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(_refusal(where, exc), file=exc.file, place=exc.place, classes=exc.classes,
                                        pickled=exc.pickled) from None
        # DeepSpeed hands the module state to load_state_dict, where Transformer Engine unpickles its extra state.
        check_extra_state(state, allow_pickle=self.allow_pickle, where=where,
                          opt_in='"allow_pickle": true in datastates_ckpt')
        return state

    def wait(self, persist: bool = True) -> None:
        self.engine.wait_snapshot()
        if not persist:
            return
        self._commit_pending()
        if self.commit_wait == "durable":
            self.engine.wait_persisted()

    # -- helpers ------------------------------------------------------------------------------
    def _telemetry_under(self, root: str) -> None:
        """Without ``telemetry_path`` the engine writes telemetry under the first save directory, as it
        does under ``save_dir`` elsewhere (DeepSpeed names the directory only at ``save_checkpoint``)."""
        telemetry = self.engine.telemetry
        if telemetry.path is None and self._telemetry_default:
            telemetry.path = os.path.join(root, "datastates_telemetry", f"rank-{self.rank:05d}.jsonl")
            self._telemetry_default = False

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Right before any optimizer mutates parameters: snapshot complete, commits requested."""
        if self._armed or not self._all_ranks_save:  # the latter: every rank joins the all-gather
            self.wait(persist=True)

    def _commit_pending(self) -> None:
        for root, tag in self._agree_on_tags():
            self.engine.commit(tag, root=root, on_committed=self._latest_writer(root, tag))
        self._uncommitted.clear()
        self._armed = False

    def _latest_writer(self, root: str, tag: str):
        def write_latest(manifest: dict) -> None:
            if self.rank == 0:
                atomic_write(os.path.join(root, "latest"), tag.encode())

        return write_latest

    def _agree_on_tags(self) -> list[tuple[str, str]]:
        """Ranks that saved nothing (data-parallel ranks without ZeRO) still join each commit.

        Called from the optimizer step hook, which runs on every rank at the same point of the
        step, so a collective is in order there.
        """
        import torch.distributed as dist

        mine = list(self._uncommitted)
        if self._all_ranks_save or not (dist.is_available() and dist.is_initialized()):
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

    def _commit_at_exit(self) -> None:
        """The last checkpoint of a run is committed (and named in ``latest``) even if no step follows it."""
        if not self._uncommitted:
            return
        if self._all_ranks_save:
            for root, tag in self._uncommitted:
                self.engine.commit(tag, root=root, on_committed=self._latest_writer(root, tag))
            self._uncommitted.clear()
        else:  # no collective at interpreter exit: peers may be gone already
            log.warning("[datastates] without ZeRO the last checkpoint (%s) is committed only if a step or "
                        "engine.destroy() follows it", ", ".join(tag for _, tag in self._uncommitted))

    def shutdown(self) -> None:
        self._hook.remove()
        self.engine.shutdown()


__all__ = ["DeepSpeedDataStatesEngine"]
