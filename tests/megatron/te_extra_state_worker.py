"""torchrun worker (one CPU rank): Transformer Engine's pickled extra state through the adapter's save and load.

megatron-core's local GPT has no module with extra state, so a TE-shaped one
(``helpers.te_shapes.ExtraStateModule``: TE 2.9-2.11's ``get_extra_state`` / ``set_extra_state``,
which unpickles) is placed in the first transformer layer; megatron-core describes its
``_extra_state`` as a ``ShardedObject``, as it does for TE's modules. ``python te_extra_state_worker.py
DIR CANARY``. Prints one ``ok: ...`` line per case:

* a genuine fp8 extra state (delayed scaling) loads and reaches the module with its values;
* a hostile one (its pickle runs ``touch CANARY``) is refused by ``load_checkpoint`` naming the
  rank's file and the module, before ``load_state_dict``: the module never sees it and the canary
  does not exist;
* one naming a class TE never pickles (``fractions.Fraction``, harmless) is refused likewise, and
  with ``--datastates-allow-pickle`` it reaches the module.
"""

import fractions
import os
import sys

import torch
import torch.distributed as dist

from helpers import te_shapes
from megatron_ext.engine import CheckpointError
from megatron_ext.megatron import checkpointing, core_state
from megatron_ext.testing import reference_trainer as trainer

KEY = "decoder.layers.0.te_probe._extra_state"


def model_with(args, blob):
    model, _ = trainer.build_model(args)
    probe = te_shapes.ExtraStateModule(blob)
    core_state.unwrap([model])[0].decoder.layers[0].te_probe = probe
    return model, probe


def save(args, root: str, blob) -> None:
    args.save = args.load = root
    model, _ = model_with(args, blob)
    checkpointing.set_args(args)
    checkpointing.save_checkpoint(1, [model], None, None, 0)
    checkpointing.finalize_checkpoints(blocking=True)
    checkpointing.shutdown()


def load(args):
    model, probe = model_with(args, te_shapes.no_fp8_extra_state())
    checkpointing.set_args(args)
    try:
        checkpointing.load_checkpoint([model], None, None)
    finally:
        checkpointing.shutdown()
    return probe


def refused(args, *needles: str) -> str:
    try:
        probe = load(args)
    except CheckpointError as exc:
        missing = [n for n in needles if n not in str(exc)]
        assert not missing, f"{missing} not in: {exc}"
        return str(exc)
    raise AssertionError(f"not refused; the module received {probe.loaded}")


def main() -> None:
    root, canary = sys.argv[1], sys.argv[2]
    args = trainer.build_parser().parse_args(["--use-datastates", "--datastates-host-cache-size", "0.01",
                                              "--save", root])
    trainer.initialize_distributed(args)

    recipe = te_shapes.DelayedScaling(margin=1, amax_history_len=8)
    save(args, os.path.join(root, "genuine"), te_shapes.module_extra_state(recipe, seed=3))
    probe = load(args)
    expected = te_shapes.module_state(recipe, seed=3)
    [got] = probe.loaded
    assert got["recipe"] == recipe and got["extra_fp8_variables"] == expected["extra_fp8_variables"]
    assert all(torch.equal(got[k], expected[k]) for k in ("scale_fwd", "amax_history_fwd", "scale_bwd",
                                                          "amax_history_bwd"))
    print("ok: a genuine fp8 extra state reaches its module with its values", flush=True)

    save(args, os.path.join(root, "hostile"), te_shapes.hostile_extra_state(f"touch {canary}"))
    message = refused(args, KEY, ".safetensors", "system", "--datastates-allow-pickle")
    assert not os.path.exists(canary), "the hostile pickle ran"
    print(f"ok: a hostile extra state is refused and nothing ran: {message}", flush=True)

    save(args, os.path.join(root, "foreign"), te_shapes.foreign_extra_state(fractions.Fraction(1, 3)))
    refused(args, KEY, "fractions.Fraction")
    args.datastates_allow_pickle = True
    [got] = load(args).loaded
    assert got["extra_fp8_variables"]["foreign"] == fractions.Fraction(1, 3)
    print("ok: with --datastates-allow-pickle the module unpickles what the check refuses", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
