"""What ``save`` does on the caller's thread before anything runs in the background: the names
checked, the state encoded (its sidecar) and the tensor file laid out, so that everything that
can refuse a state refuses it before its checkpoint is registered."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from ...format import codec
from ...format import tensor_file
from ...format.names import valid_name
from ...format.sidecar import check_sidecar_volume
from ..job.jobs import CheckpointJob, FileJob
from .copier import CpuCopier, byte_source


def check_names(checkpoint: str, name: str) -> None:
    """A checkpoint id and a file name become path components: refuse anything else before any I/O."""
    if not valid_name(name) or len(name) > 200:
        raise ValueError(f"file name {name!r} must be non-empty, at most 200 characters, without '/', "
                         "not starting with '.'")
    if not valid_name(checkpoint):
        raise ValueError(f"checkpoint id {checkpoint!r} must be one non-hidden directory name")


@dataclasses.dataclass(eq=False)
class PlannedFile:
    """One saved state, encoded: its sidecar, its tensors and the layout of its tensor file."""

    checkpoint: str
    name: str
    tag: str
    sidecar: bytes
    tensors: list[torch.Tensor]
    layout: tensor_file.FileLayout

    @classmethod
    def encode(cls, state: Any, checkpoint: str, name: str, rank: int, tag: str, *, pickle_fallback: Any,
               classes: Any) -> "PlannedFile":
        """Non-tensor values are encoded now, so later changes to them do not reach the checkpoint."""
        encoder = codec.Encoder(pickle_fallback=pickle_fallback, classes=classes)
        skeleton = encoder.encode(state)
        sidecar = json.dumps({"format": "megatron_ext.state", "state": skeleton}, separators=(",", ":")).encode("utf-8")
        # A sidecar no loader would read (too large, too many values) is refused now, not at load.
        check_sidecar_volume(sidecar, len(encoder.tensors), f"checkpoint {checkpoint}, file {name!r}")
        layout = tensor_file.plan(encoder.tensors, {"checkpoint": checkpoint, "name": name, "rank": str(rank),
                                                    "run_id": tag})
        for span in layout.spans:  # torch calls here, not on the copy thread (copier.py)
            span.tensor = byte_source(span.tensor)
        return cls(checkpoint, name, tag, sidecar, [t for _, t in encoder.tensors], layout)

    def file_job(self, job: CheckpointJob, copier: CpuCopier, gate: Any = None, extra: dict | None = None) -> FileJob:
        """The file's record under ``job``; its copies follow the copier's stream from now (or, with a
        ``gate``, from when the gate opens)."""
        base = f"{self.checkpoint}/{self.name}.{self.tag}"
        tensors = self.tensors
        fjob = FileJob(job=job, name=self.name, layout=self.layout, sidecar=self.sidecar,
                       cuda_mark=copier.mark(tensors) if gate is None else None,
                       tensor_rel=base + ".safetensors", sidecar_rel=base + ".state.json",
                       extra=json.loads(json.dumps(extra)) if extra is not None else None, gate=gate)
        if gate is not None:
            gate.bind(lambda: fjob.gate_opened(copier.mark(tensors)))
        return fjob


__all__ = ["PlannedFile", "check_names"]
