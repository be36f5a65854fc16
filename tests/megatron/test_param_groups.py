"""Param-group matching at load: ours accepts exactly the saved groups megatron-core's own matching accepts.

The oracle is ``MegatronOptimizer._filter_and_reorder_param_groups`` (megatron-core 0.19.0): it
pairs each of the optimizer's groups with a saved one by ``param_group_identifier_keys``, each key
read as the key, else its NeMo ``pre_`` alias, else None, and raises ``ValueError`` for a group it
cannot pair. Ours (``optimizer_load.unmatched_param_groups``, behind ``check_param_groups``) must
refuse the same cases. The oracle zips the optimizer's groups with the saved list, so a current
list longer than the saved one is only partly checked there; the distributed optimizer (the only
one ``check_param_groups`` checks) looks every group up, so the cases keep the current list no
longer than the saved one.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("megatron.core")

from megatron.core.optimizer.optimizer import MegatronOptimizer  # noqa: E402

from megatron_ext.megatron.optimizer_load import unmatched_param_groups  # noqa: E402

# A group as megatron-core's _get_param_groups builds one (the scheduler's overrides unset).
DECAY = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
         "max_lr": 1e-3, "min_lr": 1e-4}
NO_DECAY = dict(DECAY, wd_mult=0.0)


def nemo(group: dict) -> dict:
    """The group as NeMo saves it: ``wd_mult`` / ``lr_mult`` under their ``pre_`` names."""
    out = {k: v for k, v in group.items() if k not in ("wd_mult", "lr_mult")}
    return dict(out, pre_wd_mult=group["wd_mult"], pre_lr_mult=group["lr_mult"])


def without(group: dict, *keys: str) -> dict:
    return {k: v for k, v in group.items() if k not in keys}


#: id -> (the optimizer's groups, the saved groups)
CASES = {
    "same": ([DECAY, NO_DECAY], [DECAY, NO_DECAY]),
    "reordered": ([NO_DECAY, DECAY], [DECAY, NO_DECAY]),
    "subset_of_saved": ([NO_DECAY], [DECAY, NO_DECAY]),
    "not_saved": ([dict(DECAY, wd_mult=0.5)], [DECAY, NO_DECAY]),
    "saved_pre_aliases": ([DECAY, NO_DECAY], [nemo(DECAY), nemo(NO_DECAY)]),
    "current_pre_aliases": ([nemo(NO_DECAY), nemo(DECAY)], [DECAY, NO_DECAY]),
    "pre_alias_other_value": ([NO_DECAY], [nemo(dict(NO_DECAY, wd_mult=0.5))]),
    "pre_alias_and_key_key_wins": ([NO_DECAY], [dict(NO_DECAY, pre_wd_mult=1.0)]),
    "pre_alias_and_key_key_differs": ([NO_DECAY], [dict(DECAY, pre_wd_mult=0.0)]),
    "max_lr_differs": ([dict(DECAY, max_lr=2e-3)], [DECAY, NO_DECAY]),
    "min_lr_differs": ([dict(DECAY, min_lr=0.0)], [DECAY, NO_DECAY]),
    "max_lr_tells_groups_apart": ([dict(DECAY, max_lr=2e-3), DECAY], [DECAY, dict(DECAY, max_lr=2e-3)]),
    "missing_is_none": ([without(DECAY, "max_lr", "min_lr")], [dict(DECAY, max_lr=None, min_lr=None)]),
    "missing_saved_key": ([DECAY], [without(DECAY, "max_lr")]),
    "missing_current_key": ([without(DECAY, "is_decoupled_lr")], [DECAY]),
    "scheduler_overrides": ([dict(DECAY, start_wd=0.0, end_wd=0.1)], [dict(DECAY, start_wd=0.0, end_wd=0.1)]),
    "scheduler_override_differs": ([dict(DECAY, end_wd=0.1)], [dict(DECAY, end_wd=0.2)]),
    "optimizer_differs": ([dict(DECAY, optimizer="adam")], [dict(DECAY, optimizer="sgd")]),
    "expert_parallel_differs": ([dict(DECAY, is_expert_parallel=True)], [DECAY, NO_DECAY]),
}


def megatron_accepts(current: list[dict], saved: list[dict]) -> bool:
    def with_params(groups: list[dict]) -> list[dict]:
        return [dict(copy.deepcopy(g), params=[i]) for i, g in enumerate(groups)]

    try:
        MegatronOptimizer._filter_and_reorder_param_groups(with_params(current), with_params(saved))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", CASES)
def test_param_groups_match_as_megatron_core_matches_them(case):
    current, saved = CASES[case]
    accepted = megatron_accepts(current, saved)
    missing = unmatched_param_groups(current, saved)
    assert (not missing) == accepted, (f"{case}: megatron-core {'accepts' if accepted else 'refuses'}, "
                                       f"ours finds unmatched {missing}")


def test_the_cases_cover_both_answers():
    """The oracle accepts some cases and refuses others (a case list it answered one way would prove little)."""
    answers = {megatron_accepts(*CASES[c]) for c in CASES}
    assert answers == {True, False}
    assert megatron_accepts(*CASES["saved_pre_aliases"]) and not megatron_accepts(*CASES["max_lr_differs"])
