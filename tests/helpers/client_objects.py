"""A client-state object of a class that no allow-list names (what a user's own training script
might pass to DeepSpeed's ``save_checkpoint(client_state=...)``): it can only be stored pickled."""

from __future__ import annotations


class RunNote:
    """A plain user object; importable by the worker that saves it and the one that loads it."""

    def __init__(self, text: str, step: int):
        self.text, self.step = text, step

    def __eq__(self, other: object) -> bool:
        return type(other) is RunNote and (self.text, self.step) == (other.text, other.step)

    def __repr__(self) -> str:
        return f"RunNote({self.text!r}, {self.step})"
