"""DeepSpeed checkpoints load without pickle unless the DeepSpeed config says ``"allow_pickle": true``.

Real DeepSpeed (ZeRO-1, one CPU rank, ``pickle_worker.py``) saves and loads through
``datastates_ckpt``. A normal checkpoint (DeepSpeed's own objects are on the adapter's
allow-list) round-trips with pickle off, every module and optimizer value bit for bit. A client
state holding an object of a class no allow-list names (stored pickled, with ``pickle_fallback``)
is refused by default with a message naming the class, the file and the config key, and loads
once the config trusts pickles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import REPO, child_env, free_port

WORKER = Path(__file__).with_name("pickle_worker.py")
SMALL = {"host_cache_size": 0.1}
MODEL_FILE = "global_step2/mp_rank_00_model_states.pt"


def _worker(mode: str, save_dir: Path, out: Path, section: dict, reference: Path, *extra: str) -> dict:
    """Run the worker as rank 0 of a world of 1; its JSON result."""
    env = child_env(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                    LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(save_dir), str(out), json.dumps(section),
                           str(reference), *extra], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and out.exists(), f"worker exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.multiproc
def test_a_deepspeed_round_trip_needs_no_pickle_and_is_bit_exact(tmp_path):
    ckpt, reference = tmp_path / "ckpt", tmp_path / "saved.pt"
    assert _worker("save", ckpt, tmp_path / "save.json", {**SMALL, "commit_wait": "durable"}, reference)["ok"]
    sidecars = list((ckpt / "global_step2").glob("*.state.json"))
    assert sidecars and not any('"$pickle"' in p.read_text() for p in sidecars)
    loaded = _worker("load", ckpt, tmp_path / "load.json", SMALL, reference)
    assert loaded.get("ok"), loaded.get("traceback", loaded)
    assert loaded["bit_exact"], loaded.get("difference")
    assert loaded["harness_step"] == 2


@pytest.mark.multiproc
def test_a_pickled_client_object_is_refused_unless_the_config_allows_pickle(tmp_path):
    ckpt, reference = tmp_path / "ckpt", tmp_path / "saved.pt"
    saved = _worker("save", ckpt, tmp_path / "save.json", {**SMALL, "commit_wait": "durable", "pickle_fallback": True},
                    reference, "note")
    assert saved["ok"]
    refused = _worker("load", ckpt, tmp_path / "refused.json", SMALL, reference)
    assert not refused["ok"] and refused["error_type"] == "UnsafeCheckpointError", refused
    message = refused["error"]
    assert "helpers.client_objects.RunNote" in message  # the class
    assert str(ckpt / MODEL_FILE) in message  # the file DeepSpeed asked for
    assert '"datastates_ckpt": {"allow_pickle": true}' in message  # the key that trusts it
    trusted = _worker("load", ckpt, tmp_path / "trusted.json", {**SMALL, "allow_pickle": True}, reference)
    assert trusted.get("ok"), trusted.get("traceback", trusted)
    assert trusted["note_is_run_note"] and trusted["note"] == "RunNote('saved by step 2', 2)"
    assert trusted["bit_exact"], trusted.get("difference")


def test_an_object_of_a_class_not_allowed_here_names_the_safe_classes_key(tmp_path):
    """Saved by a job that allowed the class, loaded by one that does not: the refusal says which key
    allows it (``allow_pickle`` does not: the object is not a pickle, and classes are never imported)."""
    from helpers.client_objects import RunNote
    from megatron_ext.deepspeed_adapter import DeepSpeedDataStatesEngine
    from megatron_ext.engine import UnsafeCheckpointError

    path = tmp_path / "ds" / "global_step1" / "mp_rank_00_model_states.pt"
    allowing = DeepSpeedDataStatesEngine({"datastates_ckpt": {**SMALL, "safe_classes": ["helpers.client_objects.RunNote"]}},
                                         rank=0)
    trusting = DeepSpeedDataStatesEngine({"datastates_ckpt": {**SMALL, "allow_pickle": True}}, rank=0)
    try:
        allowing.save({"note": RunNote("kept", 1)}, str(path))
        allowing.wait(persist=True)
        allowing.engine.wait_persisted()
        assert allowing.load(str(path))["note"] == RunNote("kept", 1)
        with pytest.raises(UnsafeCheckpointError) as info:
            trusting.load(str(path))
        message = str(info.value)
        assert str(path) in message and "helpers.client_objects.RunNote at /note" in message
        assert '"datastates_ckpt": {"safe_classes": ["helpers.client_objects.RunNote"]}' in message
    finally:
        allowing.shutdown()
        trusting.shutdown()
