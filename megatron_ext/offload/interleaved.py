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

    def release_staging(self) -> None:
        self._staging = _Staging()

    def _stage(self, keys: tuple[str, ...], numel: int) -> list[dict[str, torch.Tensor]]:
        staging = self._staging
        if staging.numel < numel or not staging.buffers or set(staging.buffers[0]) != {"master", *keys}:
            staging.buffers = [{key: torch.empty(numel, dtype=torch.float32, device=self.device)
                                for key in ("master", *keys)} for _ in range(2)]
            staging.numel = numel
        return staging.buffers

    def step(self, slots: list[StateSlot], on_gpu: frozenset[int]) -> StepTimes:
        start = time.perf_counter()
        s = self.streams
        subgroups = self.plan([slot.master.numel() for slot in slots])
        keys = state_keys(slots[0].group) if slots else MOMENTS
        if any(state_keys(slot.group) != keys for slot in slots):
            raise ValueError("the interleaved optimizer needs one optimizer, AMSGrad and momentum on or off, "
                             "for every group")
        fresh = [any(key not in slot.state for key in keys) for slot in slots]  # SGD: buffer from the gradient
        for slot in slots:
            if any(key not in slot.state for key in keys) or not slot.state:
                slot.state.update(init_state(slot.master, slot.group, self.pin))
        # Adam's step counts before this step's increment
        steps = [slot.state["step"].clone() if "step" in slot.state else None for slot in slots]
        gpu = [sg for sg in subgroups if sg.index in on_gpu]
        cpu = [sg for sg in subgroups if sg.index not in on_gpu]
        # fused and capturable Adam keep the step count with the tensors: copied to the device once,
        # now, since a blocking copy later would wait for the GPU updates already queued
        device_steps = {p.tensor: steps[p.tensor].to(self.device) for sg in gpu for p in sg.pieces
                        if steps[p.tensor] is not None
                        and (slots[p.tensor].group.get("fused") or slots[p.tensor].group.get("capturable"))}

        def step_copy(i: int, on_device: bool) -> list[torch.Tensor]:
            source = device_steps.get(i, steps[i]) if on_device else steps[i]
            return [source.clone()] if source is not None else []

        # 1. CPU subgroups' gradients to the host.
        s.wait_compute("d2h")
        for sg in cpu:
            for p in sg.pieces:
                s.copy("d2h", self._host_grads[p.tensor][p.start:p.stop], _flat(slots[p.tensor].grad)[p.start:p.stop])
        grads_on_host = s.record("d2h", "grads_to_host")

        # 2. Prefetch of the first two GPU subgroups.
        staging = self._stage(keys, capacity(gpu)) if gpu else []
        ready, freed = [None, None], [None, None]
        s.wait_compute("h2d")

        def prefetch(j: int) -> None:
            b = j % 2
            if freed[b] is not None:
                s.wait("h2d", freed[b])
            offset = 0
            for p in gpu[j].pieces:
                slot, n = slots[p.tensor], p.numel
                s.copy("h2d", staging[b]["master"][offset:offset + n], _flat(slot.master)[p.start:p.stop])
                for key in keys:
                    s.copy("h2d", staging[b][key][offset:offset + n], _flat(slot.state[key])[p.start:p.stop])
                offset += n
            ready[b] = s.record("h2d", "prefetch")

        for j in range(min(2, len(gpu))):
            prefetch(j)

        cpu_seconds, cpu_elements, cpu_queue = 0.0, 0, list(cpu)
        grads_waited = False

        def update_on_cpu(count: int) -> None:
            nonlocal cpu_seconds, cpu_elements, grads_waited
            for _ in range(min(count, len(cpu_queue))):
                if not grads_waited:
                    s.host_wait(grads_on_host)
                    grads_waited = True
                sg = cpu_queue.pop(0)
                began = time.perf_counter()
                for p in sg.pieces:
                    slot = slots[p.tensor]
                    view = {key: _flat(slot.state[key])[p.start:p.stop] for key in keys}
                    master = _flat(slot.master)[p.start:p.stop]
                    update([master], [self._host_grads[p.tensor][p.start:p.stop]], [view],
                           step_copy(p.tensor, False), slot.group, fresh[p.tensor])
                    if slot.weight is not None:
                        s.copy("h2d", _flat(slot.weight)[p.start:p.stop], master)
                cpu_seconds += time.perf_counter() - began
                cpu_elements += sg.numel

        # 3. GPU subgroups through the double buffer, CPU subgroups in between.
        share = math.ceil(len(cpu) / (len(gpu) + 1)) if gpu else len(cpu)
        for j, sg in enumerate(gpu):
            b = j % 2
            s.wait("compute", ready[b])
            offset = 0
            for p in sg.pieces:
                slot, n = slots[p.tensor], p.numel
                view = {key: staging[b][key][offset:offset + n] for key in keys}
                master = staging[b]["master"][offset:offset + n]
                grad = _flat(slot.grad)[p.start:p.stop].to(device=self.device, dtype=torch.float32)
                update([master], [grad], [view], step_copy(p.tensor, True), slot.group, fresh[p.tensor])
                if slot.weight is not None:
                    s.copy("compute", _flat(slot.weight)[p.start:p.stop], master)
                offset += n
            s.wait("d2h", s.record("compute", "updated"))
            offset = 0
            for p in sg.pieces:
                slot, n = slots[p.tensor], p.numel
                s.copy("d2h", _flat(slot.master)[p.start:p.stop], staging[b]["master"][offset:offset + n])
                for key in keys:
                    s.copy("d2h", _flat(slot.state[key])[p.start:p.stop], staging[b][key][offset:offset + n])
                offset += n
            freed[b] = s.record("d2h", "buffer_free")
            if j + 2 < len(gpu):
                prefetch(j + 2)
            update_on_cpu(share)
        update_on_cpu(len(cpu_queue))

        # 4. Weights ordered before the next forward; host state complete; step counts.
        weights_sent = s.record("h2d", "weights_to_device")
        s.wait("compute", weights_sent)
        s.host_wait(weights_sent)  # the next step's CPU updates rewrite the masters these copies read
        s.host_wait(s.record("d2h", "write_back"))
        if hasattr(s, "reset"):
            s.reset()
        for slot in slots:
            if "step" in slot.state:
                slot.state["step"] += 1
        gpu_elements = sum(sg.numel for sg in gpu)
        return StepTimes(time.perf_counter() - start, cpu_seconds, cpu_elements, gpu_elements)


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
