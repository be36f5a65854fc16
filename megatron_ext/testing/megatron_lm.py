"""Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks (gloo): the real training loop, for tests.

    torchrun ... -m megatron_ext.testing.megatron_lm [--checkout DIR] [--record FILE]
        [--kill-at-iteration N] [--sigterm-at-iteration N] [--expire-duration-at-iteration N]
        [--exit-at-iteration N] [--record-logits DIR] [--record-ft FILE] [--record-save-cpu FILE]
        -- <pretrain_gpt.py arguments>

or the same under nvidia-resiliency-ext's ``ft_launcher`` (``torchrun_command(ft_launcher=[...])``).

The script runs in-process, unchanged, from a patched checkout of the pin (``find_checkout``).
What a CPU run of ``megatron/training`` needs beyond the megatron-core emulation layer
(``megatron_ext.testing.cpu_emulation``), each found by running it:

* ``initialize_megatron(allow_no_cuda=True)``;
* a device count of 1 (with 0 Megatron skips model-parallel initialisation and seeding) and a
  no-op ``set_device``; zero CUDA memory statistics (``report_memory``, ``training_log``);
* (CPU stand-ins for CUDA streams and events are the emulation layer's: DDP is built on a side
  stream in ``get_model``, ``start_grad_sync`` asks for the current stream, the MoE token dispatcher
  records events on its own);
* a GPU architecture answer for ``validate_args`` (it asks when TP > 1);
* no compilation at start-up: the dataset helpers are the megatron-core wheel's prebuilt
  ``helpers_cpp`` (the wheel's ``megatron.core`` is imported; its code is the pin's);
* the CPU generator's state kept across the data loaders' construction: on a CPU, dropout's
  "CUDA" generator *is* the CPU generator, so the seed draw made there would change a resumed
  run's dropout; on a GPU it never touches dropout;
* Megatron-LM's own torch_dist load of the distributed optimizer made to work with torch's Adam
  (``_native_loads_torch_adam``), and under ``torch.no_grad`` (an fp32 load fails otherwise);
* MoE's all-to-all split sizes handed over as lists (``_split_sizes_as_lists``), and its metrics'
  default device the GPU run's (``_moe_metrics_on_the_device``);
* ``--async-save``'s persistent checkpoint worker (a ``forkserver`` process, which none of these
  answers reach) given those its loop needs (``testing/async_save_worker.py``): it starts with
  ``torch.cuda.set_device(rank % torch.cuda.device_count())``;
* megatron-core's ``fully_reshardable`` optimizer load made to work with torch's Adam
  (``_torch_adam_loads_fully_reshardable``);
* ``--optimizer-cpu-offload`` (``_hybrid_optimizer_on_cpu``): the optimizer's parameters count as
  the device's when the hybrid device optimizer sorts them, so its sub-optimizers, host copies and
  copy-back hooks are those of a GPU run; pinning is plain memory; and the precision-aware
  optimizer's check of the Transformer Engine version answers "none" (megatron-core compares
  ``None`` with a version there).

Megatron-LM's interleaved schedule with overlapped p2p communication (required at PP = 2) is not
deterministic over gloo here (a run without checkpoints differs from run to run, even NaN): the
interleaved tests run PP = 4 with ``--no-overlap-p2p-communication``.

* Megatron-LM's default process group as on a GPU node, ``--distributed-backend nccl``: its
  ``nccl`` is ``megatron_ext.testing.emulated_nccl``'s group, which refuses every collective on a
  tensor that would live in host memory on a GPU node, as NCCL does, and runs the rest on gloo.
  Megatron-LM's explicit gloo groups stay gloo. ``--distributed-backend gloo`` still gives a
  plain gloo default group.

CPU flags the runs pass: ``--distributed-backend nccl --transformer-impl local
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion --num-workers 0`` (``CPU_FLAGS``).
``--num-workers 0``: the data loaders' worker processes are forked, and a CPython without the
fix of cpython gh-112275 (this machine's 3.12.1 predates it) can deadlock the forked child when, at that
instant, another thread is creating its Python thread state: the child waits for the
interpreter's head lock. Here that thread is a torch gloo work thread entering Python. One such
hang was seen (2026-11-25, a fine-tuning test): a worker stuck in ``PyOS_AfterFork_Child``, and
rank 0 waiting for its first batch. Data loading is not under test, and the batches do not depend
on the number of workers.

Recording: the rank that holds the last pipeline stage at tensor- and data-parallel rank 0
appends one JSON line per training step, ``{"iteration", "loss", "grad_norm", "skipped", "lr",
"loss_scale"}``, with the exact float values (Megatron's printed ``lm loss`` averages over the
log interval, so it cannot be compared bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import inspect
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
FETCH_SCRIPT = REPO / "scripts" / "fetch_megatron.sh"


def _read_pin() -> tuple[str, str]:
    """(commit, tag) of the pinned Megatron-LM, from ``scripts/megatron_pin.sh``: the one place it is written."""
    text = (REPO / "scripts" / "megatron_pin.sh").read_text()
    values = dict(re.findall(r"^(MEGATRON_PIN_COMMIT|MEGATRON_PIN_TAG)=(\S+)$", text, flags=re.M))
    return values["MEGATRON_PIN_COMMIT"], values["MEGATRON_PIN_TAG"]


PIN, PIN_TAG = _read_pin()
HOW_TO_GET = ("Megatron-LM checkout not available: run `MEGATRON_LM_DIR=<a checkout or git mirror of "
              "NVIDIA/Megatron-LM> scripts/fetch_megatron.sh` once")
CPU_FLAGS = ["--distributed-backend", "nccl", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-persist-layer-norm", "--no-rope-fusion", "--num-workers", "0"]
# A GPT small enough for 2 CPU cores: mock data, no tokenizer files, no evaluation.
TINY_GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--lr-decay-iters", "16",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234"]

# What makes TINY_GPT a Llama-style model (gated MLP, RMSNorm, rotary, grouped-query attention,
# untied embeddings, no biases), as the models users train.
LLAMA_STYLE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
               "--disable-bias-linear"]


# ---------------------------------------------------------------------------- the checkout
def cache_dir() -> Path:
    """Where ``scripts/fetch_megatron.sh`` keeps the patched checkout of the pin."""
    root = os.environ.get("MEGATRON_EXT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_ext")
    return Path(root) / f"Megatron-LM-{PIN[:7]}"


def find_checkout(timeout_s: float = 600) -> tuple[Path | None, str]:
    """The patched checkout of the pin, brought up to date with the current patch series.

    Returns ``(path, "")`` or ``(None, reason)``. Runs ``fetch_megatron.sh``, which is a no-op
    when the cached checkout already carries the current series, re-patches it when the series
    changed, creates it from ``MEGATRON_LM_DIR`` when set, and otherwise tries to clone.
    """
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
    try:
        proc = subprocess.run(["bash", str(FETCH_SCRIPT)], capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"{HOW_TO_GET} (fetch_megatron.sh timed out)"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{HOW_TO_GET} ({last})"
    return Path(proc.stdout.strip().splitlines()[-1]), ""


# ---------------------------------------------------------------------------- CPU answers
def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _patch_cuda_queries() -> None:
    cuda = torch.cuda
    cuda.device_count = lambda: 1
    # Still no CUDA: with PYTORCH_NVML_BASED_CUDA_CHECK=1 (DeepSpeed sets it at import, and children
    # inherit it) a CUDA build of torch answers is_available() from device_count(), and torch's own
    # optimizers would then ask the (absent) driver for the current stream.
    cuda.is_available = lambda: False
    cuda.set_device = lambda device: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, _zero)
    cuda.memory_stats = lambda device=None: {}
    cuda.reset_peak_memory_stats = lambda device=None: None


def _split_sizes_as_lists() -> None:
    """MoE's all-to-all gets its split sizes as host numpy arrays on a GPU; on a CPU they stay tensors.

    (``maybe_move_tensor_to_cpu(as_numpy=True)`` converts only CUDA tensors), which the collective's
    binding rejects: the sizes are handed over as lists, as the GPU run's numpy arrays are read.
    """
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args: Any,
                          **kwargs: Any):
        sizes = [s.tolist() if isinstance(s, torch.Tensor) else s for s in (output_split_sizes, input_split_sizes)]
        return inner(output, input, *sizes, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def _torch_adam_loads_fully_reshardable() -> None:
    """megatron-core 0.19.0's ``fully_reshardable`` load copies every per-parameter state entry, but
    the loaded entries leave out torch Adam's ``step`` (a fused Adam on GPUs has none): ``step`` is
    set aside during the copy; ``_native_loads_torch_adam`` restores it from the param groups after."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return inner(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return inner(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _keep_cpu_generator(build: Callable) -> Callable:
    def build_keeping_generator(*args: Any, **kwargs: Any):
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    return build_keeping_generator


def _patch_megatron_training() -> None:
    from megatron.training import arguments, checkpointing, training

    from megatron_ext.testing import async_save_worker

    inner_initialize = training.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any):
        kwargs["allow_no_cuda"] = True
        return inner_initialize(*args, **kwargs)

    training.initialize_megatron = initialize_megatron
    # Warm-up compiles the fused kernels with torch.compile and draws from the "CUDA" generator,
    # which on a CPU is the one dropout uses; the CPU flags switch those fusions off anyway.
    training.set_jit_fusion_options = lambda *args, **kwargs: None  # called with tp_size=
    arguments.get_device_arch_version = lambda: 8  # asked by validate_args when TP > 1
    training.build_train_valid_test_data_iterators = _keep_cpu_generator(training.build_train_valid_test_data_iterators)
    # Both names: training.py imported the function, and megatron_ext hands Megatron-format
    # checkpoints back to the module's.
    training.load_checkpoint = checkpointing.load_checkpoint = _native_loads_torch_adam(checkpointing.load_checkpoint)
    _split_sizes_as_lists()
    _torch_adam_loads_fully_reshardable()
    _hybrid_optimizer_on_cpu()
    _moe_metrics_on_the_device()
    async_save_worker.install()


def _moe_metrics_on_the_device() -> None:
    """MoE's metrics tracker puts a metric a rank has not seen yet (after a resume, on a stage without
    MoE layers) on the current CUDA device when ``torch.cuda.is_available()``, else on ``cpu``: on a GPU
    node the former, which the CPU run answers with "cuda" (the device mode maps it), so that its
    all-reduce over NCCL is the GPU run's (the emulated NCCL refuses a host tensor, as NCCL does)."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    inner = MoEMetricsTracker.ensure_initialized

    def ensure_initialized(self: Any, name: str, num_layers: int, device: Any = None) -> None:
        return inner(self, name, num_layers, "cuda" if device is None else device)

    MoEMetricsTracker.ensure_initialized = ensure_initialized


def _patch_megatron_any_device() -> None:
    """What the harness changes on GPUs too: no compilation at start-up."""
    from megatron.training import initialize

    # The dataset helpers are the megatron-core wheel's prebuilt helpers_cpp (building them needs
    # make and pybind11); the fused kernels are switched off by the harness's flags.
    initialize._compile_dependencies = lambda: None


def _hybrid_optimizer_on_cpu() -> None:
    """``HybridDeviceOptimizer`` on CPU ranks, structured as on a GPU.

    It offloads a fraction of the *device* parameters (``is_cuda``) to host copies stepped by a
    CPU optimizer, the rest stepped in place by the "GPU" optimizer; on CPU ranks no parameter is a
    device one, and it would offload none and then miss the copies it expects. While it sorts its
    parameters they count as the device's (``cpu_emulation.as_device_tensors``); its copies do not.
    """
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from megatron_ext.testing.cpu_emulation import as_device_tensors

    if utils.get_te_version() is None:  # no Transformer Engine: not "at least 2.1"
        optimizer_config.is_te_min_version = lambda version, check_equality=True: False
    inner = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def sort_params(self, offload_fraction):
        with as_device_tensors([p for group in self.param_groups for p in group["params"]]):
            return inner(self, offload_fraction)

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = sort_params


def _native_loads_torch_adam(load_checkpoint: Callable) -> Callable:
    """Megatron-LM's own torch_dist load of the distributed optimizer, on torch's Adam (no TE or Apex).

    GPU runs use a fused Adam and never take this path. With torch's Adam, megatron-core builds
    the load template from ``state_dict()``, which asserts over Adam state that a fresh optimizer
    does not have yet, and after the load every parameter shares one ``step`` reset to 0. So the
    state is allocated before (only when optimizer state will be loaded: allocating runs a
    zero-gradient step, whose weight decay moves the main params), and each parameter's step is
    restored from its param group after.
    """
    from megatron.training import checkpointing, get_args

    from megatron_ext.megatron import optimizer_load

    def load(ddp_model, optimizer, *args: Any, **kwargs: Any):
        megatron_args = get_args()
        native = not getattr(megatron_args, "use_datastates", False)
        loads_optimizer = (native and optimizer is not None and checkpointing.checkpoint_exists(megatron_args.load)
                           and not megatron_args.no_load_optim and not megatron_args.finetune)
        if loads_optimizer:
            optimizer_load.ensure_state(optimizer)
        # megatron-core (found at 0.16.1, kept since) copies loaded fp32 state into the distributed
        # optimizer's main params, which in fp32 are views of the model's own parameters, with
        # autograd on: that fails on any device; a load needs no autograd.
        with torch.no_grad() if native else contextlib.nullcontext():
            result = load_checkpoint(ddp_model, optimizer, *args, **kwargs)
        if loads_optimizer:
            optimizer_load.restore_adam_steps(optimizer)
        return result

    return load


# ---------------------------------------------------------------------------- recording, killing
def _rows_written_at_exit(path: str) -> list[dict]:
    """A list whose rows this rank writes to ``path.<rank>`` as JSON lines when its process exits
    (the recorders' output: one file per rank, no rank waits for another)."""
    import atexit

    rows: list[dict] = []

    def write() -> None:
        with open(f"{path}.{os.environ.get('RANK', '0')}", "w") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)

    atexit.register(write)
    return rows


def _install_ft_recorder(path: str) -> None:
    """Every section message a rank sends its rank monitor, timed on the training thread when it is sent:
    how long a step or a save keeps the monitor waiting (``bench ft-heartbeats``)."""
    import time

    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    sent = _rows_written_at_exit(path)
    for method, action in (("start_section", "open"), ("end_section", "close")):
        def send(self, section, _inner=getattr(RankMonitorClient, method), _action=action):
            sent.append({"t": time.monotonic(), "section": section, "action": _action})
            return _inner(self, section)

        setattr(RankMonitorClient, method, send)


def _install_save_cpu_recorder(path: str) -> None:
    """The training thread's CPU seconds inside each ``save_checkpoint`` call of the loop, whichever
    format saves (``bench megatron-e2e``'s ``save_call_cpu_s``): on a GPU node that thread launches
    the kernels, so a save call's CPU is the iteration's; and the call's wall seconds and start
    (``wall_s``, ``started_at`` since the epoch: ``bench object-store``'s Megatron-LM modes, the
    training thread blocked in the call and the moment a save began)."""
    import time

    from megatron.training import training

    inner = training.save_checkpoint
    calls = _rows_written_at_exit(path)

    def save_checkpoint(iteration, *args: Any, **kwargs: Any):
        at, before, started = time.time(), time.thread_time(), time.perf_counter()
        try:
            return inner(iteration, *args, **kwargs)
        finally:
            calls.append({"iteration": iteration, "cpu_s": time.thread_time() - before,
                          "wall_s": time.perf_counter() - started, "started_at": at})

    training.save_checkpoint = save_checkpoint


def _is_recording_rank() -> bool:
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _install_recorder(path: str) -> None:
    from megatron.training import get_args, training

    inner_step = training.train_step

    def train_step(*args: Any, **kwargs: Any):
        result = inner_step(*args, **kwargs)
        loss_dict, skipped, grad_norm = result[0], result[1], result[5]
        if _is_recording_rank():
            optimizer = args[3] if len(args) > 3 else kwargs["optimizer"]
            megatron_args = get_args()
            record = {"iteration": megatron_args.curr_iteration + 1,
                      "loss": _number(loss_dict.get("lm loss")) if loss_dict else None,
                      "grad_norm": _number(grad_norm), "skipped": int(skipped),
                      "lr": optimizer.param_groups[0]["lr"], "loss_scale": _number(optimizer.get_loss_scale()),
                      "consumed_train_samples": megatron_args.consumed_train_samples}
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return result

    training.train_step = train_step


def _install_logits_recorder(directory: str) -> None:
    """Save the first forward's input tokens and logits of this rank's model, as Megatron-LM computes them.

    The first ``GPTModel.forward`` of the run (the first micro-batch of the first iteration, with
    the weights just loaded) on data-parallel rank 0: the first pipeline stage writes the tokens
    it embeds (``tokens.pt``), the last one the output layer's logits (``logits-tp<R>.pt``:
    ``[sequence, batch, this tensor rank's vocabulary slice]``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    inner = GPTModel.forward
    done = []

    def forward(self, input_ids, *args: Any, **kwargs: Any):
        if done or ps.get_data_parallel_rank() != 0:
            return inner(self, input_ids, *args, **kwargs)
        done.append(True)
        os.makedirs(directory, exist_ok=True)
        if self.pre_process and ps.get_tensor_model_parallel_rank() == 0:
            torch.save(input_ids.detach().cpu().clone(), os.path.join(directory, "tokens.pt"))
        hook = None
        if self.post_process:
            def save_logits(module, inputs, output) -> None:
                logits = output[0] if isinstance(output, tuple) else output
                torch.save(logits.detach().float().cpu().clone(),
                           os.path.join(directory, f"logits-tp{ps.get_tensor_model_parallel_rank()}.pt"))

            hook = self.output_layer.register_forward_hook(save_logits)
        try:
            return inner(self, input_ids, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()

    GPTModel.forward = forward


def kill_process_tree() -> None:
    """SIGKILL this process and its children, as a node failure would.

    The children are the data loader's worker processes: left alone, they outlive the rank (and
    keep its output pipes open, so whoever reads them waits forever).
    """
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _after_step(iteration: int, action: Callable[[], None]) -> None:
    """Run ``action`` on this rank right after iteration ``iteration``'s step (before its save)."""
    from megatron.training import get_args, training

    inner_step = training.train_step

    def train_step(*args: Any, **kwargs: Any):
        result = inner_step(*args, **kwargs)
        if get_args().curr_iteration + 1 == iteration:
            action()
        return result

    training.train_step = train_step


def _age_training_clock() -> None:
    """Make Megatron-LM's training clock read a day older: ``--exit-duration-in-mins`` expires now."""
    from megatron.training import training

    training._TRAIN_START_TIME -= 24 * 3600


def _install_killer(iteration: int, committed_before: int | None = None, save_dir: str | None = None) -> None:
    """SIGKILL this rank once iteration ``iteration`` is trained and its save (if any) was called.

    With ``committed_before``, that save is called only once the tracker under ``save_dir`` names
    that iteration or a later one (``commit_wait``). Every rank reads the tracker itself: a
    collective there would meet Megatron-LM's own.
    """
    from megatron.training import training

    from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
    from megatron_ext.testing.commit_wait import await_tracker

    inner = training.checkpoint_and_decide_exit

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, it, *args: Any, **kwargs: Any):
        if it == iteration and committed_before is not None:
            await_tracker(os.path.join(save_dir, TRACKER_FILE), committed_before, int)
        decision = inner(model, optimizer, opt_param_scheduler, it, *args, **kwargs)
        if it == iteration:
            kill_process_tree()
        return decision

    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit


class InjectedFault(RuntimeError):
    """What ``--inprocess-fault-at-iteration`` raises inside the training function."""


def _install_inprocess_restart(iteration: int) -> None:
    """Megatron-LM's in-process restart without nvidia-resiliency-ext, whose health check and abort
    need CUDA: every rank raises ``InjectedFault`` right after iteration ``iteration``'s save call;
    the process groups are destroyed (NVRx's ``AbortTorchDistributed``) and Megatron-LM's global
    state with them (``inprocess_restart.destroy_state``, the finalize Megatron-LM gives NVRx); then
    ``pretrain`` runs again in the same processes, over a fresh prefix of one TCPStore, as
    ``maybe_wrap_for_inprocess_restart`` and ``pretrain(store=...)`` do under NVRx. The arguments
    parsed before the first attempt are set again first: core_v0.19.0's ``pretrain`` reads the
    global ones, which ``destroy_state`` cleared.
    """
    import copy
    from datetime import timedelta

    import megatron.training as training_package
    from megatron.training import global_vars, inprocess_restart, training

    inner_pretrain, inner_decide = training_package.pretrain, training.checkpoint_and_decide_exit
    attempt = [0]

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, it, *args: Any, **kwargs: Any):
        decision = inner_decide(model, optimizer, opt_param_scheduler, it, *args, **kwargs)
        if attempt[0] == 0 and it == iteration:
            raise InjectedFault(f"injected fault after iteration {it}'s save call")
        return decision

    def pretrain(*args: Any, store: Any = None, **kwargs: Any):
        parsed = copy.deepcopy(global_vars.get_args())
        base = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                          world_size=int(os.environ["WORLD_SIZE"]),
                                          is_master=int(os.environ["RANK"]) == 0, timeout=timedelta(seconds=300),
                                          wait_for_workers=True, use_libuv=True)
        try:
            return inner_pretrain(*args, store=torch.distributed.PrefixStore("0", base), **kwargs)
        except InjectedFault as fault:
            print(f"[harness] rank {os.environ['RANK']}: {fault}; restarting in this process", flush=True)
        torch.distributed.destroy_process_group()
        inprocess_restart.destroy_state()
        attempt[0] = 1
        global_vars.set_global_variables(copy.deepcopy(parsed))
        return inner_pretrain(*args, store=torch.distributed.PrefixStore("1", base), **kwargs)

    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit
    training_package.pretrain = pretrain


def _install_exit(iteration: int) -> None:
    """End the interpreter normally (``sys.exit(0)``, every rank) right after iteration ``iteration``'s
    save call: no wait, no finalize; what that save becomes is up to the engine's exit hook."""
    from megatron.training import training

    inner = training.checkpoint_and_decide_exit

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, it, *args: Any, **kwargs: Any):
        decision = inner(model, optimizer, opt_param_scheduler, it, *args, **kwargs)
        if it == iteration:
            sys.exit(0)
        return decision

    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit


def _call_before_load(hook: str) -> None:
    """Call ``hook`` (``module:function``, test or bench code) on every rank right before each ``load_checkpoint``.

    It gets Megatron-LM's parsed arguments; ``bench restore`` times a plain read inside the rank this way.
    """
    import importlib

    from megatron.training import get_args, training

    module, _, name = hook.partition(":")
    function = getattr(importlib.import_module(module), name)
    inner = training.load_checkpoint

    def load_checkpoint(*args: Any, **kwargs: Any):
        function(get_args())
        return inner(*args, **kwargs)

    training.load_checkpoint = load_checkpoint


# ---------------------------------------------------------------------------- launching
#: nvidia-resiliency-ext 0.4.1 and its dependencies, installed apart by ``scripts/bootstrap_env.sh``
#: (``requirements/nvrx.txt``): beside megatron-core 0.19 it needs ``_hide_old_nvrx_async_checkpointing``,
#: so only the runs under ``ft_launcher`` see it.
NVRX_DIR = Path(sys.prefix) / "nvrx"


def nvrx_missing() -> str | None:
    """Why the fault-tolerance runs cannot start here, or None."""
    if not (NVRX_DIR / "nvidia_resiliency_ext" / "fault_tolerance").is_dir():
        return f"nvidia-resiliency-ext is not installed in {NVRX_DIR} (scripts/bootstrap_env.sh puts it there)"
    return None


def environment(base: dict | None = None, gpu: bool = False, nvrx: bool = False) -> dict:
    """The environment of a run: one thread per rank, what TP > 1 asks of a GPU run; no GPU unless ``gpu``;
    nvidia-resiliency-ext importable with ``nvrx``."""
    env = dict(os.environ if base is None else base)
    paths = (str(REPO), str(NVRX_DIR) if nvrx else "", env.get("PYTHONPATH", ""))
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def torchrun_command(nproc: int, megatron_args: list[str], checkout: Path, record: str | None = None,
                     kill_at: int | None = None, sigterm_at: int | None = None,
                     expire_at: int | None = None, late_copies: bool = False,
                     committed_before_kill: int | None = None, before_load: str | None = None,
                     script: str = "pretrain_gpt.py", exit_at: int | None = None,
                     record_logits: str | None = None, inprocess_fault_at: int | None = None,
                     ft_launcher: list[str] | None = None, record_ft: str | None = None,
                     record_save_cpu: str | None = None) -> list[str]:
    """torchrun on this machine running ``script`` (``pretrain_gpt.py``) of ``checkout`` through this harness;
    with ``ft_launcher`` (its own options, e.g. ``--ft-rank-section-timeouts ...``) nvidia-resiliency-ext's
    launcher instead, whose rank monitors watch the ranks (run it with ``environment(nvrx=True)``)."""
    from megatron_ext.procs import torchrun_command as torchrun

    harness = ["-m", "megatron_ext.testing.megatron_lm", "--checkout", str(checkout)]
    if script != "pretrain_gpt.py":
        harness += ["--script", script]
    if record is not None:
        harness += ["--record", str(record)]
    if kill_at is not None:
        harness += ["--kill-at-iteration", str(kill_at)]
    if committed_before_kill is not None:
        harness += ["--committed-before-kill", str(committed_before_kill)]
    if sigterm_at is not None:
        harness += ["--sigterm-at-iteration", str(sigterm_at)]
    if expire_at is not None:
        harness += ["--expire-duration-at-iteration", str(expire_at)]
    if exit_at is not None:
        harness += ["--exit-at-iteration", str(exit_at)]
    if late_copies:
        harness += ["--late-copies"]
    if before_load is not None:
        harness += ["--before-load", before_load]
    if record_logits is not None:
        harness += ["--record-logits", str(record_logits)]
    if inprocess_fault_at is not None:
        harness += ["--inprocess-fault-at-iteration", str(inprocess_fault_at)]
    if record_ft is not None:
        harness += ["--record-ft", str(record_ft)]
    if record_save_cpu is not None:
        harness += ["--record-save-cpu", str(record_save_cpu)]
    cmd = torchrun(nproc, *harness, "--", *CPU_FLAGS, *megatron_args)
    if ft_launcher is not None:  # the same options: ft_launcher is torchrun's launcher with the monitors added
        cmd[1:3] = ["-m", "nvidia_resiliency_ext.fault_tolerance.launcher", *ft_launcher]
    return cmd


def read_records(path: str | Path) -> list[dict]:
    """The recorded steps, in the order they ran (a resumed run repeats the iterations it redoes)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_first_forward(directory: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``--record-logits DIR`` saved: the tokens ``[batch, sequence]`` and the logits ``[batch, sequence,
    padded vocabulary]``, the tensor ranks' vocabulary slices joined."""
    directory = Path(directory)
    slices = sorted(directory.glob("logits-tp*.pt"), key=lambda p: int(p.stem.removeprefix("logits-tp")))
    if not slices or not (directory / "tokens.pt").exists():
        raise FileNotFoundError(f"{directory}: no recorded first forward (tokens.pt, logits-tp*.pt)")
    logits = torch.cat([torch.load(p) for p in slices], dim=-1)  # [sequence, batch, vocabulary]
    return torch.load(directory / "tokens.pt"), logits.transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------- entry point
def _hide_old_nvrx_async_checkpointing() -> None:
    """Let Megatron-LM core_v0.19.0 run beside nvidia-resiliency-ext 0.4.1, the newest the registry has for
    Python 3.12 (the fault-tolerance tests' launcher and rank monitor).

    megatron-core probes NVRx's async checkpointing at import and asserts NVRx >= 0.6.0 by reading
    ``nvidia_resiliency_ext.__version__``, which 0.4.1 lacks: the import fails. Hiding that one
    subpackage makes the probe answer "no NVRx async support" (megatron-core then keeps its own
    strategies); NVRx's fault tolerance, all these tests use, stays importable. A newer NVRx is left alone.
    """
    try:
        import nvidia_resiliency_ext as nvrx
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    except ImportError:
        return
    if hasattr(nvrx, "__version__"):
        return
    sys.modules["nvidia_resiliency_ext.checkpointing.async_ckpt"] = None
    # Megatron-LM core_v0.19.0's ft_integration passes num_warmup_iters (NVRx >= 0.6: no out-of-section
    # timeout over the warm-up steps); 0.4.1 watches them too, which is only stricter.

    init = RankMonitorClient.init_workload_monitoring
    if "num_warmup_iters" not in inspect.signature(init).parameters:
        RankMonitorClient.init_workload_monitoring = lambda self, num_warmup_iters=None: init(self)


def run(script: Path, argv: list[str], record: str | None = None, kill_at: int | None = None,
        signal_at: int | None = None, expire_at: int | None = None, late_copies: bool = False,
        committed_before_kill: int | None = None, before_load: str | None = None,
        exit_at: int | None = None, record_logits: str | None = None,
        inprocess_fault_at: int | None = None, record_ft: str | None = None,
        record_save_cpu: str | None = None) -> None:
    """Run ``script`` (a checkout's ``pretrain_gpt.py``) as ``__main__`` with ``argv`` on CPU ranks."""
    from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
    from megatron_ext.testing.emulated_nccl import enable_emulated_nccl

    checkout = str(script.resolve().parent)
    # megatron.core from the wheel (with its prebuilt dataset helpers), imported first so it stays
    # the wheel's; megatron.training, gpt_builders and model_provider from the patched checkout, ahead
    # of site-packages (the megatron-core 0.19 wheel ships an unpatched megatron/training too).
    _hide_old_nvrx_async_checkpointing()
    import megatron.core  # noqa: F401

    sys.path.insert(0, checkout)
    import megatron.training

    if not str(Path(megatron.training.__file__).resolve()).startswith(str(Path(checkout).resolve())):
        raise RuntimeError(f"megatron.training comes from {megatron.training.__file__}, not from the patched "
                           f"checkout {checkout}")
    # On GPUs only the part shared with the CPU runs applies (``_patch_megatron_any_device``).
    if not torch.cuda.is_available():
        enable_cpu_emulation()
        enable_emulated_nccl()  # after the device mode: it must see the device a call asks for first
        _patch_cuda_queries()
        _patch_megatron_training()
    _patch_megatron_any_device()
    if record:
        _install_recorder(record)
    if record_logits:
        _install_logits_recorder(record_logits)
    if record_ft:
        _install_ft_recorder(record_ft)
    if record_save_cpu:
        _install_save_cpu_recorder(record_save_cpu)
    if kill_at is not None:
        _install_killer(kill_at, committed_before_kill, _checkpoint_flags(argv).save)
    if exit_at is not None:
        _install_exit(exit_at)
    if inprocess_fault_at is not None:
        _install_inprocess_restart(inprocess_fault_at)
    if signal_at is not None:  # a scheduler's SIGTERM, for --exit-signal-handler
        _after_step(signal_at, lambda: os.kill(os.getpid(), signal.SIGTERM))
    if expire_at is not None:
        _after_step(expire_at, _age_training_clock)
    if late_copies:  # every snapshot copied as late as the lazy contract allows: at the optimizer's wait
        from megatron_ext.engine import faults

        faults.hold_copies_until_wait()
    if before_load is not None:
        _call_before_load(before_load)
    if _saves_with_torch_dist(argv):
        _start_torch_dist_results_queue()
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


def _saves_with_torch_dist(argv: list[str]) -> bool:
    """Whether this run saves with Megatron-LM's own ``torch_dist`` format (the default one)."""
    flags = _checkpoint_flags(argv)
    return flags.save is not None and not flags.use_datastates and flags.ckpt_format == "torch_dist"


def _checkpoint_flags(argv: list[str]) -> argparse.Namespace:
    """``--save``, ``--use-datastates`` and ``--ckpt-format``, read as Megatron-LM's parser reads them.

    ``--flag value`` or ``--flag=value``; a flag without its value reads as absent, left for that
    parser to refuse.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--save")
    parser.add_argument("--use-datastates", action="store_true")
    parser.add_argument("--ckpt-format", default="torch_dist")
    try:
        return parser.parse_known_args(argv)[0]
    except argparse.ArgumentError:
        return argparse.Namespace(save=None, use_datastates=False, ckpt_format=None)


def _start_torch_dist_results_queue() -> None:
    """Start the queue Megatron-LM's ``torch_dist`` writer creates at its first save, before the script runs.

    The queue lives in a manager process started with ``spawn``, and a spawned child imports the
    parent's ``__main__``: at the first save that is ``pretrain_gpt.py``, which imports all of
    Megatron-LM (measured at 8 ranks on 2 cores: that save took 53 s on a slow VM and 20.6 s on a
    faster one, against 3.2 s with the queue started here). Started here, the child imports this
    module. The queue is the one the writer would have made; only the time it is made moves.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m megatron_ext.testing.megatron_lm [options] -- <pretrain_gpt.py arguments>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="megatron_ext.testing.megatron_lm", description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", help="patched Megatron-LM checkout (default: find_checkout())")
    parser.add_argument("--script", default="pretrain_gpt.py", help="training script in the checkout")
    parser.add_argument("--record", help="append one JSON line per training step here")
    parser.add_argument("--kill-at-iteration", type=int, help="SIGKILL every rank after this iteration's save call")
    parser.add_argument("--committed-before-kill", type=int, metavar="ITERATION",
                        help="with --kill-at-iteration: before that iteration's save, wait (bounded) until the "
                             "tracker under --save names this iteration or a later one, so the crash always "
                             "leaves a committed checkpoint behind")
    parser.add_argument("--sigterm-at-iteration", type=int,
                        help="send SIGTERM to every rank right after this iteration's step (--exit-signal-handler)")
    parser.add_argument("--expire-duration-at-iteration", type=int,
                        help="age the training clock a day right after this iteration's step (--exit-duration-in-mins)")
    parser.add_argument("--exit-at-iteration", type=int,
                        help="sys.exit(0) on every rank right after this iteration's save call (the engine's exit "
                             "hook is left to commit it)")
    parser.add_argument("--inprocess-fault-at-iteration", type=int,
                        help="raise a fault on every rank right after this iteration's save call, then run "
                             "pretrain again in the same processes (an in-process restart)")
    parser.add_argument("--late-copies", action="store_true",
                        help="start each checkpoint's copies only when training waits for them (right before the "
                             "optimizer step), so a tensor changed before that step is always caught")
    parser.add_argument("--before-load", metavar="MODULE:FUNCTION",
                        help="call this function with Megatron-LM's arguments on every rank right before each "
                             "load_checkpoint (test and bench code)")
    parser.add_argument("--record-logits", metavar="DIR",
                        help="save the first forward's tokens and logits (data-parallel rank 0) in DIR")
    parser.add_argument("--record-ft", metavar="FILE",
                        help="under ft_launcher: each rank writes the fault-tolerance messages it sent (section "
                             "opened or closed, with its time) to FILE.<rank> as JSON lines")
    parser.add_argument("--record-save-cpu", metavar="FILE",
                        help="each rank writes the training thread's CPU seconds in each save_checkpoint call "
                             "of the training loop (and its wall seconds and start) to FILE.<rank> as JSON lines "
                             "{iteration, cpu_s, wall_s, started_at}")
    opts = parser.parse_args(argv[:split])
    if opts.committed_before_kill is not None and (opts.kill_at_iteration is None
                                                   or _checkpoint_flags(argv[split + 1:]).save is None):
        parser.error("--committed-before-kill needs --kill-at-iteration and a --save directory")
    checkout = Path(opts.checkout) if opts.checkout else None
    if checkout is None:
        checkout, reason = find_checkout()
        if checkout is None:
            raise SystemExit(reason)
    script = checkout / opts.script
    if not script.is_file():
        raise SystemExit(f"no {opts.script} in {checkout}")
    run(script, argv[split + 1:], record=opts.record, kill_at=opts.kill_at_iteration,
        signal_at=opts.sigterm_at_iteration, expire_at=opts.expire_duration_at_iteration,
        late_copies=opts.late_copies, committed_before_kill=opts.committed_before_kill,
        before_load=opts.before_load, exit_at=opts.exit_at_iteration, record_logits=opts.record_logits,
        inprocess_fault_at=opts.inprocess_fault_at_iteration, record_ft=opts.record_ft,
        record_save_cpu=opts.record_save_cpu)


if __name__ == "__main__":
    main()
