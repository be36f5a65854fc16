"""Export and conversion of real checkpoints of the reference trainer's megatron-core GPT.

* ``export --names hf``: a TP=2 checkpoint, exported as Hugging Face GPT-2, loaded by
  ``transformers.GPT2LMHeadModel`` offline, gives the megatron-core model's logits on one batch
  (fp32; max abs difference <= 1e-5, the logits are O(1)).
* ``convert``: a ``--use-datastates`` run's checkpoint converted to torch_dist is resumed by the
  trainer's torch_dist path, whose checkpoint converted back is resumed by ``--use-datastates``;
  every resumed loss equals the uninterrupted run's bit for bit; converting the result to torch_dist
  again gives exactly the tensors the trainer wrote.
* ``convert`` of megatron-core's other optimizer formats (``fully_reshardable``,
  ``dp_zero_gather_scatter``), written by the trainer's own torch_dist save: to datastates and resumed
  bit-exactly by ``--use-datastates``, and back to the same torch_dist format.
* ``inspect``: layout, per-rank sizes and commit state of what these runs wrote.
* the path forms every checkpoint tool takes: a root, a root plus ``--iteration``/``--checkpoint``,
  one checkpoint's own directory.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from helpers.procs import python_command, torchrun_command  # noqa: E402
from helpers.torch_dist_compare import SAME_TENSORS  # noqa: E402
from helpers.trainer_runs import REPO, RUN_TIMEOUT_S, run_trainer, trainer_env  # noqa: E402

FP32 = ["--use-distributed-optimizer", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "7",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
LOGITS_ATOL = 1e-5


def cli(*args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(python_command("-m", "megatron_ext", *args), cwd=REPO, env=trainer_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if expect_ok:
        assert proc.returncode == 0, f"megatron-ext {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return proc


def _losses(records: list[dict]) -> dict[int, str]:
    return {r["iteration"]: r["loss"] for r in records}


# ------------------------------------------------------------------------------ export
@pytest.mark.multiproc
def test_export_hf_gpt2_matches_megatron_logits_and_megatron_names_are_consolidated(tmp_path):
    import torch
    import transformers  # a test dependency (requirements/cpu.txt)
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    parallel = [*FP32, "--tensor-model-parallel-size", "2"]
    run_trainer(2, [*parallel, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2",
                    "--use-datastates", "--datastates-host-cache-size", "0.05"], tmp_path / "train.jsonl", common=[])

    # The megatron-core model's logits: loaded by the trainer's own loader on the saved layout.
    logits_file = tmp_path / "logits.pt"
    cmd = torchrun_command(2, str(Path(__file__).parent / "logits_worker.py"), str(logits_file), *parallel,
                           "--load", str(ckpt), "--save", str(tmp_path / "unused"), "--use-datastates",
                           "--datastates-host-cache-size", "0.05")
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    reference = torch.load(logits_file)

    hf_dir = tmp_path / "hf"
    export = cli("export", str(ckpt), "--iteration", "2", "--to", "safetensors", str(hf_dir),
                 "--names", "hf", "--max-shard-size", "100KB", "--json")
    summary = json.loads(export.stdout)
    assert "export: done: " in export.stderr and " files, " in export.stderr  # progress on stderr
    # Megatron pads the vocabulary: said, with where the tokenizer is, since none is exported.
    assert summary["vocab_size"] == 256 and "padding" in summary["note"] and "tokenizer" in summary["note"]
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert summary["files"] == len(files) > 1 and set(index["weight_map"].values()) == set(files)
    total = 0
    index_mode = (hf_dir / "model.safetensors.index.json").stat().st_mode & 0o777
    for name in files:
        assert (hf_dir / name).stat().st_mode & 0o777 == index_mode  # not safetensors' own 0600
        tensors = load_file(hf_dir / name)
        assert all(index["weight_map"][k] == name for k in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= 100_000 or len(tensors) == 1, (name, nbytes)
        total += nbytes
    assert index["metadata"]["total_size"] == total

    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert logits.shape == reference["logits"].shape
    assert (logits - reference["logits"]).abs().max().item() <= LOGITS_ATOL

    # The QKV regrouping matters: Megatron's per-head [q k v] order in c_attn gives other logits.
    with torch.no_grad():
        for block in model.transformer.h:
            hidden = block.attn.c_attn.weight.shape[0]
            heads = model.config.n_head
            w = block.attn.c_attn.weight.t().reshape(3, heads, hidden // heads, hidden)
            block.attn.c_attn.weight.copy_(w.transpose(0, 1).reshape(3 * hidden, hidden).t())
        wrong = model(reference["tokens"]).logits
    assert (wrong - reference["logits"]).abs().max().item() > 100 * LOGITS_ATOL

    # Megatron names: one global tensor per key, equal to the GPT-2 export's (same assembly); the
    # checkpoint's own directory, the newest one taken when none is named.
    mg_dir = tmp_path / "megatron"
    plain = cli("export", str(ckpt / "iter_0000002"), "--to", "safetensors", str(mg_dir), "--dtype", "bf16")
    assert plain.stdout.startswith("exported ") and "megatron checkpoint" in plain.stdout
    mg = {}
    for name in json.loads((mg_dir / "model.safetensors.index.json").read_text())["weight_map"].values():
        mg.update(load_file(mg_dir / name))
    assert mg["embedding.word_embeddings.weight"].shape == (256, 64)  # both TP halves of the vocabulary
    assert mg["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 256, 64)  # layers x (TP-joined) rows
    assert all(t.dtype == torch.bfloat16 for t in mg.values())
    hf = model.state_dict()
    assert torch.equal(mg["embedding.word_embeddings.weight"], hf["transformer.wte.weight"].bfloat16())
    assert torch.equal(mg["decoder.layers.mlp.linear_fc2.weight"][1], hf["transformer.h.1.mlp.c_proj.weight"].t().bfloat16())
    assert not any(k.startswith("optimizer.") for k in mg)

    # Clear refusals: an existing output, a missing iteration.
    again = cli("export", str(ckpt), "--iteration", "2", "--to", "safetensors", str(mg_dir), expect_ok=False)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    missing = cli("export", str(ckpt), "--iteration", "9", "--to", "safetensors", str(tmp_path / "x"), expect_ok=False)
    assert missing.returncode == 2 and "not a committed datastates checkpoint" in missing.stderr


# ------------------------------------------------------------------------------ convert
@pytest.mark.multiproc
def test_convert_to_torch_dist_and_back_resumes_bit_exact(tmp_path):
    common_args = ["--train-iters", "4"]
    ds = tmp_path / "datastates"
    # Uninterrupted reference (checkpoints do not change training): saves iterations 2 and 4.
    reference = _losses(run_trainer(2, [*common_args, "--save", str(ds), "--save-interval", "2", "--use-datastates",
                                        "--datastates-host-cache-size", "0.05"], tmp_path / "reference.jsonl"))
    assert sorted(reference) == [1, 2, 3, 4]

    td = tmp_path / "torch_dist"
    summary = json.loads(cli("convert", str(ds), "--iteration", "2", "--to", "torch_dist", str(td), "--json").stdout)
    assert summary["rng_states"] == 1  # as Megatron-LM: data-parallel rank 0's per (pp, tp) coordinate
    assert (td / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (td / "iter_0000002" / "metadata.json").exists()

    # megatron-core's torch_dist loader resumes the converted checkpoint (and saves iteration 3 itself).
    resumed = _losses(run_trainer(2, [*common_args, "--load", str(td), "--save", str(td), "--save-interval", "3"],
                                  tmp_path / "torch_dist.jsonl"))
    assert resumed == {3: reference[3], 4: reference[4]}

    back = tmp_path / "back"
    summary = json.loads(cli("convert", str(td), "--iteration", "3", "--to", "datastates", str(back), "--json").stdout)
    assert summary["ranks"] == 2
    rows = json.loads(cli("inspect", str(back), "--json").stdout)
    assert [(r["checkpoint"], r["committed"], r["version"], r["ranks"]) for r in rows] == [("iter_0000003", True, 3, 2)]
    assert {k: v for k, v in rows[0]["layout"].items() if not k.endswith("_rank")} == {
        "world_size": 2, "tp": 1, "pp": 1, "dp": 2}
    assert cli("verify", str(back)).returncode == 0

    # And once more to torch_dist (bucket-space optimizer this time): the same tensors as the trainer wrote.
    again = tmp_path / "again"
    cli("convert", str(back), "--iteration", "3", "--to", "torch_dist", str(again))
    proc = subprocess.run(python_command("-c", SAME_TENSORS, str(td / "iter_0000003"), str(again / "iter_0000003")),
                          cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]

    resumed = _losses(run_trainer(2, [*common_args, "--load", str(back), "--save", str(back), "--use-datastates",
                                      "--datastates-host-cache-size", "0.05"], tmp_path / "back.jsonl"))
    assert resumed == {4: reference[4]}


@pytest.mark.multiproc
# Both formats differ from dp_reshardable's (the default, above) only in megatron-core's own layout of the
# optimizer state: with --run-slow, to keep the default run near 30 minutes.
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fully_reshardable", "dp_zero_gather_scatter"])
def test_convert_other_megatron_core_optimizer_formats_both_ways(tmp_path, fmt):
    """A torch_dist checkpoint in ``fmt`` (the trainer's own megatron-core save) converts to datastates,
    which ``--use-datastates`` resumes bit-exactly, and back to torch_dist in the same format, which
    megatron-core's loader resumes bit-exactly too."""
    common_args = ["--train-iters", "4"]
    td = tmp_path / "torch_dist"
    reference = _losses(run_trainer(2, [*common_args, "--save", str(td), "--save-interval", "2",
                                        "--torch-dist-optimizer-format", fmt], tmp_path / "reference.jsonl"))
    assert sorted(reference) == [1, 2, 3, 4]

    ds = tmp_path / "datastates"  # from the checkpoint's own directory
    summary = json.loads(cli("convert", str(td / "iter_0000002"), "--to", "datastates", str(ds), "--json").stdout)
    assert summary["optimizer_format"] == fmt and summary["iteration"] == 2
    assert cli("verify", str(ds)).returncode == 0
    resumed = _losses(run_trainer(2, [*common_args, "--load", str(ds), "--save", str(tmp_path / "after"),
                                      "--use-datastates", "--datastates-host-cache-size", "0.05"],
                                  tmp_path / "resumed.jsonl"))
    assert resumed == {3: reference[3], 4: reference[4]}

    again = tmp_path / "again"  # from the save directory: its newest committed checkpoint
    summary = json.loads(cli("convert", str(ds), "--to", "torch_dist", str(again), "--json").stdout)
    assert summary["optimizer_format"] == fmt and summary["iteration"] == 2
    compare = (
        "import sys, torch\n"
        "from megatron.core import dist_checkpointing\n"
        "from megatron.core.dist_checkpointing.serialization import load_plain_tensors\n"
        "from megatron_ext.megatron.convert import single_process_group\n"
        "with single_process_group():\n"
        "    a, b = (load_plain_tensors(p) for p in sys.argv[1:3])\n"
        "    ma, mb = (dist_checkpointing.load_content_metadata(p) for p in sys.argv[1:3])\n"
        "assert ma == mb and ma['distrib_optim_sharding_type'] == sys.argv[3], (ma, mb)\n"
        "a, b = ({k: v for k, v in d.items() if isinstance(v, torch.Tensor)} for d in (a, b))\n"
        "assert sorted(a) == sorted(b) and len(a) > 10, (sorted(a), sorted(b))\n"
        "assert all(torch.equal(a[k], b[k]) for k in a)\n"
    )
    proc = subprocess.run(python_command("-c", compare, str(td / "iter_0000002"), str(again / "iter_0000002"), fmt),
                          cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if fmt == "fully_reshardable":  # megatron-core's own loader takes it back (the trainer's torch_dist path)
        native = _losses(run_trainer(2, [*common_args, "--load", str(again), "--save", str(again),
                                         "--save-interval", "9", "--torch-dist-optimizer-format", fmt],
                                     tmp_path / "native.jsonl"))
        assert native == {3: reference[3], 4: reference[4]}


def test_checkpoint_tools_take_a_root_a_name_or_a_checkpoint_directory(tmp_path, capsys):
    """Engine API names (step_*), as the demo writes them: every tool, every path form."""
    import torch
    from safetensors.torch import load_file

    from megatron_ext.engine import CheckpointEngine
    from megatron_ext.locate import resolve

    root = tmp_path / "runs"
    model = torch.nn.Linear(4, 3)
    with CheckpointEngine({"save_dir": str(root), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        for step in (1, 2):
            engine.save({"model": model.state_dict(), "step": step}, f"step_{step:07d}", version=step)
            engine.commit(f"step_{step:07d}")
    assert resolve(str(root)).name == "step_0000002"  # the newest committed
    assert resolve(str(root), iteration=1).name == "step_0000001"  # by version
    assert resolve(str(root), checkpoint="step_0000001").name == "step_0000001"
    assert resolve(str(root / "step_0000001")).kind == "engine"
    from megatron_ext import cli as megatron_ext_cli

    def run(*args: str):
        capsys.readouterr()
        code = megatron_ext_cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    for form in ([str(root)], [str(root), "--iteration", "1"], [str(root / "step_0000001")]):
        code, out, _ = run("verify", *form)
        assert code == 0 and "OK" in out, (form, out)
        code, out, _ = run("inspect", *form, "--json")
        assert code == 0 and all(r["kind"] == "engine" for r in json.loads(out))
    code, out, err = run("export", str(root / "step_0000001"), "--to", "safetensors", str(tmp_path / "w"), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["kind"] == "engine" and summary["checkpoint"].endswith("step_0000001")
    weights = load_file(tmp_path / "w" / "model-00001-of-00001.safetensors")
    assert sorted(weights) == ["bias", "weight"] and torch.equal(weights["weight"], model.weight.detach())
    code, _, err = run("convert", str(root), "--to", "torch_dist", str(tmp_path / "td"))
    assert code == 2 and "is an engine API checkpoint, not one the Megatron adapter saved" in err
    code, _, err = run("verify", str(root / "step_0000001"), "--iteration", "2")
    assert code == 2 and "is checkpoint step_0000001, but --iteration/--checkpoint asks for step_0000002" in err


def test_inspect_reports_layout_sizes_and_uncommitted(tmp_path):
    import torch

    from megatron_ext.engine import CheckpointEngine
    from megatron_ext.engine.read.inspect import describe, format_rows

    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        engine.save({"w": torch.ones(1000)}, "iter_0000005", version=5,
                    extra={"layout": {"tp": 1, "pp": 1, "dp": 1, "tp_rank": 0}})
        engine.commit("iter_0000005")
    (tmp_path / "iter_0000006" / ".reports").mkdir(parents=True)
    rows = describe(str(tmp_path))
    assert [(r["checkpoint"], r["committed"]) for r in rows] == [("iter_0000005", True), ("iter_0000006", False)]
    assert rows[0]["layout"] == {"tp": 1, "pp": 1, "dp": 1, "tp_rank": 0}
    assert rows[0]["bytes_by_rank"]["0"] == rows[0]["bytes"] > 4000
    text = format_rows(rows)
    assert "dp=1 pp=1 tp=1" in text and "uncommitted" in text and "newest committed: iter_0000005" in text


def test_gpt2_mapping_refuses_layouts_it_cannot_express():
    import argparse

    import torch

    from megatron_ext.megatron.hf_gpt2 import UnsupportedLayout, plan_gpt2

    h, layers = 8, 2
    shapes = {
        "embedding.word_embeddings.weight": (16, h), "embedding.position_embeddings.weight": (4, h),
        "decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (layers, h),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, 3 * h, h),
        "decoder.layers.self_attention.linear_qkv.bias": (layers, 3 * h),
        "decoder.layers.self_attention.linear_proj.weight": (layers, h, h),
        "decoder.layers.self_attention.linear_proj.bias": (layers, h),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, h),
        "decoder.layers.mlp.linear_fc1.layer_norm_bias": (layers, h),
        "decoder.layers.mlp.linear_fc1.weight": (layers, 4 * h, h), "decoder.layers.mlp.linear_fc1.bias": (layers, 4 * h),
        "decoder.layers.mlp.linear_fc2.weight": (layers, h, 4 * h), "decoder.layers.mlp.linear_fc2.bias": (layers, h),
    }
    dtypes = dict.fromkeys(shapes, torch.float32)
    args = argparse.Namespace(num_attention_heads=2)
    plan, config = plan_gpt2(shapes, dtypes, args, lambda key, layer: None, None)
    assert config["tie_word_embeddings"] is True and config["activation_function"] == "gelu"
    assert len(plan) == 4 + 12 * layers
    assert {p.name: p.shape for p in plan}["transformer.h.1.attn.c_attn.weight"] == (h, 3 * h)

    rope = {k: v for k, v in shapes.items() if k != "embedding.position_embeddings.weight"}
    with pytest.raises(UnsupportedLayout, match="missing"):
        plan_gpt2(rope, dtypes, args, lambda key, layer: None, None)
    gqa = dict(shapes, **{"decoder.layers.self_attention.linear_qkv.weight": (layers, 2 * h, h)})
    with pytest.raises(UnsupportedLayout, match="grouped-query"):
        plan_gpt2(gqa, dtypes, args, lambda key, layer: None, None)
    for flag in ({"swiglu": True}, {"normalization": "RMSNorm"}, {"position_embedding_type": "rope"}):
        with pytest.raises(UnsupportedLayout):
            plan_gpt2(shapes, dtypes, argparse.Namespace(num_attention_heads=2, **flag), lambda key, layer: None, None)
    assert plan_gpt2(shapes, dtypes, argparse.Namespace(num_attention_heads=2, openai_gelu=True),
                     lambda key, layer: None, None)[1]["activation_function"] == "gelu_new"


def test_max_shard_size_parsing_and_packing():
    import torch

    from megatron_ext.megatron.export import group_into_files, parse_size
    from megatron_ext.megatron.hf_gpt2 import OutputTensor

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100KB") == 100_000
    assert parse_size("100B") == 100 and parse_size("1.5 MB") == 1_500_000
    for bad in ("five", "5XB", "0MB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="a bare number is ambiguous; write 100B for bytes"):
        parse_size("100")  # not 100 bytes, silently
    plan = [OutputTensor(f"t{i}", (n,), torch.float32, lambda: None) for i, n in enumerate([10, 10, 30, 5, 5])]
    files = group_into_files(plan, 80)  # bytes: 40, 40, 120 (alone), 20, 20
    assert [[t.name for t in f] for f in files] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
