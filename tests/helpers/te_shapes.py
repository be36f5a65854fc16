"""Transformer Engine-shaped extra state, built without Transformer Engine (which needs CUDA to install).

What is TE-shaped and where the shape comes from (TE 2.9, 2.10 and 2.11 are identical in all of it):

* the recipe classes below mirror ``transformer_engine/common/recipe/__init__.py``: the same class
  names, the same pydantic dataclass decorators (``@dataclass()``, ``frozen=True`` for ``MMParams``
  and ``QParams``), the same fields and defaults, ``Format``'s members and their ``_FormatHelper``
  values, and the fields ``NVFP4BlockScaling.__post_init__`` adds. Only their behaviour (the
  ``__post_init__`` checks, ``__repr__``) is left out: a pickle does not hold it. While
  ``te_recipe_module()`` is active they live under TE's own module name, so ``pickle.dumps`` writes
  exactly the stream TE writes for its own objects;
* ``module_extra_state`` is ``TransformerEngineBaseModule.get_extra_state``
  (``transformer_engine/pytorch/module/base.py``): ``recipe``; for delayed scaling the forward and
  backward ``scale`` (``num_gemms * 3`` and ``* 2`` quantizers, ``DelayedScalingRecipeState`` in
  ``pytorch/quantization.py``) and ``amax_history`` (``amax_history_len`` x quantizers) as CPU
  float32 copies; ``extra_fp8_variables`` (``fp8_meta``'s bools, numbers, strings, tuples and
  lists); pickled and returned as ``torch.frombuffer(bytearray(...), dtype=torch.uint8)``;
* ``ops_extra_state`` is the fusible ops' ``BasicOperation.get_extra_state`` (``pytorch/ops/op.py``):
  the same, nested under ``forward`` and ``backward``;
* ``te1_extra_state`` is TE 1.2's ``get_extra_state`` (tag ``v1.2``): a ``BytesIO`` holding
  ``torch.save`` of the scales, inverse scales and amax histories, the global fp8 buffer and state,
  and ``extra_fp8_variables`` (Megatron-LM's ``TEGroupedLinear._encode_extra_state`` writes the
  same container for TE < 2.0).
"""

import contextlib
import io
import os
import pickle
import sys
import types
from enum import Enum
from typing import Any, Callable, Iterator, Literal, NamedTuple, Optional, Union

import torch
from pydantic.dataclasses import dataclass

RECIPE_MODULE = "transformer_engine.common.recipe"


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)


@dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)


@dataclass()
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[Literal["max", "most_recent"], Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass()
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=use_power_2_scales, amax_epsilon=0.0)
    fp8_quant_fwd_weight = QParams(power_2_scale=use_power_2_scales, amax_epsilon=0.0)
    fp8_quant_bwd_grad = QParams(power_2_scale=use_power_2_scales, amax_epsilon=0.0)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass()
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass()
class Float8BlockScaling(Recipe):
    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp = QParams(power_2_scale=not use_f32_scales, amax_epsilon=0.0)
    fp8_quant_fwd_weight = QParams(power_2_scale=not use_f32_scales, amax_epsilon=0.0)
    fp8_quant_bwd_grad = QParams(power_2_scale=not use_f32_scales, amax_epsilon=0.0)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass()
class NVFP4BlockScaling(Recipe):
    disable_rht: bool = os.getenv("NVTE_NVFP4_DISABLE_RHT", "0") == "1"
    disable_stochastic_rounding: bool = os.getenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0") == "1"
    disable_2d_quantization: bool = os.getenv("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0") == "1"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:  # the fields TE's __post_init__ adds (they are pickled with the rest)
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht,
                                         stochastic_rounding=False, fp4_2d_quantization=False)
        self.fp4_quant_fwd_weight = QParams(random_hadamard_transform=False, stochastic_rounding=False,
                                            fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(random_hadamard_transform=not self.disable_rht,
                                          stochastic_rounding=not self.disable_stochastic_rounding,
                                          fp4_2d_quantization=False)


@dataclass()
class CustomRecipe(Recipe):
    qfactory: Callable[..., Any]
    fp8_dpa: bool = False
    fp8_mha: bool = False


CLASSES = (_FormatHelper, Format, MMParams, QParams, Recipe, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
           Float8BlockScaling, NVFP4BlockScaling, CustomRecipe)
for _cls in CLASSES:
    _cls.__module__ = RECIPE_MODULE


@contextlib.contextmanager
def te_recipe_module() -> Iterator[types.ModuleType]:
    """These classes as ``transformer_engine.common.recipe`` (and its parents) in ``sys.modules``, for the block."""
    names = ("transformer_engine", "transformer_engine.common", RECIPE_MODULE)
    if any(name in sys.modules for name in names):
        raise RuntimeError("a transformer_engine module is already imported; these shapes would shadow it")
    modules = {name: types.ModuleType(name) for name in names}
    for cls in CLASSES:
        setattr(modules[RECIPE_MODULE], cls.__name__, cls)
    sys.modules.update(modules)
    try:
        yield modules[RECIPE_MODULE]
    finally:
        for name in names:
            sys.modules.pop(name, None)


def all_recipes() -> dict[str, Recipe]:
    return {"delayed_default": DelayedScaling(),
            "delayed_tuned": DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=16,
                                            amax_compute_algo="most_recent", reduce_amax=False),
            "current": Float8CurrentScaling(), "mxfp8": MXFP8BlockScaling(), "block": Float8BlockScaling(),
            "nvfp4": NVFP4BlockScaling()}


def _fp8_meta_extra(recipe: Recipe, num_gemms: int) -> dict:
    """What ``extra_fp8_variables`` holds after a module ran under fp8 (``init_fp8_metadata``)."""
    extra = {"fp8_checkpoint": True, "num_gemms": num_gemms}
    if hasattr(recipe, "fp8_format"):
        extra.update(fp8_max_fwd=recipe.fp8_format.value.max_fwd, fp8_max_bwd=recipe.fp8_format.value.max_bwd)
    return extra


def _delayed_tensors(recipe: DelayedScaling, num_gemms: int, seed: int, forward: bool = True,
                     backward: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    if forward:
        out["scale_fwd"] = torch.rand(num_gemms * 3, generator=g) + 0.5
        out["amax_history_fwd"] = torch.rand(recipe.amax_history_len, num_gemms * 3, generator=g)
    if backward:
        out["scale_bwd"] = torch.rand(num_gemms * 2, generator=g) + 0.5
        out["amax_history_bwd"] = torch.rand(recipe.amax_history_len, num_gemms * 2, generator=g)
    return out


def _as_te_blob(state: Any) -> torch.Tensor:
    with te_recipe_module():
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def module_state(recipe: Recipe, num_gemms: int = 1, seed: int = 0) -> dict:
    """The dict ``TransformerEngineBaseModule.get_extra_state`` pickles."""
    state: dict = {"recipe": recipe}
    if recipe.delayed():
        state.update(_delayed_tensors(recipe, num_gemms, seed))
    state["extra_fp8_variables"] = _fp8_meta_extra(recipe, num_gemms)
    return state


def module_extra_state(recipe: Recipe, num_gemms: int = 1, seed: int = 0) -> torch.Tensor:
    return _as_te_blob(module_state(recipe, num_gemms, seed))


def ops_state(recipe: Recipe, seed: int = 0) -> dict:
    """The dict the fusible ops' ``get_extra_state`` pickles."""
    state: dict = {}
    for mode in ("forward", "backward"):
        state[mode] = {"recipe": recipe}
        if recipe.delayed():
            state[mode].update(_delayed_tensors(recipe, 1, seed, forward=mode == "forward",
                                                backward=mode == "backward"))
        state[mode]["extra_fp8_variables"] = _fp8_meta_extra(recipe, 1)
    return state


def ops_extra_state(recipe: Recipe, seed: int = 0) -> torch.Tensor:
    return _as_te_blob(ops_state(recipe, seed))


def no_fp8_extra_state() -> torch.Tensor:
    """What TE 2.x writes for a module that never ran under fp8."""
    return torch.empty(0, dtype=torch.uint8)


def te1_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    scale_fwd, scale_bwd = torch.rand(3, generator=g) + 0.5, torch.rand(2, generator=g) + 0.5
    return {"scale_fwd": scale_fwd, "scale_inv_fwd": 1 / scale_fwd, "amax_history_fwd": torch.rand(16, 3, generator=g),
            "scale_bwd": scale_bwd, "scale_inv_bwd": 1 / scale_bwd, "amax_history_bwd": torch.rand(16, 2, generator=g),
            "global_fp8_buffer": {"FWD_AMAX_0": [torch.rand(3, generator=g)]},
            "global_fp8_state": {"FP8_ENABLED": True, "FP8_CALIBRATION": False},
            "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0,
                                    "fp8_max_bwd": 57344.0}}


def te1_extra_state(seed: int = 0) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(te1_state(seed), buffer)
    return buffer


class Canary:
    """A pickle whose load runs ``os.system(command)``: what a hostile checkpoint puts in extra state."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def hostile_extra_state(command: str, recipe: Optional[Recipe] = None) -> torch.Tensor:
    """A TE-shaped extra state whose ``extra_fp8_variables`` also hold a ``Canary``."""
    state = module_state(recipe or DelayedScaling(amax_history_len=4))
    state["extra_fp8_variables"]["num_gemms"] = Canary(command)
    return _as_te_blob(state)


def foreign_extra_state(value: Any) -> torch.Tensor:
    """A TE-shaped extra state whose ``extra_fp8_variables`` also hold ``value`` (a class TE never pickles)."""
    state = module_state(DelayedScaling(amax_history_len=4))
    state["extra_fp8_variables"]["foreign"] = value
    return _as_te_blob(state)


class ExtraStateModule(torch.nn.Module):
    """A module with Transformer Engine's extra-state handling and nothing else.

    ``get_extra_state`` returns ``blob`` (what a TE module's returns, e.g. ``module_extra_state``);
    ``set_extra_state`` does what TE 2.9-2.11's ``TransformerEngineBaseModule.set_extra_state`` does
    first: an empty tensor means no fp8, any other tensor is ``pickle.loads`` of its bytes, a
    ``BytesIO`` is ``torch.load``. The unpickled value is recorded in ``loaded``.
    """

    def __init__(self, blob: Any):
        super().__init__()
        self.blob = blob
        self.loaded: list = []

    def get_extra_state(self) -> Any:
        return self.blob

    def set_extra_state(self, state: Any) -> None:
        if state is None:
            return
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            with te_recipe_module():  # TE's own classes, as where TE is installed
                value = pickle.loads(state.detach().cpu().numpy().tobytes())
        elif isinstance(state, io.BytesIO):
            state.seek(0)
            value = torch.load(state, map_location="cpu")
        else:
            raise RuntimeError("Unsupported checkpoint format.")
        self.loaded.append(value)
