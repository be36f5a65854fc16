"""``megatron-ext bench offload``: the optimizer step with fp32 state in host memory, split several ways.

Torch only (no megatron-core, no Transformer Engine): it runs on a bare GPU node. A synthetic
shard (``--params``, default 3B on a GPU, 1M on a CPU) of tensors of mixed sizes: bf16 weights and
gradients on the device, fp32 masters and Adam moments on the host (pinned on a GPU). Variants:

* ``all-gpu``: every state tensor on the device, no transfer (skipped where it does not fit);
* ``hdo-1.0``: the data movement of megatron-core's hybrid device optimizer at fraction 1.0 (this
  project's interleaved step with no GPU subgroup, not megatron-core's class: the bench imports no
  megatron-core): gradients to the host on a side stream, every update on the CPU, weights back on
  another;
* ``static-F``: HDO's static split, the first ``1 - F`` of the parameters with their state resident on
  the device, the fraction ``F`` on the host (``--fractions``, default 0.1 to 0.5);
* ``interleaved-model``: the interleaved optimizer, split by its performance model;
* ``interleaved-stride-S``: the same with every ``S``-th subgroup on the GPU (``--strides``).

Every variant sees the same gradients, so on a CPU their results must be bit-identical (checked,
exit 1 if not). Each step can be preceded by a synthetic forward/backward (``--tokens``: matmuls of
``6 * params * tokens`` FLOPs) and followed by a checkpoint (``--checkpoint``: the state copied to
a host snapshot, host-to-host where it is on the host, and the weights device-to-host).

The variants alternate over ``--repeats`` rounds (default 3, the order reversed every other round),
each on a fresh shard. JSON per variant, each figure the median over the rounds with each round's
under ``<figure>_by_round`` and their max - min under ``<figure>_spread``: median update and iteration seconds (after ``--warmup``), parameters updated per
second, PCIe GB/s each way (bytes the variant moves per step over the update time), peak device
memory, and the model's prediction where the split has one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from megatron_ext.arg_types import NONNEG_INT, POSITIVE_INT
from megatron_ext.bench.common import DEFAULT_REPEATS, figures_over_rounds, round_order
from megatron_ext.offload.interleaved import StateSlot, InterleavedOffload, adam_update, init_state, update_probe
from megatron_ext.offload.perf_model import Shape, measure, predict
from megatron_ext.offload.lanes import lanes_for

NAME = "offload"
HELP = "optimizer step with host-resident fp32 state: all-GPU, HDO at 1.0, static splits, interleaved"

GROUP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, foreach=None,
             capturable=False, differentiable=False, fused=True, decoupled_weight_decay=True)
LINK_BYTES = Shape(0, 0).grad_bytes  # a bf16 gradient or weight crosses PCIe as fp32 (cast on the device)


def shard_sizes(params: int) -> list[int]:
    """Tensor sizes of a transformer-like shard: a few large matrices and some small vectors."""
    large = max(1, params // 12)
    sizes = []
    while sum(sizes) + large <= params:
        sizes += [large, 1 + large // 1000]
    rest = params - sum(sizes)
    return [s for s in sizes if s] + ([rest] if rest else [])


class Shard:
    """Weights and gradients on the device, masters and moments on the host; fresh for each variant."""

    def __init__(self, sizes: list[int], device: torch.device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        pin = device.type == "cuda"
        self.sizes, self.device = sizes, device
        self.masters = [torch.randn(n, generator=gen).pin_memory() if pin else torch.randn(n, generator=gen)
                        for n in sizes]
        self.weights = [m.to(device=device, dtype=torch.bfloat16) for m in self.masters]
        self.grads = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes]
        self.states = [init_state(m, GROUP, pin) for m in self.masters]

    def fill_grads(self, step: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(1000 + step)
        for g in self.grads:
            g.copy_(torch.randn(g.shape, generator=gen, device=self.device) * 1e-2)

    def slots(self, indices) -> list[StateSlot]:
        return [StateSlot(self.masters[i], self.grads[i], self.states[i], GROUP, self.weights[i]) for i in indices]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceResident:
    """The part of the shard whose masters and moments live on the device (all-GPU, static splits)."""

    def __init__(self, shard: Shard, indices: list[int]):
        self.shard, self.indices = shard, indices
        dev = shard.device
        self.masters = {i: shard.masters[i].to(dev) for i in indices}
        self.states = {i: {k: v.to(dev) for k, v in shard.states[i].items()} for i in indices}

    def step(self) -> None:
        for i in self.indices:
            step = self.states[i]["step"].clone()
            adam_update([self.masters[i]], [self.shard.grads[i].float()], [self.states[i]], [step], GROUP)
            self.states[i]["step"] += 1
            self.shard.weights[i].copy_(self.masters[i])

    def results(self) -> dict[int, tuple[torch.Tensor, ...]]:
        return {i: (self.masters[i].cpu(), self.states[i]["exp_avg"].cpu(), self.states[i]["exp_avg_sq"].cpu())
                for i in self.indices}


def _fwd_bwd(device: torch.device, flops: float, work: list[torch.Tensor]) -> None:
    """Matmuls of about ``flops`` on the device: the synthetic forward/backward."""
    if flops <= 0:
        return
    a = work[0]
    for _ in range(max(1, round(flops / (2 * a.shape[0] ** 3)))):
        torch.mm(a, a, out=work[1])


@dataclass
class _Split:
    """How one variant splits the shard: tensors whose state stays on the device (HDO's static split,
    stepped by ``dev_part``) and tensors whose state is on the host (stepped by ``offload``)."""

    resident: list[int]
    resident_numel: int
    on_host: list[int]
    dev_part: DeviceResident | None
    offload: InterleavedOffload | None
    slots: list[StateSlot]


def _split(shard: Shard, policy, resident_fraction: float, subgroup_numel: int, rates) -> _Split:
    """The first tensors up to ``resident_fraction`` of the parameters stay on the device, as HDO splits."""
    total = sum(shard.sizes)
    resident, count = [], 0
    for i, size in enumerate(shard.sizes):
        if count < resident_fraction * total:
            resident.append(i)
            count += size
    on_host = [i for i in range(len(shard.sizes)) if i not in resident]
    dev_part = DeviceResident(shard, resident) if resident else None
    offload = (InterleavedOffload(lanes_for(shard.device), subgroup_numel, policy=policy, rates=rates)
               if on_host else None)
    return _Split(resident, count, on_host, dev_part, offload, shard.slots(on_host))


@dataclass
class _Timings:
    """Per measured step (after the warmup): update, whole iteration, checkpoint; and every step's record."""

    update_s: list[float] = field(default_factory=list)
    iter_s: list[float] = field(default_factory=list)
    ckpt_s: list[float] = field(default_factory=list)
    records: list = field(default_factory=list)


def _snapshot(shard: Shard, split: _Split) -> list[torch.Tensor]:
    """The synthetic checkpoint: state copied host-to-host where it is on the host, the rest and the
    weights device-to-host."""
    snapshot = [m.clone() for m in shard.masters if m.device.type == "cpu"] + [w.to("cpu") for w in shard.weights]
    if split.dev_part is not None:
        snapshot += [t for r in split.dev_part.results().values() for t in r]
    for i in split.on_host:
        snapshot += [shard.states[i]["exp_avg"].clone(), shard.states[i]["exp_avg_sq"].clone()]
    _sync(shard.device)
    return snapshot


def _timed_steps(shard: Shard, split: _Split, steps: int, warmup: int, flops: float, checkpoint: bool,
                 work: list[torch.Tensor]) -> _Timings:
    """``warmup + steps`` iterations (gradients, forward/backward, update, checkpoint), the last ``steps`` timed."""
    device, timings = shard.device, _Timings()
    snapshot: list[torch.Tensor] = []  # each snapshot stays alive until the next one replaces it
    for step in range(warmup + steps):
        shard.fill_grads(step)
        _sync(device)
        began = time.perf_counter()
        _fwd_bwd(device, flops, work)
        upd_began = time.perf_counter()
        if split.dev_part is not None:
            split.dev_part.step()
        if split.offload is not None:
            timings.records.append(split.offload.step(split.slots))
        _sync(device)
        upd_done = time.perf_counter()
        if checkpoint:
            snapshot = _snapshot(shard, split)
        done = time.perf_counter()
        if step >= warmup:
            timings.update_s.append(upd_done - upd_began)
            timings.iter_s.append(done - began)
            timings.ckpt_s.append(done - upd_done)
    return timings


def _predicted(split: _Split, gpu_fraction: float, subgroup_numel: int, records) -> float | None:
    """The model's prediction of the update time where the variant has one: its own split's, or for a
    fixed split of host-only state, the model's estimate at that split."""
    offload = split.offload
    if offload is not None and offload.model is not None:
        return statistics.median(r.predicted_seconds for r in records)
    if offload is not None and not split.resident:
        k = round(gpu_fraction * len(offload.engine.subgroups))
        return predict(k, offload.rates, Shape(len(offload.engine.subgroups), subgroup_numel,
                                               grad_bytes=LINK_BYTES, weight_bytes=LINK_BYTES)).seconds
    return None


def _summary(name: str, shard: Shard, split: _Split, timings: _Timings, warmup: int, subgroup_numel: int,
             checkpoint: bool) -> dict:
    """The variant's JSON: medians, rates, bytes over PCIe per update second, peak memory, prediction."""
    device, total = shard.device, sum(shard.sizes)
    records = timings.records[warmup:]
    gpu_fraction = statistics.mean(r.gpu_subgroups / max(1, r.subgroups) for r in records) if timings.records else 0.0
    host_numel = sum(shard.sizes[i] for i in split.on_host)
    staged = gpu_fraction * host_numel
    h2d_bytes = staged * 12 + (host_numel - staged) * LINK_BYTES
    d2h_bytes = staged * 12 + (host_numel - staged) * LINK_BYTES
    upd = statistics.median(timings.update_s)
    return {
        "variant": name, "update_s": upd, "iteration_s": statistics.median(timings.iter_s),
        "checkpoint_s": statistics.median(timings.ckpt_s) if checkpoint else None,
        "params_per_s": total / upd if upd > 0 else None,
        "h2d_gbps": h2d_bytes / upd / 1e9 if upd > 0 else None, "d2h_gbps": d2h_bytes / upd / 1e9 if upd > 0 else None,
        "gpu_subgroup_share": gpu_fraction, "device_resident_share": split.resident_numel / total,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "predicted_update_s": _predicted(split, gpu_fraction, subgroup_numel, records),
    }


def _final_state(shard: Shard, split: _Split) -> dict:
    """Masters, moments and weights after the last step: what every variant must agree on."""
    final = {i: (shard.masters[i].clone(), shard.states[i]["exp_avg"].clone(), shard.states[i]["exp_avg_sq"].clone())
             for i in split.on_host}
    if split.dev_part is not None:
        final.update(split.dev_part.results())
    final["weights"] = tuple(w.cpu() for w in shard.weights)
    return final


def run_variant(name: str, policy, shard: Shard, resident_fraction: float, steps: int, warmup: int,
                subgroup_numel: int, flops: float, checkpoint: bool, rates) -> tuple[dict, dict]:
    """One variant on a fresh ``shard``: (its JSON, its final state for the bit-identity check)."""
    device = shard.device
    split = _split(shard, policy, resident_fraction, subgroup_numel, rates)
    side = 4096 if device.type == "cuda" else 64
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    work = [torch.randn(side, side, device=device, dtype=torch.bfloat16) for _ in range(2)] if flops else []
    timings = _timed_steps(shard, split, steps, warmup, flops, checkpoint, work)
    return _summary(name, shard, split, timings, warmup, subgroup_numel, checkpoint), _final_state(shard, split)


def _fits_on_device(params: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    need = params * (12 + 4 + 4)  # master and moments, bf16 weight and gradient, the fp32 gradient
    return need <= 0.9 * torch.cuda.mem_get_info(device)[0]


def _same_bits(reference: dict, final: dict) -> bool:
    return all(all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(reference[key], final[key])) for key in reference)


def run(params: int, device: torch.device, steps: int, warmup: int, subgroup_numel: int, fractions, strides,
        tokens: int, checkpoint: bool, repeats: int = DEFAULT_REPEATS) -> dict:
    sizes = shard_sizes(params)
    flops = 6.0 * params * tokens
    variants = []
    if _fits_on_device(params, device):
        variants.append(("all-gpu", ("fraction", 0.0), 1.0))
    variants.append(("hdo-1.0", ("fraction", 0.0), 0.0))
    variants += [(f"static-{f:g}", ("fraction", 0.0), 1.0 - f) for f in fractions]
    variants.append(("interleaved-model", "model", 0.0))
    variants += [(f"interleaved-stride-{s}", ("stride", s), 0.0) for s in strides]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    identical: dict[str, bool] = {}
    reference = None  # the first variant's final state in the first round: what every run must give
    load_before = list(os.getloadavg())
    rates = measure(device, subgroup_numel, update_probe(GROUP))
    for rnd in range(repeats):
        for name, policy, resident in round_order(variants, rnd):
            shard = Shard(sizes, device)
            result, final = run_variant(name, policy, shard, resident, steps, warmup, subgroup_numel, flops,
                                        checkpoint, rates)
            rows[name].append(result)
            if reference is None:
                reference = final
            identical[name] = identical.get(name, True) and _same_bits(reference, final)
            del shard, final
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results = [{"variant": name, **figures_over_rounds(got, [k for k in got[0] if k != "variant"])}
               for name, got in rows.items()]
    return {"repeats": repeats, "load_average_before": load_before, "load_average_after": list(os.getloadavg()),"device": str(device), "params": params, "tensors": len(sizes), "subgroup_numel": subgroup_numel,
            "steps": steps, "warmup": warmup, "tokens": tokens, "checkpoint": checkpoint,
            "rates": {"h2d_gbps": rates.h2d / 1e9, "d2h_gbps": rates.d2h / 1e9,
                      "gpu_params_per_s": rates.gpu_rate, "cpu_params_per_s": rates.cpu_rate},
            "variants": results, "bit_identical_to_first": identical}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=POSITIVE_INT, default=None,
                   help="parameters in the shard (default 3e9 on a GPU, 1e6 on a CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--steps", type=POSITIVE_INT, default=None, help="measured steps (default 20 on a GPU, 3 on a CPU)")
    p.add_argument("--warmup", type=NONNEG_INT, default=2, help="steps before measuring (default 2)")
    p.add_argument("--subgroup-numel", type=POSITIVE_INT, default=None,
                   help="elements per subgroup (default 1/64 of the shard, at least 4096)")
    p.add_argument("--fractions", default="0.1,0.25,0.5",
                   help="static splits: offloaded fractions (default 0.1,0.25,0.5)")
    p.add_argument("--strides", default="2,4", help="fixed strides of the interleaved variant (default 2,4)")
    p.add_argument("--tokens", type=NONNEG_INT, default=None,
                   help="synthetic forward/backward of 6*params*tokens FLOPs per step "
                        "(default 16 on a GPU, 0 on a CPU)")
    p.add_argument("--checkpoint", action="store_true", help="a checkpoint (host snapshot) after every step")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every variant, order reversed every other (default {DEFAULT_REPEATS})")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--json", action="store_true", help="print one JSON object (else a table of the variants)")


def format_table(result: dict) -> str:
    """The variants' figures, one line each (``--json`` gives every figure)."""
    lines = [f"bench offload: {result['params']:,} parameters on {result['device']}, {result['steps']} steps, "
             f"medians of {result['repeats']} rounds",
             f"{'variant':<22} {'update s':>10} {'iteration s':>12} {'params/s':>12} {'on device':>10} {'same bits':>10}"]
    same = result["bit_identical_to_first"]
    for v in result["variants"]:
        lines.append(f"{v['variant']:<22} {v['update_s']:>10.4f} {v['iteration_s']:>12.4f} {v['params_per_s']:>12.3g} "
                     f"{v['device_resident_share']:>10.2f} {str(same.get(v['variant'], '-')):>10}")
    return "\n".join(lines)


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench offload --device cuda: no CUDA device is visible to torch here", file=sys.stderr)
        return 2
    on_gpu = device.type == "cuda"
    params = args.params or (3_000_000_000 if on_gpu else 1_000_000)
    result = run(params, device, args.steps or (20 if on_gpu else 3), args.warmup,
                 args.subgroup_numel or max(4096, params // 64),
                 [float(f) for f in args.fractions.split(",") if f], [int(s) for s in args.strides.split(",") if s],
                 args.tokens if args.tokens is not None else (16 if on_gpu else 0), args.checkpoint,
                 getattr(args, "repeats", DEFAULT_REPEATS))
    text = json.dumps(result, indent=1)
    print(text if args.json else format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not on_gpu and not all(result["bit_identical_to_first"].values()):
        print("bench offload: on a CPU every variant must give the same bits", file=sys.stderr)
        return 1
    return 0
