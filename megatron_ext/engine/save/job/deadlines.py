"""One source per timeout: when two bounded waits cover the same work, one of them decides.

The training thread waits for work a background stage does (a copy, a commit, a replication),
and that stage often waits itself, bounded, for something else (a cache slot, the other ranks'
reports, rank 0's decision, a peer). Two clocks of about the same length started at different
moments race, and whichever fires first decides what the user reads: "did not finish in time",
or the stage's "missing ranks: 3". On a cluster that message is the clue to which node hung, so
it must not depend on timing.

The rule: the stage that waits for the missing thing owns the deadline and names what is
missing. While it holds a deadline (``StageDeadline.hold``), a wait on the training thread that
runs out keeps waiting until the stage's deadline plus ``MARGIN_S`` (``ends``); the stage's
error, which says who or what is missing, settles the work first. Only if the stage itself is
stuck past its own deadline does the training thread raise, with the stage's description of
what it waits for. The margin covers what the stage does after its wait ends (publish a
decision, settle the job). Each stage holds finitely many bounded deadlines per piece of work, so
every wait stays bounded. Where the two clocks are different settings, the one due first decides
and only a near tie is handed to the stage (``ends_on_tie``).
"""

from __future__ import annotations

import time
from typing import Callable

#: How long past a stage's own deadline a training-thread wait keeps waiting for the stage's verdict.
MARGIN_S = 10.0


class StageDeadline:
    """The deadline of the bounded wait a background stage is in for one piece of work, and what for.

    Written by the stage's thread, read by waiters on others: one attribute holds both values, so
    a reader never sees a deadline with another wait's description.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[float, Callable[[], str]] | None = None

    def hold(self, seconds: float, waiting_for: Callable[[], str]) -> object:
        """The stage starts a wait bounded by ``seconds``; ``waiting_for()`` says for what (for messages).

        Returns a token for ``release``: two stages may hold one deadline in turn (the writer and
        the stager of one checkpoint), and neither clears the other's.
        """
        held = self._held = (time.monotonic() + seconds, waiting_for)
        return held

    def release(self, token: object = None) -> None:
        """The wait is over (``token``: only if this is still the hold that returned it)."""
        if token is None or self._held is token:
            self._held = None

    def ends(self, deadline: float) -> float:
        """When a waiter whose own deadline is ``deadline`` may give up: after the stage's deadline too."""
        held = self._held
        return deadline if held is None else max(deadline, held[0] + MARGIN_S)

    def ends_on_tie(self, deadline: float) -> float:
        """Like ``ends``, but only when the stage's deadline falls within ``MARGIN_S`` of ``deadline``.

        For a stage whose clock is a different setting from the waiter's (a copy's wait for cache
        space runs on ``persist_timeout_s``, ``wait_snapshot`` on ``snapshot_timeout_s``): the clock
        due first decides, and a near tie, which timing alone would settle, goes to the stage.
        """
        held = self._held
        return deadline if held is None or held[0] > deadline + MARGIN_S else max(deadline, held[0] + MARGIN_S)

    def describe(self) -> str:
        """What the stage is waiting for, or "" when it holds no deadline."""
        held = self._held
        if held is None:
            return ""
        try:
            return held[1]()
        except Exception as exc:  # only a message: never fail on it
            return f"(unknown: {type(exc).__name__})"


__all__ = ["MARGIN_S", "StageDeadline"]
