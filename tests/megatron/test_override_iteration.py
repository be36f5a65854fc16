"""``--override-ckpt-iteration`` (Megatron-LM core_v0.19.0) on the saved run's meta, as the load applies it.

The resume itself, bit-identical to Megatron-LM's own, runs in its loop
(``tests/megatron_lm/test_regressions.py::test_override_ckpt_iteration_rewinds_the_run_as_megatron_does``).
Megatron-LM refuses another global batch size than the checkpoint's there (its data loader would
replay from the wrong offset); so does ours, with an error that is not "damaged" (no fallback).
"""

from __future__ import annotations

from argparse import Namespace

import pytest

from megatron_ext.megatron.saved_run import override_iteration
from megatron_ext.megatron.shard_reads import ModelMismatch


def _meta() -> dict:
    return {"iteration": 4, "layout": {"tp": 1, "pp": 1, "dp": 2},
            "args": Namespace(global_batch_size=8, consumed_train_samples=32, skipped_train_samples=3)}


def test_the_iteration_and_the_data_loaders_offset_are_overridden_on_a_copy():
    meta = _meta()
    got = override_iteration(meta, Namespace(override_ckpt_iteration=2, global_batch_size=8), "iter_0000004")
    assert got["iteration"] == 2
    assert (got["args"].consumed_train_samples, got["args"].skipped_train_samples) == (16, 0)
    assert meta["iteration"] == 4 and meta["args"].consumed_train_samples == 32  # the checkpoint's own stays


def test_without_the_flag_the_meta_is_unchanged():
    meta = _meta()
    assert override_iteration(meta, Namespace(override_ckpt_iteration=None, global_batch_size=4), "x") is meta


def test_another_global_batch_size_is_refused_naming_both():
    with pytest.raises(ModelMismatch, match=r"iter_0000004: .*global batch size \(8\) differs from the current "
                                            r"one \(4\)"):
        override_iteration(_meta(), Namespace(override_ckpt_iteration=2, global_batch_size=4), "iter_0000004")
