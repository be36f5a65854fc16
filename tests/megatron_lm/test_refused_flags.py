"""Megatron-LM (core_v0.19.0) features ``--use-datastates`` refuses, through Megatron-LM's own parser.

Each command line goes through the patched checkout's ``parse_args`` and ``validate_args`` (patch
0001 runs the datastates checks first), so the flags are the real ones and a rename upstream fails
here. One interpreter runs every case: importing ``megatron.training`` takes most of the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.procs import REPO

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--train-iters", "10", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--mock-data", "--save-interval", "1", "--transformer-impl", "local", "--use-datastates",
        "--datastates-host-cache-size", "0.01"]

#: name -> (extra flags, text the one error must contain; None: the datastates checks accept it)
CASES = {
    "optimizer_cuda_graph": (["--optimizer-cuda-graph"], "--optimizer-cuda-graph captures optimizer.step"),
    "muon_layer_wise": (["--optimizer", "muon", "--use-distributed-optimizer"],
                        "--optimizer muon with --use-distributed-optimizer is megatron-core's layer-wise"),
    "lion_layer_wise": (["--optimizer", "lion", "--use-distributed-optimizer"],
                        "--optimizer lion with --use-distributed-optimizer is megatron-core's layer-wise"),
    "soap": (["--optimizer", "soap"], "--optimizer soap: --use-datastates saves the state of adam, sgd, lion only"),
    "gtp_weight_remat": (["--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "4"],
                         "generalized tensor parallelism"),
    "mxfp8_grad_buffer_reuse": (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                 "--reuse-grad-buf-for-mxfp8-param-ag"],
                                "--reuse-grad-buf-for-mxfp8-param-ag with --overlap-param-gather"),
    "interleaved_offload_alone": (["--datastates-interleaved-offload"],
                                  "--datastates-interleaved-offload steps megatron-core's offloaded optimizer: "
                                  "it needs --optimizer-cpu-offload"),
    "interleaved_offload_fraction": (["--datastates-interleaved-offload", "--optimizer-cpu-offload",
                                      "--optimizer-offload-fraction", "0.5"],
                                     "drop --optimizer-offload-fraction 0.5"),
    "interleaved_offload": (["--datastates-interleaved-offload", "--optimizer-cpu-offload",
                             "--use-precision-aware-optimizer", "--use-distributed-optimizer"], None),
    # Only s3:// is an object store here; another scheme would be made a local directory named "gs:".
    "save_gs": (["--save", "gs://bucket/run1"], "--save 'gs://bucket/run1' is a gs:// URL; the object-store level "
                                                "takes s3://bucket/prefix"),
    # Megatron-LM writes progress.txt under --save through the file system: refused with an s3:// --save.
    "save_s3_log_progress": (["--save", "s3://bucket/run1", "--log-progress"],
                             "--log-progress: Megatron-LM writes progress.txt under --save through the file system"),
    "load_msc": (["--load", "msc://profile/run1"], "--load 'msc://profile/run1' is a msc:// URL"),
    # NVRx's local checkpoints would be a second, unsynchronised node-local copy: the engine has its own level.
    "nvrx_local_checkpoints": (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/tmp/x"],
                               "--non-persistent-ckpt-type local (nvidia-resiliency-ext's local checkpoints) is "
                               "replaced by --use-datastates' own node-local level: drop it and pass "
                               "--datastates-local-dir DIR"),
    "nvrx_local_checkpoints_with_interval": (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval",
                                              "2"], "--datastates-local-dir DIR"),
    "non_persistent_global": (["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "2"], None),
    # Megatron-LM's torch_dist plan cache: --use-datastates' saves and loads do not go through it (no effect).
    "constant_structure": (["--ckpt-assume-constant-structure"], None),
    # MSC routes Megatron-LM's own file access (data included); checkpoints on file-system paths are the engine's.
    "enable_msc": (["--enable-msc"], None),
    "enable_msc_url": (["--enable-msc", "--save", "msc://profile/run1"], "--save 'msc://profile/run1' is a msc:// URL"),
    "lion_plain": (["--optimizer", "lion"], None),
    "adam_distributed": (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], None),
    # The flags generated from EngineConfig's fields, and the earlier spellings kept as aliases, parse in
    # Megatron-LM's own parser (a parse error ends the interpreter: the test fails).
    "engine_key_flags": (["--datastates-persist-timeout-s", "60", "--no-datastates-flush-process",
                          "--datastates-o-direct", "auto", "--datastates-chunk-size-mb", "4"], None),
    "earlier_spellings": (["--datastates-timeout", "60", "--datastates-flush-in-process"], None),
}

CODE = r"""
import json, sys
from megatron.training.arguments import parse_args, validate_args
base, cases, save = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
out = {}
for name, (extra, _) in cases.items():
    sys.argv = ["pretrain_gpt.py", *base, "--save", save, *extra]
    args = parse_args()
    args.rank, args.world_size = 0, 4
    try:
        validate_args(args, {})
        out[name] = None
    except ValueError as exc:
        out[name] = str(exc) if "invalid datastates configuration" in str(exc) else None
    except Exception:
        out[name] = None  # Megatron-LM's own checks, after the datastates ones passed
print(json.dumps(out))
"""

GRID = r"""
import itertools, json
from argparse import Namespace
from megatron.training.training import should_disable_forward_pre_hook
from megatron_ext.megatron.param_gather import deferred_param_gather
names = ["use_megatron_fsdp", "skip_train", "perform_rl_step", "no_load_optim", "use_distributed_optimizer",
         "use_layer_wise_distributed_optimizer", "overlap_param_gather"]
differ = [dict(zip(names, v)) for v in itertools.product([False, True], repeat=len(names))
          if should_disable_forward_pre_hook(Namespace(**dict(zip(names, v))))
          != deferred_param_gather(Namespace(**dict(zip(names, v))))]
print(json.dumps(differ))
"""


def _python(checkout, code: str, *argv: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(checkout), str(REPO)]))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, *argv], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_unsupported_megatron_features_are_refused_by_name(checkout, tmp_path):
    got = json.loads(_python(checkout, CODE, json.dumps(BASE), json.dumps(CASES), str(tmp_path / "save")))
    for name, (_, message) in CASES.items():
        if message is None:
            assert got[name] is None, (name, got[name])
        else:
            assert got[name] is not None and message in got[name], (name, got[name])


def test_the_deferred_param_sync_follows_megatron_lms_condition(checkout):
    """patch 0004 skips ``force_param_sync`` exactly when Megatron-LM's ``should_disable_forward_pre_hook``
    says so; ``deferred_param_gather`` must then gate the copies: the two agree on every combination."""
    assert json.loads(_python(checkout, GRID)) == []
