"""One check both convert tests make: two ``torch_dist`` checkpoints hold the same tensors, bit for bit.

It runs in a child process (megatron-core's loader wants a process group of its own):
``python -c SAME_TENSORS A B [COUNT]``, COUNT the exact number of tensors expected (else more than 10).
"""

SAME_TENSORS = (
    "import sys, torch\n"
    "from megatron.core.dist_checkpointing.serialization import load_plain_tensors\n"
    "from megatron_ext.megatron.convert import single_process_group\n"
    "with single_process_group():\n"
    "    a, b = (load_plain_tensors(p) for p in sys.argv[1:3])\n"
    "a, b = ({k: v for k, v in d.items() if isinstance(v, torch.Tensor)} for d in (a, b))\n"
    "count = int(sys.argv[3]) if len(sys.argv) > 3 else None\n"
    "assert sorted(a) == sorted(b) and (len(a) == count if count else len(a) > 10), (len(a), len(b))\n"
    "bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k].reshape(-1).view(torch.uint8),\n"
    "                                                                    b[k].reshape(-1).view(torch.uint8))]\n"
    "assert not bad, bad[:5]\n"
)
