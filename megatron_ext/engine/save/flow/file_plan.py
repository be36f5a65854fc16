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


#: The tensor classes a plan may be reused for: their metadata is the tensor's own (a subclass's
#: ``__torch_function__`` could answer for it; the signature below reads it without any).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tensor_signatures(tensors: list[tuple[str, torch.Tensor]]) -> tuple[tuple, ...] | None:
    """Each tensor's memory and layout (data pointer, shape, strides, dtype, device), or None when a
    plan of these tensors may not be reused: a tensor of another class than ``_PLAIN``, not dense, or
    with a lazy conjugate or negative bit (its file holds a resolved copy, made at the save).

    Read with torch's Python overrides off (``DisableTorchFunction``): these are the tensor's own
    fields, and a function mode (the CPU emulation of tests) would otherwise cost a Python call each.
    """
    for _, t in tensors:
        if type(t) not in _PLAIN:
            return None
    with torch._C.DisableTorchFunction():
        for _, t in tensors:
            if t.layout is not torch.strided or t.is_conj() or t.is_neg():
                return None
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for _, t in tensors)


@dataclasses.dataclass(eq=False)
class ReusablePlan:
    """What a save of the same tensors again reuses (``CheckpointEngine.save(reuse=True)``): the
    detached tensors, their byte views and the file's layout but its metadata.

    The layout is reused when the new state's tensors have the same names, in the same order, with
    the same shapes and dtypes; each tensor's view when its ``tensor_signatures`` entry is the same
    too (the same memory, strides and device), so the view kept here reads exactly the bytes the
    new tensor holds (it keeps that memory alive: no other allocation can take its address). A
    tensor in new memory (a fresh RNG state, another object) gets a new view; anything else plans
    the file afresh.
    """

    names: tuple[str, ...]  # in the state's order
    signatures: tuple[tuple, ...]
    tensors: list[torch.Tensor]  # prepared (detached), in the state's order
    body: tensor_file.BodyPlan
    sources: list[torch.Tensor]  # what each tensor is copied from (``byte_source``), in file order
    frozen: dict = dataclasses.field(default_factory=dict)  # the ``codec.Frozen`` values' encodings (``Encoder.frozen``)

    def renew(self, tensors: list[tuple[str, torch.Tensor]],
              signatures: tuple[tuple, ...] | None) -> tuple["ReusablePlan", int] | None:
        """This plan for ``tensors`` (their signatures), with a new view of each tensor whose memory
        moved, and how many did; None if the layout differs."""
        old = self.signatures
        if signatures is None or len(tensors) != len(self.names) or tuple(n for n, _ in tensors) != self.names:
            return None
        if signatures == old:
            return self, 0
        changed = [i for i, (new, was) in enumerate(zip(signatures, old)) if new != was]
        if any(signatures[i][1] != old[i][1] or signatures[i][3] != old[i][3] for i in changed):
            return None  # a shape or dtype: another layout
        prepared, sources = list(self.tensors), list(self.sources)
        position = self.body.position
        for i in changed:
            name, tensor = tensors[i]
            prepared[i] = codec.prepare_tensor(name, tensor)
            sources[position[i]] = byte_source(prepared[i])
        return ReusablePlan(self.names, signatures, prepared, self.body, sources, self.frozen), len(changed)


@dataclasses.dataclass(eq=False)
class PlannedFile:
    """One saved state, encoded: its sidecar, its tensors and the layout of its tensor file."""

    checkpoint: str
    name: str
    tag: str
    sidecar: bytes
    tensors: list[torch.Tensor]
    layout: tensor_file.FileLayout
    plan: ReusablePlan | None = None  # for the next save of the same tensors (with ``reusable``)
    reused: bool = False  # whether ``previous``'s layout was reused
    renewed: int = 0  # tensors of it given a new view (their memory moved)

    @classmethod
    def encode(cls, state: Any, checkpoint: str, name: str, rank: int, tag: str, *, pickle_fallback: Any,
               classes: Any, previous: ReusablePlan | None = None, reusable: bool = False) -> "PlannedFile":
        """Non-tensor values are encoded now, so later changes to them do not reach the checkpoint.

        ``previous``: the plan of an earlier save of this file, reused if the tensors match it
        (``ReusablePlan.renew``); ``reusable``: keep this save's plan (``plan``) for the next one.
        """
        encoder = codec.Encoder(pickle_fallback=pickle_fallback, classes=classes, prepare=False,
                                memo=previous.frozen if previous is not None else None)
        skeleton = encoder.encode(state)
        sidecar = encoder.dumps({"format": "megatron_ext.state", "state": skeleton}).encode("utf-8")
        raw = encoder.tensors
        # A sidecar no loader would read (too large, too many values) is refused now, not at load.
        check_sidecar_volume(sidecar, len(raw), f"checkpoint {checkpoint}, file {name!r}")
        metadata = {"checkpoint": checkpoint, "name": name, "rank": str(rank), "run_id": tag}
        signatures = tensor_signatures(raw) if previous is not None or reusable else None
        renewed = previous.renew(raw, signatures) if previous is not None else None
        if renewed is not None:
            plan, count = renewed
            plan = dataclasses.replace(plan, frozen=encoder.frozen) if reusable else None
            return cls(checkpoint, name, tag, sidecar, renewed[0].tensors,
                       renewed[0].body.layout(metadata, renewed[0].sources), plan, reused=True, renewed=count)
        tensors = [(n, codec.prepare_tensor(n, t)) for n, t in raw]
        body = tensor_file.plan_body(tensors)
        sources = [byte_source(tensors[i][1]) for i in body.order]  # torch calls here, not on the copy thread
        prepared = [t for _, t in tensors]
        plan = (ReusablePlan(tuple(n for n, _ in raw), signatures, prepared, body, sources, encoder.frozen)
                if reusable and signatures is not None else None)
        return cls(checkpoint, name, tag, sidecar, prepared, body.layout(metadata, sources), plan)

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


__all__ = ["PlannedFile", "ReusablePlan", "check_names", "tensor_signatures"]
