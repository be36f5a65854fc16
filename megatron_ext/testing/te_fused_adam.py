"""A CPU stand-in for Transformer Engine's ``FusedAdam``, for tests only (TE cannot be installed without CUDA).

``--use-precision-aware-optimizer`` makes megatron-core hand its main params and Adam moments to
TE's ``transformer_engine.pytorch.optimizers.FusedAdam``. This class reproduces the interface and
the storage megatron-core 0.19.0 uses of it, as TE 2.9-2.11 implement them
(``transformer_engine/pytorch/optimizers/fused_adam.py``, the same in the three releases apart from
DTensor handling; the remainder arithmetic from ``common/multi_tensor/adam.cu``,
``AdamFunctorMasterParamRemainder``):

* constructor keywords (``master_weights``, ``master_weight_dtype``, ``exp_avg_dtype``,
  ``exp_avg_sq_dtype``, ``use_decoupled_grad``, ``store_param_remainders``, ...), and the attributes
  ``name_to_dtype_map``, ``dtype_to_range_map``, ``_scales``, ``store_param_remainders``
  (effective only with fp32 master weights);
* per parameter, ``state[p]`` holds ``exp_avg``, ``exp_avg_sq`` and, with ``master_weights``,
  ``master_param``, each in its own dtype: fp32 as it is; bf16 as it is (no scale); fp16 divided by
  a per-tensor fp32 scale kept in ``_scales[p][name]`` (``absmax / (fp16 max / 2)``); and for a
  bf16 param with ``store_param_remainders``, ``master_param`` is int16: the low 16 bits of the fp32
  main param whose high 16 bits are the bf16 param itself (rounded to nearest);
* ``get_unscaled_state`` (fp32 copies, except the fp32 tensor itself and the int16 remainders),
  ``set_scaled_state`` (rescales from fp32), ``initialize_state(param, store_param_remainders)``,
  ``state_dict`` / ``load_state_dict`` (unscaled, as TE's), ``zero_grad`` (``decoupled_grad``),
  and ``step``, which reads ``decoupled_grad``, unscales, runs Adam in fp32, writes the bf16/fp16
  param (or splits param and remainder), and rescales.

Not reproduced: fp8 (uint8) state, which needs TE's ``Float8Tensor`` (refused here), capturable
mode, and the CUDA kernels themselves (the arithmetic is the same in fp32 torch ops on the CPU, not
bit-identical to the GPU kernel; the tests compare the stand-in with itself across a checkpoint).

``use_with_megatron_core()`` makes megatron-core's ``get_megatron_optimizer`` build its
precision-aware distributed optimizer around this class on a CPU, as it would around TE's.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy
from itertools import chain
from typing import Any, Iterator

import torch

__all__ = ["FusedAdam", "use_with_megatron_core", "precision_aware_config"]


def _split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest, int16 remainder), as TE's remainder kernel splits them."""
    bits = master.contiguous().view(torch.int32)
    high = bits >> 16
    low = ((bits & 0xFFFF) ^ 0x8000) - 0x8000  # the low half as a signed 16-bit number
    high = high + (low < 0).to(torch.int32)  # round up
    high = ((high & 0xFFFF) ^ 0x8000) - 0x8000
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def _join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> the fp32 main param, as TE's remainder kernel rebuilds it."""
    high = param.contiguous().view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    high = high - (low < 0).to(torch.int32)  # undo the rounding
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


class FusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam, as megatron-core drives it with ``--use-precision-aware-optimizer``, on the CPU."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: bool | None = None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable:
            raise NotImplementedError("the stand-in has no capturable mode")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        for dtype in (exp_avg_dtype, exp_avg_sq_dtype):
            if dtype == torch.uint8:
                raise NotImplementedError("fp8 optimizer state needs Transformer Engine's Float8Tensor")
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg and exp_avg_sq.")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self.dtype_to_range_map = {torch.float16: torch.full([1], torch.finfo(torch.float16).max / 2.0)}
        self._scales: dict = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)
        self.set_grad_none = set_grad_none
        self.unscaled_copies = 0  # fp32 copies made by get_unscaled_state (what a zero-copy save must not call)

    # ----------------------------------------------------------------------------- gradients
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad and not set_to_none:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if self.use_decoupled_grad and set_to_none:
                    p.decoupled_grad = None
                elif self.use_decoupled_grad:
                    p.decoupled_grad.zero_()
                else:
                    p.grad = None

    # ----------------------------------------------------------------------------- scaled state
    def _apply_scale(self, state_name: str, unscaled: torch.Tensor, scaled: torch.Tensor, scale: torch.Tensor) -> None:
        """Store ``unscaled`` (fp32) into ``scaled``: bf16 as it is, fp16 divided by a new per-tensor scale."""
        assert unscaled.dtype == torch.float32
        if scaled.dtype == torch.bfloat16:
            scaled.copy_(unscaled.bfloat16())
            return
        dtype = self.name_to_dtype_map[state_name]
        assert scaled.dtype == dtype
        max_range = self.dtype_to_range_map[dtype]
        min_val, max_val = torch.aminmax(unscaled)
        absmax = torch.maximum(-min_val, max_val).to(torch.float32)
        torch.div(absmax, max_range, out=scale)
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        unscaled.mul_(rscale)
        scaled.copy_(unscaled)

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.float16:
            assert state[state_name].dtype == torch.float16
            unscaled = state[state_name].float()
            unscaled.mul_(self._scales[param][state_name])
        elif dtype == torch.float32:
            if self.store_param_remainders and state_name == "master_param" and param.dtype == torch.bfloat16:
                assert state[state_name].dtype == torch.int16
            else:
                assert state[state_name].dtype == torch.float32
            return state[state_name]
        elif dtype == torch.bfloat16:
            assert state[state_name].dtype == torch.bfloat16
            unscaled = state[state_name].float()
        else:
            raise RuntimeError(f"Dtype of {state_name} can only be fp8/fp16/bf16/fp32.")
        self.unscaled_copies += 1
        return unscaled

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        remainders = self.store_param_remainders and state_name == "master_param" and param.dtype == torch.bfloat16
        assert unscaled_state.dtype == (torch.int16 if remainders else torch.float32)
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False, remainders)
        dtype = self.name_to_dtype_map[state_name]
        if dtype != torch.float32:
            self._apply_scale(state_name, unscaled_state, state[state_name], self._scales[param][state_name])
        else:
            state[state_name].copy_(unscaled_state)

    def _initialize_state(self, param: torch.Tensor, state_name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[state_name]
        if store_param_remainders:
            data = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        else:
            data = torch.empty(param.shape, dtype=dtype, device=param.device)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones([1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    # ----------------------------------------------------------------------------- state dicts (unscaled, as TE's)
    def _id_map(self, saved_groups: list) -> dict:
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {name: self.get_unscaled_state(id_map[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is None:
                        continue
                    if self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16:
                        self.set_scaled_state(param, name, v[name])
                    else:
                        self.set_scaled_state(param, name, v[name].float())

    # ----------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step, lr, eps, decay = group["step"], group["lr"], group["eps"], group["weight_decay"]
            c1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for p in group["params"]:
                state = self.state[p]
                remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                if len(state) == 0:
                    self.initialize_state(p, remainders)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                m = self.get_unscaled_state(p, "exp_avg").clone()
                v = self.get_unscaled_state(p, "exp_avg_sq").clone()
                if self.master_weights and remainders:
                    main = _join_remainder(p.data, state["master_param"])
                elif self.master_weights:
                    main = self.get_unscaled_state(p, "master_param").clone()
                else:
                    main = p.data.float()
                g = grad.float()
                if not self.adam_w_mode:
                    g = g + decay * main
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + eps)
                if self.adam_w_mode:
                    update = update + decay * main
                main = main - lr * update
                if self.master_weights and remainders:
                    p.data.copy_(_split_remainder(main)[0])
                    state["master_param"].copy_(_split_remainder(main)[1])
                else:
                    p.data.copy_(main)
                    if self.master_weights:
                        self._store(p, "master_param", main)
                self._store(p, "exp_avg", m)
                self._store(p, "exp_avg_sq", v)
        return loss

    def _store(self, p: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        if self.name_to_dtype_map[name] == torch.float32:
            self.state[p][name].copy_(unscaled)
        else:
            self._apply_scale(name, unscaled, self.state[p][name], self._scales[p][name])


def precision_aware_config(config: Any, *, main_params_dtype: torch.dtype = torch.float32,
                           exp_avg_dtype: torch.dtype = torch.bfloat16, exp_avg_sq_dtype: torch.dtype = torch.bfloat16,
                           store_param_remainders: bool = True) -> Any:
    """An ``OptimizerConfig`` built without the flag, switched to ``--use-precision-aware-optimizer`` afterwards.

    Its ``__post_init__`` would import TE's FusedAdam to check its signature; the fields are set
    as ``__post_init__`` leaves them when that check passes (no fp8 recipe).
    """
    config.use_precision_aware_optimizer = True
    config.main_params_dtype = main_params_dtype
    config.exp_avg_dtype = exp_avg_dtype
    config.exp_avg_sq_dtype = exp_avg_sq_dtype
    config.store_param_remainders = store_param_remainders
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return config


@contextlib.contextmanager
def use_with_megatron_core() -> Iterator[None]:
    """megatron-core's optimizer factory and distributed optimizer as they are with TE 2.11 installed.

    ``get_megatron_optimizer`` and the distributed optimizer take ``FusedAdam`` (this class) as their
    Adam, the distributed optimizer takes the TE branches of ``state_dict``/``load_state_dict``, and
    ``is_te_min_version`` answers for TE 2.11. Restored when the block ends.
    """
    import megatron.core.optimizer as factory
    import megatron.core.optimizer.distrib_optimizer as distrib
    import megatron.core.utils as core_utils
    from packaging.version import Version

    saved = (factory.Adam, factory.USING_PYTORCH_OPTIMIZER, distrib.Adam, distrib.HAVE_APEX_OR_TE,
             distrib.USING_TE_OPTIMIZER, core_utils._te_version)
    factory.Adam, factory.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    distrib.Adam, distrib.HAVE_APEX_OR_TE, distrib.USING_TE_OPTIMIZER = FusedAdam, True, True
    core_utils._te_version = Version("2.11.0")
    try:
        yield
    finally:
        (factory.Adam, factory.USING_PYTORCH_OPTIMIZER, distrib.Adam, distrib.HAVE_APEX_OR_TE,
         distrib.USING_TE_OPTIMIZER, core_utils._te_version) = saved
