"""The optimizer as the checkpoint sees it: which kind it is (distributed, chained, with a
``HybridDeviceOptimizer``, holding its own main params) and the *stored form* it keeps its state in,
recorded at the save and compared at the load.

Stored forms. What is saved is the optimizer's *stored* form, never a converted copy:

* plain (torch Adam, or TE's/Apex's FusedAdam without ``--use-precision-aware-optimizer``):
  megatron-core's fp32 main params and fp32 moments, ``fp32_param``, ``exp_avg``, ``exp_avg_sq``;
* ``--use-precision-aware-optimizer`` (TE's FusedAdam keeps the main params and moments, see
  ``megatron_ext/testing/te_fused_adam.py`` for what it stores): each tensor as FusedAdam holds it,
  named by its kind so that no reader can take one kind for another: ``fp32_param``/``exp_avg``/
  ``exp_avg_sq`` when fp32, ``main_param_remainders`` (int16: the low 16 bits of the fp32 main
  params whose high 16 bits are the bf16 model params themselves, ``store_param_remainders``),
  ``exp_avg_bf16``/``exp_avg_sq_bf16`` (no scale), and ``main_param_fp16``/``exp_avg_fp16``/
  ``exp_avg_sq_fp16``, which FusedAdam keeps divided by a per-tensor scale (one fp32 value per
  parameter slice of this rank, ``FusedAdam._scales``), saved beside them as an object shard
  ``optimizer.state.<name>_scale.<model key>#<start>:<stop>``.

What cannot be made exact is refused with a ``CheckpointError``: fp8 moments
(``--exp-avg-dtype fp8``: FusedAdam keeps TE ``Float8Tensor``s, whose data and scale-inverse this
module does not save; refused at start-up and at the first save), and loading a scaled form
(fp16) into another TP/PP/DP layout (a slice's scale does not describe the resharded slices; the
other forms are elementwise and reshard exactly). The stored form (``stored_form``) is recorded
in the common state (``datastates_stored_form``), and a load whose optimizer keeps another form
is refused naming both and the flags (``check_stored_form``); a checkpoint without the record
(saved before it existed) holds the plain form.

Moment sets. Optimizers keep different per-parameter state besides the main params: Adam
``exp_avg`` and ``exp_avg_sq``, Lion (``--optimizer lion``, from ``emerging-optimizers``) only
``exp_avg``, SGD with momentum ``momentum_buffer``, SGD without none. The stored form names the
optimizer (its class) and its moment set (``moments``), and gives the kind of each of those
moments only. ``--optimizer lion`` is not a single optimizer: megatron-core (core_v0.19.0) steps
the linear weights with Lion and every other parameter (embeddings, norms, the output layer)
with Adam, as a ``ChainedOptimizer`` of two non-distributed optimizers; their state is
megatron-core's own per-parameter sharded state, and its common part carries each one's stored
form too (``model_space_state_dict``). A load whose optimizers keep other moment sets than the
saved ones (a Lion checkpoint into an Adam run, or the reverse), or that chains another number
of optimizers, is refused before anything is read, naming both sides' optimizers and moments
(``check_stored_form``). A checkpoint saved before the moment set was recorded is not compared
by it (its distributed optimizers were Adam or SGD; its other optimizers recorded nothing).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from megatron_ext.engine.errors import CheckpointError

MODEL_SPACE = "fully_sharded_model_space"
BEFORE_FIRST_STEP = "saved_before_first_step"
STORED_FORM = "datastates_stored_form"
#: Set by ``megatron-ext convert`` from megatron-core's ``fully_reshardable``: the model-space state
#: is held as whole parameter boxes, and each rank's flat slices are cut out of them at the load.
BOXES = "datastates_whole_boxes"
#: Keys of a distributed optimizer's common state that only the adapter reads (megatron-core's loads never see them).
OWN_KEYS = ("param_state", "param_state_sharding_type", BEFORE_FIRST_STEP, STORED_FORM, BOXES)

_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}
REMAINDERS = "bf16 + int16 remainders"  # fp32 main params as the bf16 model params plus their low 16 bits
#: The stored form of a checkpoint saved before the form was recorded: the only one that was exact then.
PLAIN_FORM = {"main_params": "fp32", "exp_avg": "fp32", "exp_avg_sq": "fp32", "precision_aware_optimizer": False}
#: Adam's moments: those a form recorded without its moment set (``moments``) gives the kinds of.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
#: Each optimizer class's moment set (by class name, looked up along its MRO): what it keeps per parameter
#: besides ``step`` and the main params. Known before the first step, when its state is still empty.
_MOMENTS = {"Adam": ADAM_MOMENTS, "AdamW": ADAM_MOMENTS, "FusedAdam": ADAM_MOMENTS, "Lion": ("exp_avg",)}
#: Suffix of the object shard holding an fp16 stored tensor's per-slice scale.
SCALE_SUFFIX = "_scale"


def distributed_optimizers(optimizer: Any) -> Iterator[Any]:
    """Each optimizer of a chained one, or ``optimizer`` itself."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def is_distributed(opt: Any) -> bool:
    """A megatron-core ``DistributedOptimizer`` (its state is described in model space)."""
    return hasattr(opt, "gbuf_ranges") and hasattr(opt, "_get_main_param_and_optimizer_states")


def hybrid_optimizer(opt: Any) -> Any:
    """The ``HybridDeviceOptimizer`` a distributed optimizer steps with (``--optimizer-cpu-offload``), else None."""
    try:
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    except ImportError:  # a megatron-core without CPU offloading
        return None
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, HybridDeviceOptimizer) else None


def sub_optimizer_states(hdo: Any) -> dict:
    """Each HDO master (the tensor a sub-optimizer steps) -> that sub-optimizer's state of it."""
    return {master: state for sub in hdo.sub_optimizers for master, state in sub.state.items()}


def param_slices(opt: Any) -> Iterator[tuple[Any, slice]]:
    """Each parameter reaching into this data-parallel rank's grad-buffer slice, with its part of it."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    yield model_param, slice(ranges["param"].start, ranges["param"].end)


def has_stepped(opt: Any) -> bool:
    """Whether the inner optimizer has state yet (not before its first step: fp16's skipped first steps)."""
    hdo = hybrid_optimizer(opt)
    if hdo is not None:
        return any(len(s) for s in sub_optimizer_states(hdo).values())
    return any(len(s) for s in opt.optimizer.state.values())


def holds_main_params(opt: Any) -> bool:
    """Whether the inner optimizer keeps the main params (``--use-precision-aware-optimizer``: TE's FusedAdam)."""
    return bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def is_hybrid(opt: Any) -> bool:
    """megatron-core's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``): its own fp32 tensors on the host."""
    return hybrid_optimizer(opt) is not None



def _class_moments(inner: Any) -> tuple[str, ...] | None:
    """The moment set of a torch optimizer by its class (``_MOMENTS``; SGD's depends on its momentum), or None."""
    groups = getattr(inner, "param_groups", [])
    for cls in type(inner).__mro__:
        if cls.__name__ == "SGD":
            return ("momentum_buffer",) if any(g.get("momentum", 0) for g in groups) else ()
        if cls.__name__ in _MOMENTS:
            names = _MOMENTS[cls.__name__]
            if cls.__name__ in ("Adam", "AdamW") and any(g.get("amsgrad") for g in groups):
                names += ("max_exp_avg_sq",)
            return names
    return None


def moments(opt: Any) -> tuple[str, ...] | None:
    """The moment set of a megatron-core optimizer's inner optimizer (a ``HybridDeviceOptimizer``: its
    sub-optimizers'), or None where it is unknown.

    By class (``_MOMENTS``), so that a fresh optimizer (no state before its first step) and one that
    has stepped give the same answer; a class not in the table gives the tensors its state holds.
    """
    hdo = hybrid_optimizer(opt)
    inners = list(hdo.sub_optimizers) if hdo is not None else [getattr(opt, "optimizer", None)]
    names: set[str] = set()
    for inner in inners:
        if inner is None:
            return None
        known = _class_moments(inner)
        if known is None:
            known = {k for state in getattr(inner, "state", {}).values() for k, v in state.items()
                     if k not in ("step", "master_param") and isinstance(v, torch.Tensor)}
            if not known:
                return None
        names.update(known)
    return tuple(sorted(names))


def optimizer_name(opt: Any) -> str:
    """The class name of the inner optimizer (the HDO's sub-optimizers' too)."""
    hdo = hybrid_optimizer(opt)
    if hdo is not None:
        return f"HybridDeviceOptimizer({', '.join(sorted({type(s).__name__ for s in hdo.sub_optimizers}))})"
    return type(getattr(opt, "optimizer", None)).__name__


def form_moments(form: dict) -> tuple[str, ...]:
    """The moments a stored form gives the kinds of: its recorded moment set, else Adam's."""
    recorded = form.get("moments")
    return tuple(recorded) if isinstance(recorded, (list, tuple)) else ADAM_MOMENTS


def _compared(form: dict) -> tuple[str, ...]:
    return ("main_params", *form_moments(form))


def stored_form(opt: Any) -> dict:
    """How ``opt`` stores its main params and moments: its optimizer, moment set, the kind of each
    (compared at load), and the flag."""
    inner, config = opt.optimizer, getattr(opt, "config", None)
    dtypes = getattr(inner, "name_to_dtype_map", None) or {}  # TE's FusedAdam: the dtype of each state

    def kind(name: str) -> str:
        dtype = dtypes.get(name, torch.float32)
        return _KINDS.get(dtype, str(dtype).removeprefix("torch."))

    main = "fp32"
    if holds_main_params(opt) and not is_hybrid(opt):
        main = kind("master_param")
        if getattr(inner, "store_param_remainders", False) and getattr(config, "bf16", False):
            main = REMAINDERS
    names = moments(opt)
    form: dict = {"optimizer": optimizer_name(opt), "moments": None if names is None else list(names),
                  "main_params": main}
    form.update({name: kind(name) for name in (ADAM_MOMENTS if names is None else names)})
    form["precision_aware_optimizer"] = bool(getattr(config, "use_precision_aware_optimizer", False))
    return form


def describe(form: dict) -> str:
    return ", ".join([f"main params {form['main_params']}",
                      *(f"{name} {form.get(name, '?')}" for name in form_moments(form))])


def describe_optimizer(form: dict | None) -> str:
    """An optimizer by its class and moment set, e.g. ``Lion (moments: exp_avg)``."""
    if form is None or not isinstance(form.get("moments"), (list, tuple)):
        name = (form or {}).get("optimizer")
        return f"{name or 'an optimizer'} (moments not recorded)"
    return f"{form.get('optimizer') or 'an optimizer'} (moments: {', '.join(form['moments']) or 'none'})"


def _flags(form: dict) -> str:
    """The Megatron-LM flags that give an optimizer of this stored form."""
    if all(form.get(k) == "fp32" for k in _compared(form)) and not form.get("precision_aware_optimizer"):
        return "without --use-precision-aware-optimizer"
    main = {REMAINDERS: "fp32", "fp16": "fp16"}.get(form["main_params"], "fp32")
    flags = (f"--use-precision-aware-optimizer --main-params-dtype {main} --exp-avg-dtype {form.get('exp_avg')} "
             f"--exp-avg-sq-dtype {form.get('exp_avg_sq')}")
    if form["main_params"] == REMAINDERS:
        flags += " with --bf16 (megatron-core's OptimizerConfig.store_param_remainders, on by default with TE >= 2.1)"
    elif form["main_params"] == "fp32":
        flags += " (with --bf16: OptimizerConfig.store_param_remainders off)"
    return flags


FP8_REFUSED = ("--use-datastates cannot save fp8 optimizer state ({}): Transformer Engine's FusedAdam keeps it as "
               "Float8Tensors, whose exact form (fp8 data plus a per-tensor scale) megatron_ext does not store; use "
               "--exp-avg-dtype/--exp-avg-sq-dtype bf16 (exact in any layout) or fp16 (exact on the saved layout)")


def refuse_fp8(form: dict) -> None:
    fp8 = [name for name in _compared(form) if form.get(name) == "fp8"]
    if fp8:
        raise CheckpointError(FP8_REFUSED.format(", ".join(fp8)))


def saved_states(optimizers: list, saved: Any) -> list:
    """The saved common state of each (chained) optimizer, in order."""
    return [saved] if len(optimizers) == 1 else [saved[i] for i in sorted(saved)]


def _common_states(saved_common: Any) -> list:
    """Each (chained) optimizer's part of a checkpoint's common ``optimizer`` state, in order.

    A ``ChainedOptimizer`` of several optimizers saves ``{index: state}``, one of a single optimizer
    that optimizer's state itself (megatron-core's ``ChainedOptimizer.sharded_state_dict``).
    """
    if not isinstance(saved_common, dict):
        return []
    if saved_common and all(isinstance(k, int) for k in saved_common):
        return [saved_common[k] for k in sorted(saved_common)]
    return [saved_common]


def _recorded_form(saved: dict) -> dict:
    recorded = saved.get(STORED_FORM)
    return {**PLAIN_FORM, **recorded} if isinstance(recorded, dict) else dict(PLAIN_FORM)


def _saved_form(saved: Any) -> dict | None:
    """The stored form of one saved (chained) optimizer state: recorded, or a model-space one saved
    before the record (the plain form); None for megatron-core's own state saved without a record."""
    if not isinstance(saved, dict):
        return None
    if isinstance(saved.get(STORED_FORM), dict) or saved.get("param_state_sharding_type") == MODEL_SPACE:
        return _recorded_form(saved)
    return None


def saved_forms(saved_common: Any) -> list[dict]:
    """The stored form of every model-space optimizer state in a checkpoint's common ``optimizer`` state."""
    return [_recorded_form(saved) for saved in _common_states(saved_common)
            if isinstance(saved, dict) and saved.get("param_state_sharding_type") == MODEL_SPACE]


def is_plain(form: dict) -> bool:
    return all(form.get(k) == "fp32" for k in _compared(form))


def _has_moments(form: dict | None) -> bool:
    return form is not None and isinstance(form.get("moments"), (list, tuple))


def _describe_chain(forms: list) -> str:
    return " + ".join(describe_optimizer(form) for form in forms) or "no optimizer"


def _optimizer_flag(forms: list) -> str:
    """The ``--optimizer`` that gives the saved optimizers (Lion's run chains Adam for the other parameters)."""
    names = " ".join(str((form or {}).get("optimizer") or "") for form in forms)
    if "Lion" in names:
        return "--optimizer lion (without --use-distributed-optimizer)"
    for cls, flag in (("SGD", "sgd"), ("Adam", "adam")):
        if cls in names:
            return f"--optimizer {flag}"
    return "the optimizer it was saved with"


def _check_moment_sets(saved: list, now: list, checkpoint: str) -> None:
    """Refuse saved optimizers whose number or moment sets differ from this run's, naming both sides."""
    if len(saved) == len(now) and all(not (_has_moments(s) and _has_moments(n)) or
                                      sorted(s["moments"]) == sorted(n["moments"]) for s, n in zip(saved, now)):
        return
    raise CheckpointError(
        f"{checkpoint}: its optimizer state was saved by {_describe_chain(saved)}, but this run's optimizer is "
        f"{_describe_chain(now)}: they keep different per-parameter state, which cannot be loaded into one "
        f"another; resume with {_optimizer_flag(saved)}, as it was saved, or pass --no-load-optim to load the "
        "weights only")


def check_stored_form(optimizer: Any, saved_common: Any, *, checkpoint: str, resharding: bool) -> None:
    """Refuse, before anything is read, an optimizer state saved in another stored form.

    ``saved_common`` is the checkpoint's common ``optimizer`` state. First the optimizers
    themselves: as many (chained) optimizers, each with the saved moment set where both sides
    record one (a Lion checkpoint into an Adam run is refused here, naming both). Then, for each
    saved form (recorded, or a model-space state saved before the record), the kinds of the main
    params and moments. Checkpoints in megatron-core's own formats (converted from torch_dist) hold
    its unscaled values and are not checked here.
    """
    optimizers = list(distributed_optimizers(optimizer))
    if not isinstance(saved_common, dict):
        return
    states = _common_states(saved_common)
    saved_list = [_saved_form(saved) for saved in states]
    now_list = [stored_form(opt) for opt in optimizers]
    _check_moment_sets(saved_list, now_list, checkpoint)
    for opt, saved, saved_form, now in zip(optimizers, states, saved_list, now_list):
        if saved_form is None or (saved.get("param_state_sharding_type") == MODEL_SPACE and not is_distributed(opt)):
            continue
        compared = [k for k in _compared(saved_form) if k in now]
        if any(saved_form.get(k) != now[k] for k in compared):
            when = "" if isinstance(saved.get(STORED_FORM), dict) else \
                " (saved before megatron_ext recorded the form: the plain one)"
            raise CheckpointError(
                f"{checkpoint}: its optimizer state was saved in another form than this run's optimizer keeps: saved "
                f"{describe(saved_form)}{when}, now {describe(now)}. Loading it would copy values of one kind into "
                f"tensors of another; resume {_flags(saved_form)} (this run: {_flags(now)}), or pass "
                "--no-load-optim to load the weights only")
        scaled = [k for k in compared if saved_form.get(k) == "fp16"]
        if resharding and scaled and is_distributed(opt):
            raise CheckpointError(
                f"{checkpoint}: its optimizer keeps {', '.join(scaled)} in fp16 divided by a scale per parameter "
                "slice of each data-parallel rank, which does not carry over to another TP/PP/DP layout exactly; "
                "load it on the layout it was saved with (or pass --no-load-optim)")


def whole_boxes(saved_common: Any) -> bool:
    """Whether a checkpoint's model-space optimizer state is held as whole parameter boxes (``BOXES``)."""
    return any(isinstance(s, dict) and s.get(BOXES) for s in _common_states(saved_common))


def saved_before_first_step(saved_common: Any) -> bool:
    """Whether a checkpoint's optimizer (its common part) was saved before the first step."""
    return any(isinstance(s, dict) and s.get(BEFORE_FIRST_STEP) for s in _common_states(saved_common))

