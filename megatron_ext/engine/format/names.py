"""Names of the on-disk format: the files a checkpoint holds, the storage levels, and which
checkpoint and run names are acceptable. Shared by the save and the read side."""

from __future__ import annotations

import re
from typing import Any

#: The commit marker and index of a checkpoint (format.manifest).


MANIFEST = "manifest.json"


FORMAT_NAME = "megatron_ext.datastates"


#: Rank reports (each rank's tensor index in format 2) live in ``<checkpoint>/.reports``.
REPORTS = ".reports"


#: Run ids: 12 lowercase hex digits (rank 0 draws them); they appear in every file name.
RUN_ID = re.compile(r"[0-9a-f]{12}")
#: A data file of one attempt at a checkpoint: ``<name>.<tag>.safetensors`` / ``.state.json``
#: (group 1: the tag, the run id or an attempt's tag). What clean-ups may remove, and nothing else.
RUN_FILE = re.compile(r"\.([0-9a-f]{12})\.(safetensors|state\.json)$")


def valid_name(name: Any) -> bool:
    """A single path component the engine may create: not empty, no '/', not hidden, no NUL, UTF-8."""
    if type(name) is not str:
        return False
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # an unpaired surrogate would become arbitrary bytes in the file name
        return False
    return 0 < size <= 255 and "/" not in name and "\0" not in name and not name.startswith(".")


#: What ends the name of a failure report and of a skip report in ``.reports`` (beside the rank reports).
ERROR_REPORT_SUFFIX = ".error.json"
SKIP_REPORT_SUFFIX = ".skipped.json"


def report_name(rank: int, run_id: str, error: bool = False) -> str:
    """A rank report's file name (``ERROR_REPORT_SUFFIX`` for a failure report)."""
    return f"rank-{rank:05d}.{run_id}{ERROR_REPORT_SUFFIX if error else '.json'}"


def skip_report_name(rank: int, run_id: str) -> str:
    """The skip report a rank that skipped a checkpoint leaves in its ``.reports`` (for ``inspect``)."""
    return f"rank-{rank:05d}.{run_id}{SKIP_REPORT_SUFFIX}"


LEVEL_HOST = "host"


LEVEL_LOCAL = "local"


LEVEL_SHARED = "shared"


LEVEL_PEER = "peer"  # a replica in another node's host memory (replica.py)
