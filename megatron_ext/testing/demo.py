"""Engine demo: a toy model trained with a checkpoint every step, then resumed from the newest one.

Shows the three calls a training loop needs (``save`` after the step, ``wait_snapshot`` right
before the next optimizer step, ``commit``) and checks that the resumed run's losses equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import time

import torch

from megatron_ext.engine import CheckpointEngine, list_committed

log = logging.getLogger(__name__)


def _model_and_optimizer(seed: int = 1234):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(64, 256, generator=gen)
    return x, torch.sin(x)


def train(steps: range, model, optimizer, engine: CheckpointEngine | None) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if engine is not None:
            engine.wait_snapshot()  # the previous checkpoint must be in the cache before the update
        optimizer.step()
        losses.append(loss.item())
        if engine is not None:
            name = f"step_{step + 1:07d}"
            engine.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                        name, version=step + 1)
            engine.commit(name)
    return losses


def main(args) -> int:
    as_json = args.json
    say = functools.partial(print, file=sys.stderr if as_json else sys.stdout)  # --json: stdout holds the JSON alone
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    cfg = {"host_cache_size": args.host_cache_size, "save_dir": out}
    half = args.steps // 2

    model, optimizer = _model_and_optimizer()
    reference = train(range(args.steps), model, optimizer, None)
    say(f"[demo] reference: trained steps 1-{args.steps} without checkpoints")

    model, optimizer = _model_and_optimizer()
    start = time.perf_counter()
    with CheckpointEngine(cfg, rank=0, world_size=1) as engine:
        first = train(range(half), model, optimizer, engine)
        blocked = sum(r.get("blocked_s", 0) for r in engine.telemetry.records if r["event"] == "snapshot")
    say(f"[demo] run 1: trained steps 1-{half} of {args.steps} with a checkpoint after every step "
          f"(step_0000001 ... step_{half:07d} in {out}) in {time.perf_counter() - start:.2f}s, training blocked "
          f"{blocked:.4f}s in all; then it stops, as a job that is killed or ends its allocation")

    model, optimizer = _model_and_optimizer(seed=999)  # different init: the checkpoint must overwrite it
    with CheckpointEngine(cfg, rank=0, world_size=1) as engine:
        latest = engine.latest()
        state = engine.load(latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        say(f"[demo] run 2: resumed from {os.path.join(out, latest)} (step {state['step']}, read from the "
              f"{engine.last_load_level} level), training steps {state['step'] + 1}-{args.steps}")
        rest = train(range(state["step"], args.steps), model, optimizer, engine)
    newest = list_committed(out)[-1][0]  # the engine's exit committed the last ones
    resumed = first + rest
    same = [a.hex() == b.hex() for a, b in zip(reference, resumed)]
    say(f"[demo] losses of runs 1 + 2 equal the uninterrupted run's bit for bit: {all(same)}")
    say(f"[demo] checkpoints: {out} (step_0000001 ... {newest}); look at them with `megatron-ext inspect {out}`, "
          f"`megatron-ext verify {out}`, `megatron-ext export {out} --to safetensors {out}-weights`")
    ok = all(same) and len(resumed) == len(reference)
    if as_json:
        print(json.dumps({"ok": ok, "steps": args.steps, "stopped_after": half, "resumed_from": latest,
                          "resumed_from_step": state["step"], "newest": newest, "checkpoints": out,
                          "blocked_s": blocked, "losses_bit_identical": all(same)}, indent=1))
    return 0 if ok else 1
