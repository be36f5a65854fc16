"""``--enable-ft-package`` with ``--use-datastates``: the engine's waits end before the rank monitor's.

nvidia-resiliency-ext's rank monitor kills a rank whose current section (Megatron-LM opens
``setup``, ``step`` and ``checkpointing``; the rest is "out of section") stays open past its
timeout, and says only that a timeout elapsed. Every wait of the engine on the training thread
falls in known sections, so each is bounded at ``SHARE`` of the shortest of their timeouts: a
stalled flush or copy then ends in the engine's own error, which names the checkpoint, the file
and the rank, before the monitor's kill, and the rest of the share leaves the section time for
its other work.

========================================  =====================================  ==========================
wait (training thread)                    FT sections it falls in                bound
========================================  =====================================  ==========================
the lazy wait before the optimizer step   ``step``, out of section (warm-up)     ``snapshot_timeout_s``
a save call, the flush at the end         ``checkpointing``                      ``persist_timeout_s``
the load at start-up                      ``setup``                              ``persist_timeout_s``
========================================  =====================================  ==========================

At the first checkpoint call (the load at start-up, or the first save; FT's client starts inside
``pretrain``, after the arguments are validated) ``order_at_start_up`` lowers a timeout left at
its default to its bound, in one log line, and refuses one given above it. The monitor's
timeouts may shrink later (``--calc-ft-timeouts`` derives them from observed sections), so each
wait takes its bound again when it starts (``WaitBounds``). Our save call opens the
``checkpointing`` section as Megatron-LM's own save does, reported as an asynchronous save: its
milliseconds say nothing of the flush at the end, and a ``checkpointing`` timeout calculated from
them would kill that flush.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any, Callable, Iterator

from megatron_ext.engine.config import EngineConfig, flag_name
from megatron_ext.megatron.args import flag_destination

log = logging.getLogger("megatron_ext.megatron")

#: The part of an FT timeout an engine wait may take.
SHARE = 0.8

#: engine key -> the FT sections its waits fall in (``None``: out of section).
_WAITS = {"snapshot_timeout_s": ("step", None), "persist_timeout_s": ("checkpointing", "setup")}


def _ft_integration() -> Any:
    """Megatron-LM's ``ft_integration`` if its training loop imported it (its ``pretrain`` starts FT), else
    None: never imported here (other trainers have no ``megatron.training``, and this runs at every save)."""
    return sys.modules.get("megatron.training.ft_integration")


def monitor_client() -> Any:
    """Megatron-LM's rank monitor client, or None when FT is off or absent."""
    ft_integration = _ft_integration()
    return None if ft_integration is None else ft_integration.get_rank_monitor_client()


@dataclasses.dataclass(frozen=True)
class FtTimeouts:
    """The rank monitor's timeouts now, in seconds; a section without one (None) is never killed."""

    sections: dict[str, float | None]
    out_of_section: float | None

    @classmethod
    def of(cls, client: Any) -> "FtTimeouts | None":
        timeouts = getattr(client, "section_timeouts", None)
        if timeouts is None:
            return None
        return cls(dict(timeouts.section), timeouts.out_of_section)

    def bound(self, key: str) -> tuple[float, str] | None:
        """``SHARE`` of the shortest timeout among the sections ``key``'s waits fall in, with that section."""
        found = [(t, "out-of-section" if s is None else s)
                 for s in _WAITS[key]
                 for t in [self.out_of_section if s is None else self.sections.get(s)] if t is not None]
        if not found:
            return None
        timeout, section = min(found)
        return round(SHARE * timeout, 3), f"{section} {timeout:g} s"


def order_at_start_up(args: Any) -> list[str]:
    """``order_engine_timeouts`` with the rank monitor's timeouts, under ``--enable-ft-package``."""
    if not getattr(args, "enable_ft_package", False):
        return []
    ft = FtTimeouts.of(monitor_client())
    return [] if ft is None else order_engine_timeouts(args, ft)


def order_engine_timeouts(args: Any, ft: FtTimeouts) -> list[str]:
    """Lower the engine timeouts left at their defaults below ``ft``'s bounds; refuse those given above them.

    Returns the refusals. Sets the flags' attributes of ``args``, so the engine, its loads and the
    check that the configuration does not change mid-run all see the bounded values.
    """
    problems, lowered = [], []
    for key in _WAITS:
        bound = ft.bound(key)
        if bound is None:
            continue
        limit, section = bound
        flag, dest = flag_name(key), flag_destination(key)
        given = getattr(args, dest, None)
        if given is None:
            if getattr(EngineConfig, key) > limit:
                setattr(args, dest, limit)
                lowered.append(f"{flag} {limit:g}")
        elif given > limit:
            problems.append(f"{flag} {given:g} is longer than {SHARE:.0%} of nvidia-resiliency-ext's "
                            f"{section} timeout (at most {limit:g}): a stalled checkpoint would be killed "
                            f"by the rank monitor before the engine's error names it; lower {flag} or raise that "
                            "FT timeout")
    if lowered and _rank() == 0:  # every rank's monitor has the launcher's timeouts
        timeouts = [*ft.sections.items(), ("out-of-section", ft.out_of_section)]
        log.warning("[datastates] fault tolerance: %s (%.0f%% of the rank monitor's timeouts %s), so an engine wait "
                    "ends in its own error first", ", ".join(lowered), 100 * SHARE,
                    ", ".join(f"{s} {t:g} s" for s, t in timeouts if t is not None))
    return problems


class WaitBounds:
    """The timeouts of the engine's waits on the training thread, taken again at each wait.

    Without FT these are the engine's own. With it, a timeout the monitor shortened since the
    start (``--calc-ft-timeouts``) bounds the wait too, with one log line when it first does.
    """

    def __init__(self, config: EngineConfig, timeouts: Callable[[], FtTimeouts | None] | None = None) -> None:
        self.config = config
        self._timeouts = timeouts or (lambda: FtTimeouts.of(monitor_client()))
        self._noticed: dict[str, float] = {}

    def timeout(self, key: str) -> float:
        own = getattr(self.config, key)
        ft = self._timeouts()
        bound = None if ft is None else ft.bound(key)
        if bound is None or bound[0] >= own:
            return own
        limit, section = bound
        if self._noticed.get(key) != limit:
            self._noticed[key] = limit
            log.warning("[datastates] fault tolerance: the rank monitor's %s timeout is now shorter than %s %g: "
                        "this wait ends after %g s", section, flag_name(key), own, limit)
        return limit

    def snapshot(self) -> float:
        return self.timeout("snapshot_timeout_s")

    def persist(self) -> float:
        return self.timeout("persist_timeout_s")


@contextlib.contextmanager
def checkpointing_section(args: Any) -> Iterator[None]:
    """Megatron-LM's ``checkpointing`` section around our save call, as around its own save (a no-op without
    FT, and under ``--ckpt-convert-format``, whose save is Megatron-LM's own and opens the section itself)."""
    if monitor_client() is None or getattr(args, "ckpt_convert_format", None) is not None:
        yield
        return
    ft_integration = _ft_integration()
    # An asynchronous save for FT's timeout calculation (Megatron-LM sets this for --async-save).
    ft_integration._is_async_chkpt_enabled = True
    ft_integration.on_checkpointing_start()
    yield  # a save that raises leaves the section open, as Megatron-LM's does: the run ends with its error
    ft_integration.on_checkpointing_end(is_async_finalization=False)


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

