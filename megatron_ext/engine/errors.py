"""The engine's error types, in one module so that the read side and the adapters import them
without importing the save pipeline."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be taken, persisted, committed or loaded."""


class CheckpointSkipped(CheckpointError):
    """A rank skipped this checkpoint under ``overload_policy="supersede"``: abandon it, not an error."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report  # the skip report that rank wrote


class ConfigError(ValueError):
    """A bad engine configuration, reported before any checkpoint is taken."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds a pickle, or a class the loader does not allow; nothing was run.

    ``file``, ``place`` (the path inside the state), ``classes`` (the class names involved) and
    ``pickled`` let an adapter restate the refusal in its own configuration's terms.
    """

    def __init__(self, message: str, *, file: str = "", place: str = "", classes: tuple[str, ...] = (),
                 pickled: bool = False):
        super().__init__(message)
        self.file, self.place, self.classes, self.pickled = file, place, tuple(classes), pickled


class EncodeError(TypeError):
    """A value of the state cannot be stored safely."""


class CacheError(RuntimeError):
    """The host cache could not be allocated or a slot was not freed in time."""
