"""The ``--use-datastates`` flags: defined here, added to Megatron-LM's parser by patch 0001.

Megatron-LM's own parser and the reference trainer both call ``add_datastates_args`` and
``validate_datastates_args``, so the flags, their help and their checks live in one place. The
flags split in two: one per engine key, generated from ``EngineConfig``'s fields
(``config.engine_flags``: name, type, unit, help and default come from the field), whose values
``engine_config_from_args`` collects, and the adapter's own (``MegatronAdapterOptions``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from megatron_ext.engine.config import EngineConfig, engine_flags, flag_name, url_refusal
from megatron_ext.engine.errors import ConfigError
from megatron_ext.engine.object_store import is_object_url, normalize
from megatron_ext.megatron.host_cache_size import AUTO
from megatron_ext.megatron.safe_classes import megatron_safe_classes


#: What ``--datastates-host-cache-size`` means here: the adapter's ``auto`` is its default.
_HOST_CACHE_HELP = ("Host (pinned) cache per rank in GiB, allocated once; snapshots wait for flushes when it is full. "
                    "'auto' (the default): this rank's checkpoint bytes (known at its first save, or from the "
                    "checkpoint a load reads) plus one chunk, at most half of the node's MemAvailable divided by "
                    "its ranks (LOCAL_WORLD_SIZE); one log line gives the figures. The engine's own host_cache_size "
                    "key takes GiB only.")


def add_datastates_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--use-datastates``, the adapter's own flags, and one flag per engine key (``engine_flags``)."""
    group = parser.add_argument_group("datastates", "lazy asynchronous multi-level checkpointing (megatron_ext)")
    group.add_argument("--use-datastates", action="store_true",
                       help="Checkpoint with megatron_ext: save only records the tensors, copies to host "
                            "memory overlap with the next forward/backward, each rank streams its own "
                            "shards to storage, and the tracker file is written once all ranks are durable. "
                            "Meant for --save-interval 1.")
    for flag in engine_flags():
        kwargs = flag.kwargs
        if flag.key == "host_cache_size":
            kwargs = dict(kwargs, type=host_cache_size, metavar="GiB|auto", help=_HOST_CACHE_HELP)
        group.add_argument(*flag.options, **kwargs)
    group.add_argument("--datastates-load-fallback", action="store_true",
                       help="If the newest committed checkpoint fails its checks on any rank (a flipped byte, a "
                            "truncated or missing file), all ranks load the next older committed one instead of "
                            "stopping.")
    group.add_argument("--datastates-allow-pickle", action="store_true",
                       help="Trust the checkpoint's pickles: Transformer Engine's fp8 extra state goes to its "
                            "modules (which unpickle it) without the check that it holds only TE's fp8 metadata. "
                            "By default each one is first decoded by a restricted unpickler and refused unless it "
                            "holds only what TE writes (docs/RELIABILITY.md, 'Threat model'). Only for checkpoints "
                            "from a source you trust: unpickling can run any code.")
    group.add_argument("--datastates-interleaved-offload", action="store_true",
                       help="With --optimizer-cpu-offload: all fp32 optimizer state on the host, each step's "
                            "update split between GPU and CPU by a measured performance model; HDO's trajectory and "
                            "checkpoints bit for bit on CPUs, its speed not measured on a GPU (docs/MEGATRON.md).")
    group.add_argument("--datastates-offload-subgroup-numel", type=int, default=None, metavar="N",
                       help="Elements per subgroup of --datastates-interleaved-offload (default 16M).")
    return parser


def flag_table_markdown() -> str:
    """docs/MEGATRON.md's table of the ``--datastates-*`` flags, made from the parser ``add_datastates_args`` builds
    (tests/test_config_declared_once.py): an engine key's flag points to the key's row in the configuration
    table, the adapter's own flags carry their help."""
    keys = {field.name for field in dataclasses.fields(EngineConfig)}
    group = next(g for g in add_datastates_args(argparse.ArgumentParser())._action_groups if g.title == "datastates")
    rows = ["| flag | meaning |", "|---|---|"]
    for action in group._group_actions:
        metavar = action.metavar or ("|".join(action.choices) if action.choices else None)
        shown = ", ".join(f"`{o} {metavar}`" if metavar and action.nargs != 0 else f"`{o}`"
                          for o in action.option_strings).replace("|", "\\|")
        key = action.dest.removeprefix("datastates_")
        if key in keys and key != "host_cache_size":
            meaning = f"engine key `{key}`"
            if action.const is False:
                meaning += " `false`, the earlier spelling of " + f"`--no-{flag_name(key)[2:]}`"
        else:
            meaning = action.help.replace("|", "\\|")
        rows.append(f"| {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


def host_cache_size(text: str) -> float | str:
    """``--datastates-host-cache-size``: a number of GiB, or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size in GiB or 'auto', not {text!r}") from None


@dataclass(frozen=True)
class MegatronAdapterOptions:
    """The Megatron adapter's own options: the ``--datastates-*`` flags that are not engine keys.

    The engine's keys go to ``EngineConfig`` (``engine_config_from_args``); these only change
    what the drop-in ``checkpointing`` does around the engine.
    """

    enabled: bool = False
    """``--use-datastates``: Megatron-LM's ``save_checkpoint``/``load_checkpoint`` route to this adapter."""
    load_fallback: bool = False
    """``--datastates-load-fallback``: a checkpoint that fails its checks makes every rank load the previous one."""
    allow_pickle: bool = False
    """``--datastates-allow-pickle``: Transformer Engine's pickled extra state is handed to its modules unchecked
    (``te_extra_state``); by default one holding more than TE's fp8 metadata is refused."""

    def __post_init__(self) -> None:
        for name in ("enabled", "load_fallback", "allow_pickle"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_args(cls, args: Any) -> "MegatronAdapterOptions":
        """The options the parsed flags describe (absent flags take their defaults)."""
        return cls(enabled=bool(getattr(args, "use_datastates", False)),
                   load_fallback=bool(getattr(args, "datastates_load_fallback", False)),
                   allow_pickle=bool(getattr(args, "datastates_allow_pickle", False)))


def engine_config_from_args(args: Any) -> dict:
    """The engine configuration the flags describe: each engine key whose flag was given (``engine_flags``).

    ``host_cache_size`` is ``"auto"`` unless a size was given: the adapter replaces it with a
    number when it creates the engine (``host_cache_size.auto_host_cache``). Megatron-LM's
    ``--save-retain-interval R`` (when a checkpoint is committed, the previous one is deleted
    unless its iteration is a multiple of R) is retention "newest 1 plus every R-th".
    """
    size = getattr(args, "datastates_host_cache_size", None)
    cfg = {"host_cache_size": AUTO if size is None else size,
           "save_dir": args.save, "local_dir": getattr(args, "datastates_local_dir", None)}
    if getattr(args, "save_retain_interval", None):
        cfg.update(keep_last=1, keep_every=args.save_retain_interval)
    for key, dest in _flag_destinations():
        value = getattr(args, dest, None)
        if value is not None and key not in ("host_cache_size", "local_dir"):
            cfg[key] = value
    return cfg


@functools.cache
def _flag_destinations() -> tuple[tuple[str, str], ...]:
    """(engine key, attribute of the parsed flags) of every ``--datastates-*`` flag, worked out once: they
    follow from ``EngineConfig`` alone, and the adapter reads the configuration at every save (to refuse
    one changed mid-run), where ``engine_flags`` would resolve the fields' type hints each time."""
    return tuple((flag.key, flag.kwargs["dest"]) for flag in engine_flags())


def flag_destination(key: str) -> str:
    """The attribute of the parsed flags that holds engine key ``key``'s ``--datastates-*`` flag."""
    return dict(_flag_destinations())[key]


def adapter_engine_config(args: Any) -> dict:
    """``engine_config_from_args`` with Megatron's classes on the allow-list: what the adapter's engine and loads use."""
    cfg = engine_config_from_args(args)
    cfg["safe_classes"] = list(megatron_safe_classes()) + list(cfg.get("safe_classes") or [])
    return cfg


#: ``--optimizer`` values whose state the adapter saves and loads (megatron-core's distributed optimizer or its
#: mixed-precision wrapper around them): Adam's two moments, SGD's momentum, Lion's one moment.
SUPPORTED_OPTIMIZERS = ("adam", "sgd", "lion")


def _unsupported_megatron_features(args: Any) -> list[str]:
    """Megatron-LM features (core_v0.19.0) this adapter refuses, each with why (docs/MEGATRON.md's table).

    Runs first in ``validate_args``, before Megatron-LM derives its own fields from these flags.
    """
    problems = []
    if getattr(args, "optimizer_cuda_graph", False):
        problems.append("--optimizer-cuda-graph captures optimizer.step in a CUDA graph: on replay the wait for the "
                        "lazy snapshot before the optimizer's inner step never runs, so the step could change tensors "
                        "still being copied; drop --optimizer-cuda-graph")
    optimizer = getattr(args, "optimizer", "adam")
    layer_wise = getattr(args, "use_layer_wise_distributed_optimizer", False) or optimizer.startswith("dist_") or (
        optimizer not in ("adam", "sgd") and getattr(args, "use_distributed_optimizer", False))
    if layer_wise:
        problems.append(f"--optimizer {optimizer} with --use-distributed-optimizer is megatron-core's layer-wise "
                        "distributed optimizer, whose sharded state --use-datastates does not support; use "
                        f"--optimizer {optimizer} without --use-distributed-optimizer"
                        + (" (or adam/sgd with it)" if optimizer.removeprefix("dist_") != "lion" else ""))
    elif optimizer not in SUPPORTED_OPTIMIZERS:
        problems.append(f"--optimizer {optimizer}: --use-datastates saves the state of "
                        f"{', '.join(SUPPORTED_OPTIMIZERS)} only")
    shards, tp = getattr(args, "tensor_parallel_num_weight_shards", None), getattr(args, "tensor_model_parallel_size", 1)
    if (shards is not None and shards > tp) or getattr(args, "gtp_weight_remat_size", 1) > 1:
        problems.append(f"--tensor-parallel-num-weight-shards {shards} > --tensor-model-parallel-size {tp} "
                        "(generalized tensor parallelism's weight rematerialisation) is not supported by "
                        "--use-datastates")
    if getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False) and getattr(args, "overlap_param_gather", False):
        problems.append("--reuse-grad-buf-for-mxfp8-param-ag with --overlap-param-gather: the parameters are "
                        "staged into the gradient buffer only at the next training step, so a save could not "
                        "gather them exactly; drop one of the two flags")
    return problems


#: Megatron-LM (core_v0.19.0) features that write files under ``--save`` themselves, with ``os.makedirs`` and
#: ``open``: each is (attribute, its flag, what it writes, the flag that moves it elsewhere or None).
_WRITES_UNDER_SAVE = (
    ("log_progress", "--log-progress", "progress.txt", None),
    ("enable_ft_package", "--enable-ft-package", "ft_state.json (the fault-tolerance timeouts)", None),
    ("wandb_project", "--wandb-project", "the wandb run directory", "--wandb-save-dir"),
    ("rl_profile", "--rl-profile", "profiles/", "--rl-profile-dir"),
    ("save_params_interval", "--save-params-interval", "the parameter dumps", None),
    ("save_wgrads_interval", "--save-wgrads-interval", "the gradient dumps", None),
    ("save_dgrads_interval", "--save-dgrads-interval", "the gradient dumps", None),
    ("save_activations_interval", "--save-activations-interval", "the activation dumps", None),
    ("save_tokens_per_expert_interval", "--save-tokens-per-expert-interval", "the tokens-per-expert dumps", None),
)


def _file_system_uses_of_save(args: Any) -> list[str]:
    """Megatron-LM features that would write under an ``s3://`` ``--save`` through the file system: there the
    URL is a relative path, so each would make a local directory named ``s3:`` instead (refused by name)."""
    save = getattr(args, "save", None)
    if not is_object_url(save):
        return []
    problems = []
    for attr, flag, what, elsewhere in _WRITES_UNDER_SAVE:
        elsewhere_dest = elsewhere and elsewhere[2:].replace("-", "_")
        if getattr(args, attr, None) and not (elsewhere_dest and getattr(args, elsewhere_dest, None)):
            moved = f" (or give {elsewhere} a path)" if elsewhere else ""
            problems.append(f"{flag}: Megatron-LM writes {what} under --save through the file system, where "
                            f"{save!r} would be a local directory named 's3:'; drop {flag}{moved} or save to a path")
    return problems


def validate_datastates_args(args: Any) -> None:
    """Reject flag combinations the engine cannot honour, with one clear message, before training."""
    if getattr(args, "datastates_interleaved_offload", False):  # an optimizer option: with or without --use-datastates
        from megatron_ext.megatron.interleaved_offload import install
        install(args)
    if not MegatronAdapterOptions.from_args(args).enabled:
        return
    problems = []
    if getattr(args, "async_save", False):
        problems.append("--use-datastates replaces --async-save; drop --async-save")
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt not in (None, "torch_dist"):
        problems.append(f"--use-datastates writes its own format from megatron-core's sharded state dicts; "
                        f"it needs the default --ckpt-format torch_dist, not {fmt}")
    non_persistent = getattr(args, "non_persistent_ckpt_type", None)
    if non_persistent == "local":  # NVRx's LocalCheckpointManager would write a second, unsynchronised copy
        problems.append("--non-persistent-ckpt-type local (nvidia-resiliency-ext's local checkpoints) is replaced "
                        "by --use-datastates' own node-local level: drop it and pass --datastates-local-dir DIR "
                        "(and --datastates-peer-replica to survive a lost node)")
    elif getattr(args, "non_persistent_save_interval", None) and non_persistent != "global":
        problems.append(f"--non-persistent-save-interval with --non-persistent-ckpt-type {non_persistent}: "
                        "--use-datastates writes 'global' non-persistent checkpoints (its node-local level is "
                        "--datastates-local-dir)")
    if getattr(args, "save_retain_interval", None) and (getattr(args, "datastates_keep_last", None) is not None or
                                                         getattr(args, "datastates_keep_every", None) is not None):
        problems.append("--save-retain-interval and --datastates-keep-last/--datastates-keep-every both set retention; "
                        "keep one of them")
    if getattr(args, "load_main_params_from_ckpt", False):
        problems.append("--use-datastates does not support --load-main-params-from-ckpt")
    if getattr(args, "save", None) is None:
        problems.append("--use-datastates needs --save")
    for flag in ("save", "load", "pretrained_checkpoint", "non_persistent_global_ckpt_dir"):
        # Roots the adapter's own saves and loads use: an s3:// object store or a path, no other URL.
        value, name = getattr(args, flag, None) or "", f"--{flag.replace('_', '-')}"
        refusal = url_refusal(value, name, object_ok=True)
        if refusal is None and is_object_url(value):
            try:
                normalize(value)
            except ValueError as exc:
                refusal = f"{name}: {exc}"
        if refusal is not None:
            problems.append(refusal)
    problems += _file_system_uses_of_save(args)
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        problems.append("--use-datastates does not support FSDP")
    fp8_moments = [flag for flag in ("exp_avg_dtype", "exp_avg_sq_dtype")
                   if getattr(args, "use_precision_aware_optimizer", False) and str(getattr(args, flag, "")) in
                   ("fp8", "torch.uint8")]
    if fp8_moments:
        problems.append(f"--use-datastates cannot save fp8 Adam moments exactly "
                        f"({', '.join('--' + f.replace('_', '-') + ' fp8' for f in fp8_moments)}: Transformer Engine "
                        "keeps them as Float8Tensors); use bf16 (exact in any layout) or fp16 (exact on the saved "
                        "layout)")
    problems += _unsupported_megatron_features(args)
    if problems:
        raise ValueError("invalid datastates configuration: " + "; ".join(problems))
    cfg = engine_config_from_args(args)
    if cfg["host_cache_size"] == AUTO:  # sized when the engine is created; any valid size checks the rest
        cfg["host_cache_size"] = EngineConfig.host_cache_size
    try:
        EngineConfig.from_dict(cfg)
    except ConfigError as exc:
        raise ValueError(f"invalid datastates configuration: {exc}") from exc
