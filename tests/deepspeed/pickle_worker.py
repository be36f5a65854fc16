"""One real DeepSpeed rank on the CPU (ZeRO-1) that saves or loads through ``datastates_ckpt``.

``save DIR OUT.json CONFIG_JSON REF.pt [note]``: 2 steps, ``save_checkpoint`` (client state with
a ``RunNote`` if ``note``), committed durably at ``destroy``; REF.pt holds every module and
optimizer value as it was saved. ``load DIR OUT.json CONFIG_JSON REF.pt``: a model from another
seed, ``load_checkpoint``; OUT.json says whether it loaded, the error if not, and whether every
value equals REF.pt bit for bit. CONFIG_JSON is the ``datastates_ckpt`` section. The test starts
it as rank 0 of a world of 1 (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import atexit
import enum
import json
import os
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from helpers.client_objects import RunNote  # noqa: E402
from helpers.states import assert_same  # noqa: E402
from megatron_ext.testing.deepspeed_harness import TinyModel, batch, ds_config, parse_args  # noqa: E402


def plain(value):
    """``value`` with every object replaced by its class name and fields: comparable with ``assert_same``."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {repr(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "__dict__"):
        return {"$class": f"{type(value).__module__}.{type(value).__qualname__}", **plain(vars(value))}
    return repr(value)


def engine_values(engine) -> dict:
    return {"module": plain(engine.module.state_dict()), "optimizer": plain(engine.optimizer.state_dict())}


def build(section: dict, seed: int):
    import deepspeed

    args = parse_args(["--zero-stage", "1", "--steps", "2", "--save-dir", "-", "--engine", "datastates",
                       "--seed", str(seed)])
    config = ds_config(args)
    config["datastates_ckpt"] = section
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = TinyModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def main(mode: str, save_dir: str, out: str, section_json: str, reference: str, *extra: str) -> int:
    torch.set_num_threads(1)
    section = json.loads(section_json)
    result: dict = {"ok": False}
    if mode == "save":
        engine = build(section, seed=1234)
        for step in (1, 2):
            x, y = batch(1234, step, 0)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        client = {"harness_step": 2, **({"note": RunNote("saved by step 2", 2)} if "note" in extra else {})}
        engine.save_checkpoint(save_dir, client_state=client)
        torch.save(engine_values(engine), reference)
        engine.destroy()  # DeepSpeed's clean-up: the adapter's wait(persist=True), durable with commit_wait
        result["ok"] = True
    else:
        engine = build(section, seed=99)  # other initial weights: only the load can make them equal
        try:
            path, client = engine.load_checkpoint(save_dir)
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            result.update(error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
        else:
            result.update(ok=path is not None, harness_step=client.get("harness_step"),
                          note=repr(client["note"]) if "note" in client else None,
                          note_is_run_note=isinstance(client.get("note"), RunNote))
            try:
                assert_same(engine_values(engine), torch.load(reference, weights_only=True))
                result["bit_exact"] = True
            except AssertionError as exc:
                result["bit_exact"] = False
                result["difference"] = str(exc)
        engine.destroy()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    rc = main(*sys.argv[1:])
    atexit._run_exitfuncs()  # the engines' exit commits, while threads can still start (as the harness does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
