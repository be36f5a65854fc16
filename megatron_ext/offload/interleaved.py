"""The interleaved step: Adam/AdamW or SGD over host-resident state, some subgroups on the GPU, the rest on the CPU.

Both sides run torch's own functional update (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``)
with the flags of the parameter group (fused, foreach, decoupled weight decay, AMSGrad, momentum,
Nesterov...), on the same fp32 values, so on a CPU-only machine the result is bit-identical to
``torch.optim.Adam``/``AdamW``/``SGD`` stepping the whole tensors, whatever the split. One step
(``InterleavedUpdate.step``):

1. The d2h lane waits for the gradients, then copies those of CPU subgroups to host fp32 buffers.
2. The h2d lane prefetches the first two GPU subgroups' master and state (Adam's moments, SGD's
   momentum buffer) into the two staging buffers.
3. For each GPU subgroup ``j`` (buffer ``j % 2``): compute waits for its prefetch, updates it in
   the staging buffer with the device gradient (cast to fp32 as the host copy would be), writes the
   updated master into the model's weight; the d2h lane waits for that and writes master and
   moments back to the host; the h2d lane waits for that write-back before prefetching subgroup
   ``j + 2`` into the same buffer. Meanwhile the host updates its share of CPU subgroups (after the
   gradients of step 1 have arrived) and queues their updated weights on the h2d lane.
4. Compute waits for the last h2d copy (the next forward sees every weight), the host waits for
   the last write-back (the host state is complete: a checkpoint or the next step may read it),
   and each tensor's Adam step count goes up by one.

The caller clips the gradients before ``step``: nothing is updated before the norm is known.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.sgd import sgd as functional_sgd

from megatron_ext.offload.perf_model import PerfModel, Shape, measure
from megatron_ext.offload.subgroups import Subgroup, capacity, partition, spread, strided

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class StateSlot:
    """One tensor the optimizer updates: fp32 master and state on the host, gradient (and the
    model's weight the master is copied to, if any) on the device; ``group`` is its param group."""

    master: torch.Tensor
    grad: torch.Tensor
    state: dict
    group: dict
    weight: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTimes:
    """One step's wall time, and how much of it (and how many elements) the CPU updates took."""

    seconds: float
    cpu_seconds: float
    cpu_elements: int
    gpu_elements: int


def is_sgd(group: dict) -> bool:
    return "momentum" in group and "betas" not in group


def state_keys(group: dict) -> tuple[str, ...]:
    """The state tensors the update reads and writes (staged to the GPU and written back)."""
    if is_sgd(group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    return (*MOMENTS, "max_exp_avg_sq") if group.get("amsgrad") else MOMENTS


def init_state(master: torch.Tensor, group: dict, pin: bool) -> dict:
    """A fresh state, as torch's optimizer creates it (Adam's step on the master's device when fused;
    SGD's momentum buffer is allocated here and filled from the first gradient by ``update``)."""
    if is_sgd(group):
        return {key: torch.zeros(master.shape, dtype=master.dtype, pin_memory=pin) for key in state_keys(group)}
    fused_or_capturable = bool(group.get("fused")) or bool(group.get("capturable"))
    step = (torch.zeros((), dtype=torch.float32, device=master.device) if fused_or_capturable
            else torch.tensor(0.0, dtype=torch.float32))
    state = {"step": step}
    for key in state_keys(group):
        state[key] = torch.zeros(master.shape, dtype=master.dtype, pin_memory=pin)
    return state


def adam_update(params, grads, states: list[dict], steps: list[torch.Tensor], group: dict) -> None:
    """torch's functional Adam with the group's flags; ``steps`` are throw-away copies it increments."""
    beta1, beta2 = group["betas"]
    amsgrad = bool(group.get("amsgrad", False))
    functional_adam(
        params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
        [s["max_exp_avg_sq"] for s in states] if amsgrad else [], steps,
        foreach=group.get("foreach"), capturable=bool(group.get("capturable", False)),
        differentiable=False, fused=group.get("fused"), grad_scale=None, found_inf=None, has_complex=False,
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=bool(group.get("maximize", False)))


def sgd_update(params, grads, states: list[dict], group: dict, fresh: bool) -> None:
    """torch's functional SGD with the group's flags; on a ``fresh`` state the buffer torch creates from
    the first gradient is copied into the (pre-allocated, possibly staged) ``momentum_buffer``."""
    with_momentum = group["momentum"] != 0
    buffers = [None if fresh or not with_momentum else s["momentum_buffer"] for s in states]
    functional_sgd(params, grads, buffers, has_sparse_grad=False, foreach=group.get("foreach"),
                   fused=group.get("fused"), grad_scale=None, found_inf=None, weight_decay=group["weight_decay"],
                   momentum=group["momentum"], lr=group["lr"], dampening=group.get("dampening", 0),
                   nesterov=bool(group.get("nesterov", False)), maximize=bool(group.get("maximize", False)))
    if with_momentum and fresh:
        for s, buffer in zip(states, buffers):
            s["momentum_buffer"].copy_(buffer)


def update(params, grads, states: list[dict], steps: list, group: dict, fresh: bool) -> None:
    """One piece's update by the group's optimizer (``steps``: Adam's throw-away step copies)."""
    if is_sgd(group):
        sgd_update(params, grads, states, group, fresh)
    else:
        adam_update(params, grads, states, steps, group)


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("the interleaved optimizer updates contiguous tensors only")
    return t.view(-1)


@dataclass
class _Staging:
    """Two device buffers per state kind, ``capacity`` elements each."""

    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    numel: int = 0


class InterleavedUpdate:
    """Runs the interleaved step over ``StateSlot``s cut into subgroups of ``subgroup_numel``."""

    def __init__(self, streams, subgroup_numel: int):
        self.streams = streams
        self.device = streams.device
        self.subgroup_numel = subgroup_numel
        self.pin = self.device.type == "cuda"
        self._layout: tuple[int, ...] = ()
        self.subgroups: list[Subgroup] = []
        self._host_grads: list[torch.Tensor] = []
        self._staging = _Staging()

    def plan(self, numels: list[int]) -> list[Subgroup]:
        """The subgroups of tensors of these sizes (kept while the sizes stay the same)."""
        if tuple(numels) != self._layout:
            self._layout = tuple(numels)
            self.subgroups = partition(list(numels), self.subgroup_numel)
            self._host_grads = [torch.empty(n, dtype=torch.float32, pin_memory=self.pin) for n in numels]
        return self.subgroups

    def _stage(self, keys: tuple[str, ...], numel: int) -> list[dict[str, torch.Tensor]]:
        staging = self._staging
        if staging.numel < numel or not staging.buffers or set(staging.buffers[0]) != {"master", *keys}:
            staging.buffers = [{key: torch.empty(numel, dtype=torch.float32, device=self.device)
                                for key in ("master", *keys)} for _ in range(2)]
            staging.numel = numel
        return staging.buffers

    def _staging_for(self, gpu: list[Subgroup], keys: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        """The double buffer, sized for the largest GPU subgroup (none when no subgroup is on the GPU)."""
        return self._stage(keys, capacity(gpu)) if gpu else []

    def step(self, slots: list[StateSlot], on_gpu: frozenset[int]) -> StepTimes:
        """One interleaved step over ``slots``, the subgroups in ``on_gpu`` updated on the device."""
        start = time.perf_counter()
        run = self._begin(slots, on_gpu)
        run.grads_to_host()                                       # 1.
        run.prefetch_first(self._staging_for(run.gpu, run.keys))  # 2.
        run.interleave()                                          # 3.
        run.finish()                                              # 4.
        return run.times(time.perf_counter() - start)

    def _begin(self, slots: list[StateSlot], on_gpu: frozenset[int]) -> _StepRun:
        """The step's shared state: subgroups split, state created where missing, step counts copied
        (before this step's increment, which comes only once every piece is updated)."""
        subgroups = self.plan([slot.master.numel() for slot in slots])
        keys = state_keys(slots[0].group) if slots else MOMENTS
        if any(state_keys(slot.group) != keys for slot in slots):
            raise ValueError("the interleaved optimizer needs one optimizer, AMSGrad and momentum on or off, "
                             "for every group")
        fresh = [any(key not in slot.state for key in keys) for slot in slots]  # SGD: buffer from the gradient
        for slot in slots:
            if any(key not in slot.state for key in keys) or not slot.state:
                slot.state.update(init_state(slot.master, slot.group, self.pin))
        steps = [slot.state["step"].clone() if "step" in slot.state else None for slot in slots]
        gpu = [sg for sg in subgroups if sg.index in on_gpu]
        cpu = [sg for sg in subgroups if sg.index not in on_gpu]
        return _StepRun(self.streams, self.device, slots, keys, self._host_grads, fresh, steps, gpu, cpu,
                        self._device_steps(slots, steps, gpu))

    def _device_steps(self, slots: list[StateSlot], steps: list, gpu: list[Subgroup]) -> dict:
        """Fused and capturable Adam keep the step count with the tensors: copied to the device once,
        now, since a blocking copy later would wait for the GPU updates already queued."""
        return {p.tensor: steps[p.tensor].to(self.device) for sg in gpu for p in sg.pieces
                if steps[p.tensor] is not None
                and (slots[p.tensor].group.get("fused") or slots[p.tensor].group.get("capturable"))}


@dataclass
class _StepRun:
    """One call of ``InterleavedUpdate.step``: what its phases share (the double buffer's ready/freed
    events, the CPU subgroups still to update, the CPU time), one method per phase of the module
    docstring, each issuing its copies, waits and records on the lanes and in the order it gives."""

    lanes: object
    device: torch.device
    slots: list[StateSlot]
    keys: tuple[str, ...]
    host_grads: list[torch.Tensor]
    fresh: list[bool]
    steps: list
    gpu: list[Subgroup]
    cpu: list[Subgroup]
    device_steps: dict
    staging: list[dict[str, torch.Tensor]] = field(default_factory=list)
    ready: list = field(default_factory=lambda: [None, None])
    freed: list = field(default_factory=lambda: [None, None])
    grads_on_host: object = None
    grads_waited: bool = False
    cpu_seconds: float = 0.0
    cpu_elements: int = 0
    cpu_queue: list[Subgroup] = field(init=False)  # the CPU subgroups not updated yet

    def __post_init__(self) -> None:
        self.cpu_queue = list(self.cpu)

    def _step_copy(self, i: int, on_device: bool) -> list[torch.Tensor]:
        """A throw-away copy of tensor ``i``'s step count for Adam to increment (SGD: none)."""
        source = self.device_steps.get(i, self.steps[i]) if on_device else self.steps[i]
        return [source.clone()] if source is not None else []

    def _staged(self, sg: Subgroup):
        """``(piece, slot, lo, hi)`` for each piece of ``sg``: ``lo:hi`` is its range in a staging buffer."""
        offset = 0
        for p in sg.pieces:
            yield p, self.slots[p.tensor], offset, offset + p.numel
            offset += p.numel

    def grads_to_host(self) -> None:
        """Phase 1: once the gradients are computed, the CPU subgroups' gradients to the host."""
        s = self.lanes
        s.wait_compute("d2h")
        for sg in self.cpu:
            for p in sg.pieces:
                s.copy("d2h", self.host_grads[p.tensor][p.start:p.stop],
                       _flat(self.slots[p.tensor].grad)[p.start:p.stop])
        self.grads_on_host = s.record("d2h", "grads_to_host")

    def prefetch_first(self, staging: list[dict[str, torch.Tensor]]) -> None:
        """Phase 2: the first two GPU subgroups into the double buffer ``staging``."""
        self.staging = staging
        self.lanes.wait_compute("h2d")
        for j in range(min(2, len(self.gpu))):
            self._prefetch(j)

    def _prefetch(self, j: int) -> None:
        """GPU subgroup ``j``'s master and state into buffer ``j % 2``, once its last user wrote it back."""
        s, b = self.lanes, j % 2
        if self.freed[b] is not None:
            s.wait("h2d", self.freed[b])
        for p, slot, lo, hi in self._staged(self.gpu[j]):
            s.copy("h2d", self.staging[b]["master"][lo:hi], _flat(slot.master)[p.start:p.stop])
            for key in self.keys:
                s.copy("h2d", self.staging[b][key][lo:hi], _flat(slot.state[key])[p.start:p.stop])
        self.ready[b] = s.record("h2d", "prefetch")

    def interleave(self) -> None:
        """Phase 3: each GPU subgroup updated and written back, the next-but-one prefetched into its
        buffer, and a share of the CPU subgroups updated meanwhile; then the CPU subgroups left."""
        share = math.ceil(len(self.cpu) / (len(self.gpu) + 1)) if self.gpu else len(self.cpu)
        for j in range(len(self.gpu)):
            self._update_on_gpu(j)
            self._write_back(j)
            if j + 2 < len(self.gpu):
                self._prefetch(j + 2)
            self._update_on_cpu(share)
        self._update_on_cpu(len(self.cpu_queue))

    def _update_on_gpu(self, j: int) -> None:
        """GPU subgroup ``j`` updated in its buffer (after its prefetch), its masters copied to the weights."""
        s, b = self.lanes, j % 2
        s.wait("compute", self.ready[b])
        for p, slot, lo, hi in self._staged(self.gpu[j]):
            view = {key: self.staging[b][key][lo:hi] for key in self.keys}
            master = self.staging[b]["master"][lo:hi]
            grad = _flat(slot.grad)[p.start:p.stop].to(device=self.device, dtype=torch.float32)
            update([master], [grad], [view], self._step_copy(p.tensor, True), slot.group, self.fresh[p.tensor])
            if slot.weight is not None:
                s.copy("compute", _flat(slot.weight)[p.start:p.stop], master)

    def _write_back(self, j: int) -> None:
        """GPU subgroup ``j``'s master and state back to the host once updated; its buffer is then free."""
        s, b = self.lanes, j % 2
        s.wait("d2h", s.record("compute", "updated"))
        for p, slot, lo, hi in self._staged(self.gpu[j]):
            s.copy("d2h", _flat(slot.master)[p.start:p.stop], self.staging[b]["master"][lo:hi])
            for key in self.keys:
                s.copy("d2h", _flat(slot.state[key])[p.start:p.stop], self.staging[b][key][lo:hi])
        self.freed[b] = s.record("d2h", "buffer_free")

    def _update_on_cpu(self, count: int) -> None:
        """The next ``count`` CPU subgroups updated on the host (the first after its gradients arrived)."""
        for _ in range(min(count, len(self.cpu_queue))):
            if not self.grads_waited:
                self.lanes.host_wait(self.grads_on_host)
                self.grads_waited = True
            sg = self.cpu_queue.pop(0)
            began = time.perf_counter()
            self._update_cpu_subgroup(sg)
            self.cpu_seconds += time.perf_counter() - began
            self.cpu_elements += sg.numel

    def _update_cpu_subgroup(self, sg: Subgroup) -> None:
        """``sg`` updated in place on the host, its updated masters queued to the weights on ``h2d``."""
        for p in sg.pieces:
            slot = self.slots[p.tensor]
            view = {key: _flat(slot.state[key])[p.start:p.stop] for key in self.keys}
            master = _flat(slot.master)[p.start:p.stop]
            update([master], [self.host_grads[p.tensor][p.start:p.stop]], [view],
                   self._step_copy(p.tensor, False), slot.group, self.fresh[p.tensor])
            if slot.weight is not None:
                self.lanes.copy("h2d", _flat(slot.weight)[p.start:p.stop], master)

    def finish(self) -> None:
        """Phase 4: weights ordered before the next forward; host state complete; step counts."""
        s = self.lanes
        weights_sent = s.record("h2d", "weights_to_device")
        s.wait("compute", weights_sent)
        s.host_wait(weights_sent)  # the next step's CPU updates rewrite the masters these copies read
        s.host_wait(s.record("d2h", "write_back"))  # a checkpoint or the next step may read the host state
        if hasattr(s, "reset"):
            s.reset()
        for slot in self.slots:
            if "step" in slot.state:
                slot.state["step"] += 1

    def times(self, seconds: float) -> StepTimes:
        return StepTimes(seconds, self.cpu_seconds, self.cpu_elements, sum(sg.numel for sg in self.gpu))


def update_probe(group: dict):
    """``measure``'s update probe: one subgroup of ``n`` elements updated with ``group``'s flags on ``device``."""
    def make(n: int, device: torch.device):
        master = torch.zeros(n, device=device)
        grad = torch.full((n,), 1e-3, device=device)
        state = {key: torch.zeros(n, device=device) for key in state_keys(group)}
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        step = torch.zeros((), device=device if on_device else "cpu")
        return lambda: update([master], [grad], [state], [step.clone()], group, fresh=False)
    return make


@dataclass(frozen=True)
class StepRecord:
    """What one step chose and how long it took: logged, and kept by benchmarks."""

    gpu_subgroups: int
    subgroups: int
    predicted_seconds: float | None
    measured_seconds: float
    cpu_seconds: float


class InterleavedOffload:
    """The interleaved step with its split: the performance model's (``policy="model"``), every
    ``stride``-th subgroup (``policy=("stride", s)``) or the first ``fraction`` of subgroups
    (``policy=("fraction", f)``, a static split). The model's rates are measured on the first step."""

    def __init__(self, streams, subgroup_numel: int, policy="model", rates=None, log=None):
        self.engine = InterleavedUpdate(streams, subgroup_numel)
        self.policy = policy
        self.rates = rates
        self.model = None
        self.log = log
        self.records: list[StepRecord] = []

    def _model_for(self, slots: list[StateSlot], total: int):
        shape = Shape(subgroups=total, subgroup_numel=max(1, capacity(self.engine.subgroups)),
                      state_bytes=4 * (1 + len(state_keys(slots[0].group))))
        if self.model is None or self.model.shape.subgroups != total:
            rates = self.rates or measure(self.engine.device, shape.subgroup_numel, update_probe(slots[0].group))
            self.rates = rates
            self.model = PerfModel(rates, shape)
        return self.model

    def _free_bytes(self) -> float | None:
        """Device memory the staging buffers could use now: what is free plus what they already hold."""
        if self.engine.device.type != "cuda":
            return None
        held = sum(t.numel() * t.element_size() for buffer in self.engine._staging.buffers for t in buffer.values())
        return float(torch.cuda.mem_get_info(self.engine.device)[0] + held)

    def choose(self, slots: list[StateSlot]):
        """(GPU subgroup indices, the model's prediction or None) for this step."""
        total = len(self.engine.plan([slot.master.numel() for slot in slots]))
        if self.policy == "model":
            prediction = self._model_for(slots, total).choose()
            return spread(prediction.gpu_subgroups, total), prediction
        kind, value = self.policy
        if kind == "stride":
            return strided(value, total), None
        if kind == "fraction":
            return frozenset(range(round(value * total))), None
        raise ValueError(f"unknown split policy {self.policy!r}")

    def step(self, slots: list[StateSlot]) -> StepRecord:
        if not slots:
            return StepRecord(0, 0, None, 0.0, 0.0)
        on_gpu, prediction = self.choose(slots)
        times = self.engine.step(slots, on_gpu)
        if prediction is not None:
            self.model.observe(prediction, times.seconds, times.cpu_elements, times.cpu_seconds, self._free_bytes())
        record = StepRecord(len(on_gpu), len(self.engine.subgroups),
                            prediction.seconds if prediction is not None else None, times.seconds, times.cpu_seconds)
        self.records.append(record)
        if self.log is not None:
            predicted = f"{record.predicted_seconds:.4f} s" if record.predicted_seconds is not None else "none"
            self.log(f"interleaved offload: {record.gpu_subgroups}/{record.subgroups} subgroups on the GPU, "
                     f"step predicted {predicted}, measured {record.measured_seconds:.4f} s "
                     f"(CPU updates {record.cpu_seconds:.4f} s)")
        return record
