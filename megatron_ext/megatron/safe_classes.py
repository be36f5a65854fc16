"""The classes a Megatron checkpoint's sidecar may hold beyond plain values (the codec's allow-list).

Found by parsing a real Megatron-LM argument set at the pin (core_v0.19.0, a GPT command line
with ``--bf16`` and the distributed optimizer, after ``validate_args``): its values are plain
Python values, ``torch.dtype``s and three enums, ``AttnBackend``, ``InferenceCudaGraphScope``
and ``signal.Signals``. The rerun state machine's state (``Call``, ``Caller``, ``RerunState``,
``RerunMode``, and the error injector's ``RerunDiagnostic``) was found by running Megatron-LM's
loop into a NaN that it asks to checkpoint. Any other
class in ``args`` (a newer Megatron-LM's) is stored as its ``repr`` (``checkpoint_layout.storable_args``), never
refused; any other class elsewhere in the state is refused at the first save, naming it.
"""

from __future__ import annotations

import functools
import importlib

MEGATRON_SAFE_CLASSES = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "signal.Signals",
    # The rerun state machine's state (saved when it asks for a checkpoint, e.g. after a NaN).
    "megatron.core.rerun_state_machine.Call",
    "megatron.core.rerun_state_machine.Caller",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunDiagnostic",  # the error injector's setting, in a real rerun state
)


@functools.lru_cache(maxsize=1)
def megatron_safe_classes() -> tuple[str, ...]:
    """The names of ``MEGATRON_SAFE_CLASSES`` that this installation defines."""
    present = []
    for name in MEGATRON_SAFE_CLASSES:
        module, _, attr = name.rpartition(".")
        try:
            if isinstance(getattr(importlib.import_module(module), attr, None), type):
                present.append(name)
        except ImportError:
            pass
    return tuple(present)


@functools.lru_cache(maxsize=1)
def megatron_classes() -> dict:
    """``megatron_safe_classes()`` as the codec's ``(module, qualname) -> class`` mapping."""
    from megatron_ext.engine.format.codec import resolve_class_names

    return resolve_class_names(megatron_safe_classes())
