"""torchrun worker: saves of the same structure reuse what the save before kept (the optimizer's
model-space leaves, the owned split, the engine's plan), every structure change takes the full path,
and each checkpoint holds exactly what an uncached save of that moment would hold."""

import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_ext.megatron import checkpointing, core_state, sharding
from megatron_ext.megatron.checkpoint_layout import checkpoint_name, rank_file_name
from megatron_ext.testing import reference_trainer as trainer


def _expected(model, optimizer) -> dict:
    """What an uncached save holds now: the owned tensors (cloned), objects, metadata, optimizer common state."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded, common = save_preprocess(core_state.sharded_state(core_state.unwrap(model), optimizer, True),
                                      validate_access_integrity=False)
    shards = list(sharding.sharded_leaves(sharded))
    plan = sharding.plan_ownership(shards, 0, 1, lambda obj: [obj])
    tensors, objects, meta = sharding.split_owned(shards, plan)
    core_state.copy_buffers_now(tensors, core_state.unwrap(model))
    groups = common["optimizer"]["optimizer"]["param_groups"]
    return {"tensors": {k: t.clone() for k, t in tensors.items()}, "objects": objects, "meta": meta,
            "lr": [g["lr"] for g in groups]}


class ExtraState(torch.nn.Module):
    """A module with extra state, as Transformer Engine's: a new object at every call, None for none."""

    def __init__(self):
        super().__init__()
        self.value = None

    def get_extra_state(self):
        return None if self.value is None else {"scale": self.value}

    def set_extra_state(self, state):
        self.value = None if state is None else state["scale"]


def _save(iteration, model, optimizer, scheduler, args, saved: list) -> None:
    expected = _expected(model, optimizer)
    checkpointing.save_checkpoint(iteration, [model], optimizer, scheduler, 0)
    engine = checkpointing.current_engine()
    engine.wait_snapshot()  # the copies are done before the next step changes the state
    saved.append((iteration, expected, engine.plan_reuses, checkpointing.checkpointer()._kept_split))
    models.append(checkpointing.checkpointer()._kept_model)


models: list = []  # the model state each save used (``model_state.ModelState``)


def _check(args, saved: list) -> None:
    engine = checkpointing.current_engine()
    engine.wait_persisted()
    for iteration, expected, _, _ in saved:
        state = engine.load(checkpoint_name(iteration), rank_file_name(0), root=args.save)
        got = state["shards"]
        assert sorted(got["tensors"]) == sorted(expected["tensors"]), iteration
        for sid, tensor in expected["tensors"].items():
            loaded = got["tensors"][sid]
            assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape, (iteration, sid)
            assert torch.equal(loaded.view(torch.uint8), tensor.contiguous().view(torch.uint8)), (iteration, sid)
        assert got["meta"] == expected["meta"], iteration
        assert got["objects"] == expected["objects"], iteration
        lrs = [g["lr"] for g in state["common"]["optimizer"]["optimizer"]["param_groups"]]
        assert lrs == expected["lr"], (iteration, lrs, expected["lr"])
        assert state["meta"]["iteration"] == iteration


def main() -> None:
    save = tempfile.mkdtemp(prefix="save-cache-")
    args = trainer.build_parser().parse_args(
        ["--bf16", "--use-distributed-optimizer", "--train-iters", "16", "--num-layers", "2", "--save", save,
         "--save-interval", "1", "--use-datastates", "--datastates-host-cache-size", "0.25"])
    trainer.initialize_distributed(args)
    model, config = trainer.build_model(args)
    optimizer, scheduler = trainer.build_optimizer(args, model, config)
    checkpointing.set_args(args)
    inner = optimizer.chained_optimizers[0].optimizer
    saved: list = []

    _save(0, model, optimizer, scheduler, args, saved)  # before the first step: main params only
    for iteration in (1, 2, 3):  # the first step adds Adam's moments: a new structure, then the same again
        trainer.train_step(args, iteration, model, optimizer, scheduler)
        _save(iteration, model, optimizer, scheduler, args, saved)
    reuses = [r for _, _, r, _ in saved]
    kept = [k for _, _, _, k in saved]
    assert kept[1] is not kept[0] and kept[2] is kept[1] and kept[3] is kept[1], "the split is kept from iteration 1"
    assert reuses[2] - reuses[1] == 1 and reuses[3] - reuses[2] == 1, reuses
    assert kept[3].whole is not None, "model state and optimizer leaves kept: the split is taken unwalked"

    # Another tensor object of the same shape in an optimizer state: saved from the new one.
    param = inner.param_groups[0]["params"][0]
    inner.state[param]["exp_avg"] = torch.full_like(inner.state[param]["exp_avg"], 0.5)
    trainer.train_step(args, 4, model, optimizer, scheduler)
    _save(4, model, optimizer, scheduler, args, saved)
    assert saved[-1][3] is not kept[3], "a replaced optimizer tensor: the split is made again"

    # A moment kept in another dtype: another shard name, so another set of shards (ownership planned again).
    inner.state[param]["exp_avg_sq"] = inner.state[param]["exp_avg_sq"].to(torch.float64)
    try:
        _save(5, model, optimizer, scheduler, args, saved)
        raise AssertionError("an fp64 moment is refused by the full path, as before")
    except Exception as exc:  # noqa: BLE001 - the full path's own refusal, not a stale reuse
        assert "float64" in str(exc), exc
    inner.state[param]["exp_avg_sq"] = inner.state[param]["exp_avg_sq"].to(torch.float32)

    # A model parameter's memory replaced by another of the same shape (``.data =``): the full path.
    chunk = core_state.unwrap(model)[0]
    weight = next(p for p in chunk.parameters() if p.dim() == 2)
    weight.data = weight.data.clone() + 1
    before = saved[-1][3]
    _save(6, model, optimizer, scheduler, args, saved)
    assert saved[-1][3] is not before
    trainer.train_step(args, 7, model, optimizer, scheduler)
    _save(7, model, optimizer, scheduler, args, saved)
    assert saved[-1][3] is saved[-2][3], "the same structure again: kept"

    # Saves 0-4, 6, 7 (5 was refused): the model state is kept from the first save until the parameter moved.
    assert all(models[i] is models[0] for i in range(1, 5)), "the model state is kept from the first save"
    assert models[6] is models[5] and models[5] is not models[4], "a parameter in new memory: the model state anew"

    # A buffer (as the routers' expert bias): its value at each save, while the model state is kept.
    chunk.decoder.register_buffer("probe_bias", torch.zeros(4))
    for iteration, value in ((8, 1.0), (9, 2.0)):
        trainer.train_step(args, iteration, model, optimizer, scheduler)
        chunk.decoder.probe_bias.fill_(value)
        _save(iteration, model, optimizer, scheduler, args, saved)
    assert models[-1] is models[-2] and models[-2] is not models[-3], "a new buffer: anew, then kept"
    chunk.decoder.probe_bias.fill_(9.0)  # after the save: the next step's value, not the saved one
    chunk.decoder.probe_bias.resize_(6).fill_(3.0)  # resized in place: another structure
    _save(10, model, optimizer, scheduler, args, saved)
    assert models[-1] is not models[-2]

    # Extra state: None at first (megatron-core's own layers), then a value taken anew at each save.
    probe = ExtraState()
    chunk.decoder.layers[0].probe = probe
    _save(11, model, optimizer, scheduler, args, saved)
    probe.value = 1.5  # a module that answered None answers a value: anew
    _save(12, model, optimizer, scheduler, args, saved)
    assert models[-1] is not models[-2]
    probe.value = 2.5  # a new value of a kept state
    trainer.train_step(args, 13, model, optimizer, scheduler)
    _save(13, model, optimizer, scheduler, args, saved)
    assert models[-1] is models[-2]
    got = [o for o in saved[-1][1]["objects"].values() if isinstance(o, dict)]
    assert got == [{"scale": 2.5}], got

    # A new parameter (the optimizer does not know it): saved from the model, the state anew.
    chunk.decoder.final_layernorm.register_parameter("probe_scale", torch.nn.Parameter(torch.full((4,), 7.0)))
    _save(14, model, optimizer, scheduler, args, saved)
    assert models[-1] is not models[-2]
    assert any(k.endswith("probe_scale@0") or "probe_scale" in k for k in saved[-1][1]["tensors"]), \
        sorted(saved[-1][1]["tensors"])[:5]

    _check(args, saved)
    print(f"save cache: {len(saved)} checkpoints exact, engine plans reused {saved[-1][2]} times", flush=True)
    checkpointing.shutdown()
    dist.destroy_process_group()
    shutil.rmtree(save)  # 16 checkpoints of the model: not left in the temp dir


if __name__ == "__main__":
    sys.exit(main())
