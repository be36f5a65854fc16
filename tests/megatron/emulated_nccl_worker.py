"""Run by test_emulated_nccl.py under torchrun (2 ranks): what the NCCL emulation lets through and refuses."""

import json
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine.collectives import all_reduce_int, collective_device
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
from megatron_ext.testing.emulated_nccl import enable_emulated_nccl, is_host_tensor


def refused(call) -> bool:
    try:
        call()
    except RuntimeError as exc:
        return "No backend type associated with device type cpu" in str(exc)
    return False


def main(out: str) -> None:
    enable_cpu_emulation()
    enable_emulated_nccl()
    dist.init_process_group("nccl")
    host = torch.tensor([dist.get_rank()])
    on_gpu = torch.ones(3, device="cuda")
    dist.all_reduce(on_gpu)
    moved = host.cuda()
    dist.all_reduce(moved)
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    gloo = dist.new_group([0, 1], backend="gloo")
    through_gloo = host.clone()
    dist.all_reduce(through_gloo, group=gloo)
    result = {
        "backend": dist.get_backend(),
        "host_marked": [is_host_tensor(t) for t in (host, host.float(), host + 1, torch.zeros(2, device="cpu"))],
        "gpu_marked": [is_host_tensor(t) for t in (on_gpu, moved, host.to("cuda"), torch.zeros(2, device="cuda"),
                                                   torch.zeros(1, device=on_gpu.device))],
        "refused": [refused(lambda: dist.all_reduce(host)), refused(lambda: dist.broadcast(host.float(), 0)),
                    refused(lambda: dist.all_gather_into_tensor(torch.zeros(2, device="cuda"), host))],
        "gpu_sum": on_gpu.tolist(), "moved_sum": moved.tolist(), "objects": objects,
        "gloo_sum": through_gloo.tolist(), "collective_device": str(collective_device()),
        "all_reduce_int": all_reduce_int(dist.get_rank() + 1, dist.ReduceOp.MAX),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
