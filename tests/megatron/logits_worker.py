"""Under torchrun: load a checkpoint into the reference trainer's megatron-core GPT, save its logits.

``python -m torch.distributed.run ... logits_worker.py OUT.pt [trainer args incl. --load]``. The
model is built and loaded as the trainer does (same layout as the checkpoint; weights only), put in
eval mode, run on one fixed batch; the tensor-parallel vocabulary slices of the logits are
gathered and rank 0 writes ``{"tokens", "logits"}`` to ``OUT.pt``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_ext.testing import reference_trainer as trainer


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    args = trainer.build_parser().parse_args(argv)
    trainer.initialize_distributed(args)
    _, load = trainer.select_checkpointing(args)
    model, _ = trainer.build_model(args)
    iteration = load(model, None, None, args)  # weights only: what an export carries
    assert iteration > 0, "no checkpoint was loaded"

    from megatron.core import parallel_state

    tokens = trainer.synthetic_batch(args.seed, 10_000, 0, 1, args.micro_batch_size, args.seq_length,
                                     args.vocab_size)[0, :, :-1].contiguous()
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    gpt = trainer.unwrap_model(model)
    gpt.eval()
    with torch.no_grad():
        local = gpt(tokens, position_ids, None).float().contiguous()
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": torch.cat(pieces, dim=-1), "iteration": iteration}, out)
    trainer.finish_checkpointing(args)  # the run's engine, started by the load (--save is set), stops here
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
