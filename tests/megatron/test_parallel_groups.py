"""The process groups Megatron-LM hands to save_checkpoint / load_checkpoint are the ones the save path uses.

Two gloo ranks (torchrun), megatron-core's parallel_state at TP 1 / DP 2, a real GPTModel; the
worker (``parallel_groups_worker.py``) builds the layout, the ownership all-gather and plan, and
the model's sharded state for three data-parallel (``dp_cp``) groups: none given (parallel_state's),
a group of each rank alone, and a new group of parallel_state's two ranks.
"""

import json
import subprocess
from pathlib import Path

import pytest

from helpers.procs import torchrun_command
from megatron_ext.testing.megatron_lm import environment

pytest.importorskip("megatron.core")

WORKER = Path(__file__).with_name("parallel_groups_worker.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("groups") / "result"
    proc = subprocess.run(torchrun_command(2, str(WORKER), str(out)), env=environment(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


def test_default_groups_are_parallel_states(seen):
    """No group given: parallel_state's data-parallel group (DP 2), gathered over its gloo twin."""
    for rank, ranks_view in enumerate(seen):
        case = ranks_view["default"]
        assert case["layout"] == {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "tp_rank": 0, "pp_rank": 0,
                                  "dp_rank": rank}
        assert case["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert case["gather_on_gloo_twin"] and case["gather_backend"] == "gloo"
        assert case["metadata_group_is_given"] and case["replica_dp_entries"] == [rank]
        assert case["bytes_by_dp_rank"] == seen[0]["default"]["bytes_by_dp_rank"] and len(case["bytes_by_dp_rank"]) == 2
    # The replicated model is split between the two data-parallel ranks: each shard written once.
    owned = [set(r["default"]["owned"]) for r in seen]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(seen[0]["default"]["candidates"])


def test_a_given_group_of_each_rank_alone_is_used(seen):
    """dp_cp_group of the rank alone: DP 1 in the layout, a one-item gather on that group, every shard owned
    by the rank itself, and the model's replica ids counted over that group."""
    for ranks_view in seen:
        case = ranks_view["alone"]
        assert case["layout"] == {"world_size": 2, "tp": 1, "pp": 1, "dp": 1, "tp_rank": 0, "pp_rank": 0,
                                  "dp_rank": 0}
        assert case["gathered"] == [{"rank": ranks_view["rank"]}]
        assert case["gather_on_given_group"] and not case["gather_on_gloo_twin"]
        assert case["metadata_group_is_given"] and case["replica_dp_entries"] == [0]
        assert len(case["bytes_by_dp_rank"]) == 1
        assert case["owned"] == case["candidates"]


def test_a_given_group_of_parallel_states_ranks_gathers_over_the_gloo_twin(seen):
    """A group object other than parallel_state's but with its ranks: its layout, and the gloo twin gathers."""
    for rank, ranks_view in enumerate(seen):
        case = ranks_view["same_ranks"]
        assert case["layout"] == seen[rank]["default"]["layout"]
        assert case["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert case["gather_on_gloo_twin"] and case["gather_backend"] == "gloo"
        assert case["metadata_group_is_given"] and case["replica_dp_entries"] == [rank]
        assert case["owned"] == ranks_view["default"]["owned"]
