"""Saves under ``--overlap-param-gather`` without Megatron-LM's forced all-gather.

With the distributed optimizer and ``--overlap-param-gather``, the optimizer step writes only this
data-parallel rank's own shard of each parameter buffer; the other shards arrive by all-gathers
that the next forward pass's pre-hooks dispatch and wait for. Before every save Megatron-LM runs
those all-gathers blocking (``force_param_sync`` in ``save_checkpoint_and_time``), which at
``--save-interval 1`` takes the overlap away every iteration. Under ``--use-datastates`` patch
0004 skips that call and the save's copies wait behind a ``CopyGate`` instead. It opens once
every model chunk's forward pass has returned with all its bucket groups gathered. Those are
the values ``force_param_sync`` would have produced: the same all-gather of the same shards, and
nothing else writes the parameters before the optimizer step, which waits for the copies.

A wait that comes first (the lazy wait when a forward pass did not reach a bucket group, the end
of training, a save with no forward pass after it) settles the gate on the training thread: it
runs the still-missing all-gathers blocking, as Megatron-LM would have at the save. Every
data-parallel rank reaches the same decision: the bucket groups' states follow the same program
order on all of them, so the collectives match. A save still held when the interpreter exits
(no wait after it) is settled by the exit hook the same way after a normal exit; after an uncaught
exception it goes ahead only if every all-gather already completed, else it fails.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.engine import CopyGate

WHAT = "the parameter all-gathers of --overlap-param-gather"


def deferred_param_gather(args: Any) -> bool:
    """Megatron-LM's condition for ``force_param_sync`` before a save (``should_disable_forward_pre_hook``,
    core_v0.19.0): no Megatron FSDP, an optimizer that exists (not ``--skip-train``, unless an RL step
    loads one), a distributed optimizer (or the layer-wise one) and ``--overlap-param-gather``.

    Written out rather than imported, for trainers without ``megatron.training``; a test holds it to
    Megatron-LM's own function over every combination of these flags.
    """
    has_optimizer = not getattr(args, "skip_train", False) or (
        bool(getattr(args, "perform_rl_step", False)) and not getattr(args, "no_load_optim", False))
    distributed = bool(getattr(args, "use_distributed_optimizer", False)) or bool(
        getattr(args, "use_layer_wise_distributed_optimizer", False))
    return (not getattr(args, "use_megatron_fsdp", False) and has_optimizer and distributed
            and bool(getattr(args, "overlap_param_gather", False)))


def bucket_groups(chunks: list) -> list:
    """Every bucket group of the DDP-wrapped model chunks, in the order Megatron-LM syncs them."""
    groups = []
    for chunk in chunks:
        groups += list(getattr(chunk, "bucket_groups", ())) + list(getattr(chunk, "expert_parallel_bucket_groups", ()))
    return groups


def _gathered(group: Any) -> bool:
    return bool(group.param_gather_dispatched) and group.param_gather_handle is None


def sync_missing(chunks: list) -> None:
    """Run, blocking, every all-gather not yet complete (what ``force_param_sync`` does for them)."""
    for group in bucket_groups(chunks):
        if not _gathered(group):
            group.start_param_sync(force_sync=True)


def gather_gate(args: Any, chunks: list) -> CopyGate | None:
    """A gate for this save's copies, or None when every parameter already holds its value."""
    if not deferred_param_gather(args):
        return None
    groups = bucket_groups(chunks)
    if all(_gathered(g) for g in groups):
        return None
    hooks: list = []
    waiting_for = set(range(len(chunks)))

    def remove_hooks() -> None:
        for handle in hooks:
            handle.remove()
        hooks.clear()

    def settle() -> None:
        remove_hooks()
        sync_missing(chunks)

    # At an end no wait reached (the interpreter's exit): final already if every all-gather completed
    # (Megatron-LM's disable_forward_pre_hook forces them at the end of training), else settled
    # there only after a normal exit, when every rank runs the same all-gathers (copy_gate.py).
    gate = CopyGate(settle, WHAT, ready=lambda: all(_gathered(g) for g in groups))

    def after_forward(index: int):
        def hook(module: Any, inputs: Any, output: Any) -> None:
            waiting_for.discard(index)
            if waiting_for:
                return
            remove_hooks()
            if all(_gathered(g) for g in groups):
                gate.open()  # in stream order after the pre-hooks' waits on the all-gathers
            # else a bucket group the forward passes did not reach: the next wait settles it
        return hook

    for index, chunk in enumerate(chunks):
        hooks.append(chunk.register_forward_hook(after_forward(index)))
    return gate
