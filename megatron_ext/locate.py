"""Which checkpoint a command means: a root, a root plus a name, or a checkpoint's own directory.

Every checkpoint tool (``verify``, ``inspect``, ``export``, ``convert``) takes its ``DIR`` argument
through this module, so they accept the same things for every kind of committed checkpoint:

* Megatron-LM (``--use-datastates``): ``<save>/iter_0000123/``, tracker ``latest_checkpointed_iteration.txt``;
* DeepSpeed (``datastates_ckpt``): ``<save_dir>/global_step123/``, tracker ``latest``;
* the engine API (``CheckpointEngine.save(state, "step_0000123")``): any directory name.

``DIR`` may be the root the checkpoints live under (then ``--iteration N`` or ``--checkpoint NAME``
picks one, and commands that need one take the newest committed one), or one checkpoint's own
directory (it holds ``manifest.json``, or ``.reports/`` while uncommitted). ``--iteration N``
names ``iter_{N:07d}`` or ``global_step{N}`` when that directory exists, else the committed
checkpoint whose version is N.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_ext.engine import CheckpointError, object_store
from megatron_ext.engine.format.catalog import checkpoint_dirs, list_committed, manifest_exists, read_manifest
from megatron_ext.engine.format.names import MANIFEST, REPORTS, valid_name
from megatron_ext.engine.object_store import is_object_url, resolve_root, under

MEGATRON, DEEPSPEED, ENGINE = "megatron", "deepspeed", "engine"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
DEEPSPEED_FILE_SUFFIXES = ("_model_states.pt", "_optim_states.pt")


@dataclasses.dataclass(frozen=True)
class Located:
    """One committed checkpoint: ``root/name`` with its validated manifest and its kind."""

    root: str
    name: str
    manifest: dict
    kind: str

    @property
    def path(self) -> str:
        return under(self.root, self.name)


def _has_dir(root: str, name: str) -> bool:
    """Whether ``root`` holds a directory ``name`` (on the object-store level: objects under that prefix)."""
    if is_object_url(root):
        return name in checkpoint_dirs(root)
    return os.path.isdir(os.path.join(root, name))


def _is_root(path: str) -> bool:
    """A directory checkpoints may live under; any object-store prefix is one (an empty one lists nothing)."""
    return is_object_url(path) or os.path.isdir(path)


def is_checkpoint_dir(path: str) -> bool:
    """A checkpoint's own directory: it holds a manifest, or rank reports (an interrupted save)."""
    if is_object_url(path):
        return manifest_exists(path) or bool(object_store.list_children(object_store.join(path, REPORTS))[1])
    return os.path.lexists(os.path.join(path, MANIFEST)) or os.path.isdir(os.path.join(path, REPORTS))


def split(path: str) -> tuple[str, str | None]:
    """(root, checkpoint name) of a checkpoint's own directory; (path, None) for any other directory."""
    if is_object_url(path):
        url = object_store.ObjectUrl.parse(path)  # a bad URL is a ValueError naming it
        try:
            own = bool(url.key) and is_checkpoint_dir(url.url)
        except OSError as exc:  # no such bucket, refused credentials, no server: said of the URL asked for
            raise CheckpointError(f"{url.url}: {exc.strerror or exc}") from None
        if own:
            root, _, name = url.url.rpartition("/")
            return root, name
        return url.url, None
    path = os.path.normpath(path)
    if is_checkpoint_dir(path):
        absolute = os.path.abspath(path)
        return os.path.dirname(absolute), os.path.basename(absolute)
    return path, None


def describe_kind(kind: str) -> str:
    """"a Megatron-LM checkpoint", "a DeepSpeed checkpoint", "an engine API checkpoint"."""
    return {MEGATRON: "a Megatron-LM checkpoint", DEEPSPEED: "a DeepSpeed checkpoint"}.get(
        kind, "an engine API checkpoint")


def kind_of(manifest: dict) -> str:
    """``megatron``, ``deepspeed`` or ``engine``, from the manifest's file names and extras alone."""
    files = manifest.get("files") or {}
    if files and all(name.endswith(DEEPSPEED_FILE_SUFFIXES) for name in files):
        return DEEPSPEED
    if files and all(isinstance((entry.get("extra") or {}), dict) and "layout" in (entry.get("extra") or {})
                     for entry in files.values()):
        return MEGATRON
    return ENGINE


def _names_for_iteration(root: str, iteration: int) -> list[str]:
    """Directory names ``--iteration N`` may mean under ``root``, existing ones first."""
    candidates = [f"iter_{iteration:07d}", f"global_step{iteration}"]
    present = [n for n in candidates if _has_dir(root, n)]
    if present:
        return present
    by_version = [name for name, manifest in list_committed(root) if manifest.get("version") == iteration]
    return by_version or candidates[:1]


def name_of(root: str, iteration: int | None = None, checkpoint: str | None = None) -> str | None:
    """The checkpoint name ``--iteration``/``--checkpoint`` ask for under ``root`` (None: neither given)."""
    if checkpoint is not None:
        if not valid_name(checkpoint):
            raise CheckpointError(f"{checkpoint!r} is not a checkpoint name (one directory name under {root})")
        return checkpoint
    if iteration is not None:
        names = _names_for_iteration(root, iteration)
        if len(names) > 1:
            raise CheckpointError(f"--iteration {iteration} is ambiguous under {root}: {', '.join(names)}; "
                                  "pass --checkpoint NAME")
        return names[0]
    return None


def _tracked(root: str) -> str | None:
    """The checkpoint a framework's tracker file names under ``root`` (Megatron's or DeepSpeed's), if any."""
    for tracker, to_name in ((MEGATRON_TRACKER, lambda t: "release" if t == "release" else
                              f"iter_{int(t):07d}" if t.isdigit() else None),
                             (DEEPSPEED_TRACKER, lambda t: t if valid_name(t) else None)):
        try:
            if is_object_url(root):  # more than 256 bytes is refused: not a tracker
                text = object_store.get(object_store.join(root, tracker), max_bytes=256).decode("utf-8").strip()
            else:
                with open(os.path.join(root, tracker), encoding="utf-8") as f:
                    text = f.read(256).strip()
        except (OSError, UnicodeDecodeError):
            continue
        name = to_name(text)
        if name is not None:
            return name
    return None


def newest(root: str) -> str | None:
    """The checkpoint to use when none is named: the tracker's if it is committed, else the newest committed."""
    committed = list_committed(root)
    names = {name for name, _ in committed}
    tracked = _tracked(root)
    if tracked is not None and tracked in names:
        return tracked
    return committed[-1][0] if committed else None


def resolve(path: str, iteration: int | None = None, checkpoint: str | None = None) -> Located:
    """The one committed checkpoint ``path`` (+ ``--iteration``/``--checkpoint``) means; the newest if not named."""
    root, own = split(path)
    if not _is_root(root):
        raise CheckpointError(f"{path} is not a directory")
    asked = name_of(root, iteration, checkpoint) if own is None else own
    if own is not None and (iteration is not None or checkpoint is not None):
        other = name_of(root, iteration, checkpoint)
        if other != own:
            raise CheckpointError(f"{path} is checkpoint {own}, but --iteration/--checkpoint asks for {other}")
    if asked is None:
        asked = newest(root)
        if asked is None:
            raise CheckpointError(f"no committed checkpoint under {root} (`megatron-ext inspect {root}` lists what "
                                  "is there)")
    directory = under(root, asked)
    present = _has_dir(root, asked)
    manifest = read_manifest(directory) if present else None
    if manifest is None:
        why = "no such directory" if not present else f"no {MANIFEST}: not committed"
        raise CheckpointError(f"{directory} is not a committed datastates checkpoint ({why}); "
                              f"`megatron-ext inspect {root}` lists the committed ones")
    return Located(resolve_root(root), asked, manifest, kind_of(manifest))


def resolve_many(path: str, iteration: int | None = None, checkpoint: str | None = None) -> tuple[str, str | None]:
    """(root, name or None for all): what ``verify`` and ``inspect`` look at."""
    root, own = split(path)
    if own is not None:
        if iteration is not None or checkpoint is not None:
            other = name_of(root, iteration, checkpoint)
            if other != own:
                raise CheckpointError(f"{path} is checkpoint {own}, but --iteration/--checkpoint asks for {other}")
        return root, own
    if not _is_root(root):
        raise CheckpointError(f"{path} is not a directory")
    return root, name_of(root, iteration, checkpoint)


__all__ = ["DEEPSPEED", "ENGINE", "MEGATRON", "Located", "kind_of", "name_of", "newest", "resolve", "resolve_many",
           "split"]
