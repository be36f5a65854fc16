"""How many subgroups to update on the GPU this step: a model of the interleaved step's time.

Inputs (``NodeRates``), measured on the node at start-up (``measure``) and refreshed from each
step's own timings (``PerfModel.observe``): ``h2d`` and ``d2h`` PCIe bandwidth (bytes/s),
``gpu_rate`` and ``cpu_rate`` (elements updated per second), ``free_bytes`` (device memory free
for staging).

For ``N`` subgroups of ``n`` elements, ``s`` bytes of host state per element (fp32 master and
moments: 12, 16 with AMSGrad), ``g`` and ``w`` bytes per element of gradient and weight crossing
PCIe for a CPU subgroup (4: a bf16 tensor copied to or from an fp32 host buffer is cast on the
device and crosses as fp32), with ``k`` subgroups on the GPU:

* one GPU subgroup's stages: ``t_in = n*s/h2d``, ``t_upd = n/gpu_rate``, ``t_out = n*s/d2h``;
* the GPU pipeline over a double buffer (a buffer is refilled only once its write-back is
  done, so two subgroups share one ``t_in + t_upd + t_out`` cycle, and no stage runs faster
  than its own link):
  ``T_gpu(k) = (t_in + t_upd + t_out) + (k - 1) * max(t_in, t_upd, t_out, (t_in + t_upd + t_out) / 2)``,
  ``T_gpu(0) = 0``;
* the CPU path: ``T_cpu(k) = (N - k) * n / cpu_rate``;
* each PCIe direction carries the GPU subgroups' state and the CPU subgroups' gradients
  (device to host) or updated weights (host to device):
  ``T_h2d(k) = (k*n*s + (N-k)*n*w) / h2d``, ``T_d2h(k) = (k*n*s + (N-k)*n*g) / d2h``;
* ``T(k) = max(T_gpu(k), T_cpu(k), T_h2d(k), T_d2h(k)) * c(k)``, where ``c`` is the measured over
  predicted ratio of recent steps (1 until measured);
* memory: ``k > 0`` only if the two staging buffers fit, ``2*n*s <= 0.9 * free_bytes``.

The split is the ``k`` in ``0..N`` with the smallest ``T(k)`` (the smaller ``k`` on a tie).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

STAGING_SHARE = 0.9
EMA = 0.5


@dataclass(frozen=True)
class NodeRates:
    h2d: float
    d2h: float
    gpu_rate: float
    cpu_rate: float
    free_bytes: float


@dataclass(frozen=True)
class Shape:
    """What the model needs of the state: subgroup count and size, bytes per element."""

    subgroups: int
    subgroup_numel: int
    state_bytes: int = 12
    grad_bytes: int = 4
    weight_bytes: int = 4


@dataclass(frozen=True)
class Prediction:
    gpu_subgroups: int
    seconds: float
    gpu_seconds: float
    cpu_seconds: float
    h2d_seconds: float
    d2h_seconds: float


def staging_fits(rates: NodeRates, shape: Shape) -> bool:
    return 2 * shape.subgroup_numel * shape.state_bytes <= STAGING_SHARE * rates.free_bytes


def predict(k: int, rates: NodeRates, shape: Shape, correction: float = 1.0) -> Prediction:
    n, s, total = shape.subgroup_numel, shape.state_bytes, shape.subgroups
    t_in, t_upd, t_out = n * s / rates.h2d, n / rates.gpu_rate, n * s / rates.d2h
    cycle = t_in + t_upd + t_out
    gpu = cycle + (k - 1) * max(t_in, t_upd, t_out, cycle / 2) if k > 0 else 0.0
    cpu = (total - k) * n / rates.cpu_rate
    h2d = (k * n * s + (total - k) * n * shape.weight_bytes) / rates.h2d
    d2h = (k * n * s + (total - k) * n * shape.grad_bytes) / rates.d2h
    return Prediction(k, max(gpu, cpu, h2d, d2h) * correction, gpu, cpu, h2d, d2h)


def choose(rates: NodeRates, shape: Shape, correction: float = 1.0) -> Prediction:
    """The split with the smallest predicted step time (no GPU subgroup when staging does not fit)."""
    top = shape.subgroups if staging_fits(rates, shape) else 0
    candidates = (predict(k, rates, shape, correction) for k in range(top + 1))
    return min(candidates, key=lambda p: (p.seconds, p.gpu_subgroups))


class PerfModel:
    """The rates, refreshed from each step: the CPU rate from the CPU updates' own time, and the
    ratio of measured to predicted step time for what cannot be timed apart on the host."""

    def __init__(self, rates: NodeRates, shape: Shape):
        self.rates, self.shape, self.correction = rates, shape, 1.0

    def choose(self) -> Prediction:
        return choose(self.rates, self.shape, self.correction)

    def observe(self, prediction: Prediction, measured_seconds: float, cpu_elements: int, cpu_seconds: float,
                free_bytes: float | None = None) -> None:
        if free_bytes is not None:
            self.rates = replace(self.rates, free_bytes=free_bytes)
        if cpu_elements and cpu_seconds > 0:
            rate = cpu_elements / cpu_seconds
            self.rates = replace(self.rates, cpu_rate=(1 - EMA) * self.rates.cpu_rate + EMA * rate)
        raw = predict(prediction.gpu_subgroups, self.rates, self.shape).seconds
        if raw > 0 and measured_seconds > 0:
            self.correction = (1 - EMA) * self.correction + EMA * (measured_seconds / raw)


def _seconds(fn, device: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``fn`` (device-synchronised on CUDA), after one untimed call (first-call costs)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(device: torch.device, subgroup_numel: int, adam_update, probe_bytes: int = 64 << 20) -> NodeRates:
    """The node's rates, measured now: a pinned copy each way, ``adam_update(n, device)`` (one
    subgroup's update, returned as a callable) on each side, and the device's free memory. On a
    CPU-only machine both "devices" are the host: copies are host memcpys."""
    pin = device.type == "cuda"
    host = torch.empty(probe_bytes // 4, dtype=torch.float32, pin_memory=pin)
    dev = torch.empty_like(host, device=device)
    h2d = probe_bytes / _seconds(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = probe_bytes / _seconds(lambda: host.copy_(dev, non_blocking=True), device)
    del host, dev
    gpu_rate = subgroup_numel / _seconds(adam_update(subgroup_numel, device), device)
    cpu_rate = subgroup_numel / _seconds(adam_update(subgroup_numel, torch.device("cpu")), torch.device("cpu"))
    if device.type == "cuda":
        free = float(torch.cuda.mem_get_info(device)[0])
    else:
        free = float(1 << 40)
    return NodeRates(h2d=h2d, d2h=d2h, gpu_rate=gpu_rate, cpu_rate=cpu_rate, free_bytes=free)
