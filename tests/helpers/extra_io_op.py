"""An operation added the way a new one would be: a request class and a row in
``io_ops.OPERATIONS``, nothing else. Importing this module adds it; the worker process imports it
when it unpickles the first such request, so the row exists on both sides of the pipe."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import ClassVar

from megatron_ext.engine.save.flow.io_ops import OPERATIONS, FileIo


@dataclasses.dataclass(frozen=True)
class WhereRequest:
    """Ask whoever runs the operations which process it is, and read one byte of the cache."""

    op: ClassVar[str] = "test_where"
    cache: int


@dataclasses.dataclass(frozen=True)
class WhereReply:
    pid: int
    cache_byte: int
    torch_imported: bool


def _where(io: FileIo, request: WhereRequest) -> WhereReply:
    return WhereReply(os.getpid(), io.buffer[request.cache], "torch" in sys.modules)


OPERATIONS[WhereRequest.op] = _where


@dataclasses.dataclass(frozen=True)
class UnknownRequest:
    """A request no row of the table answers."""

    op: ClassVar[str] = "not_an_operation"
