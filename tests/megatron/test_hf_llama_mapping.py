"""The Llama mapping's refusals and bad Hugging Face input, without a training run (the logits are checked
against Megatron-LM's own forward in tests/megatron_lm/test_hf_llama.py).

* a saved run the mapping cannot express (MoE, biases, interleaved rotary, ...) is refused with one
  line naming what is missing;
* a Hugging Face directory with a missing shard, a tensor of the wrong shape, an unknown
  architecture, pickled weights only: one ``CheckpointError`` naming the file;
* an imported checkpoint's model arguments against a run's: every difference named;
* the grouped QKV split and its inverse.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ext.engine import CheckpointError  # noqa: E402
from megatron_ext.megatron import hf_import, hf_llama  # noqa: E402
from megatron_ext.megatron.hf_gpt2 import UnsupportedLayout  # noqa: E402

H, LAYERS = 64, 2
SHAPES = {
    hf_llama.EMBEDDING: (1024, H), hf_llama.FINAL_NORM: (H,), hf_llama.OUTPUT: (1024, H),
    hf_llama.NORM_1: (LAYERS, H), hf_llama.QKV: (LAYERS, 128, H), hf_llama.PROJ: (LAYERS, H, H),
    hf_llama.NORM_2: (LAYERS, H), hf_llama.FC1: (LAYERS, 256, H), hf_llama.FC2: (LAYERS, H, 128),
}
LLAMA_ARGS = dict(num_attention_heads=4, group_query_attention=True, num_query_groups=2, kv_channels=16,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  vocab_size=1000, rotary_base=10000, layernorm_epsilon=1e-5, max_position_embeddings=64)


def plan(args: dict, shapes: dict = SHAPES):
    return hf_llama.plan_llama(shapes, dict.fromkeys(shapes, torch.float32), argparse.Namespace(**args),
                               lambda key, layer: None, None)


def test_llama_plan_and_config():
    tensors, config = plan(LLAMA_ARGS)
    shapes = {t.name: t.shape for t in tensors}
    assert shapes["model.embed_tokens.weight"] == (1000, H) == shapes["lm_head.weight"]  # padding left out
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, H)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, H)
    assert len(tensors) == 3 + 9 * LAYERS
    assert (config["num_key_value_heads"], config["head_dim"], config["tie_word_embeddings"]) == (2, 16, False)
    tied = {k: v for k, v in SHAPES.items() if k != hf_llama.OUTPUT}
    assert plan(LLAMA_ARGS, tied)[1]["tie_word_embeddings"] is True
    scaled = plan({**LLAMA_ARGS, "use_rope_scaling": True, "rope_scaling_factor": 8.0})[1]
    assert scaled["rope_parameters"]["rope_type"] == "llama3" and scaled["rope_scaling"]["factor"] == 8.0
    # A GPT-2 style run is not Llama's: export --to hf takes the GPT-2 mapping for it.
    assert not hf_llama.is_llama_family(argparse.Namespace(normalization="LayerNorm", swiglu=False))
    assert hf_llama.is_llama_family(argparse.Namespace(**LLAMA_ARGS))


@pytest.mark.parametrize("change, named", [
    ({"num_experts": 8}, "--num-experts 8: mixture of experts"),
    ({"add_bias_linear": True}, "bias on linear layers"),
    ({"rotary_interleaved": True}, "--rotary-interleaved True"),
    ({"qk_layernorm": True}, "--qk-layernorm True"),
    ({"normalization": "LayerNorm"}, "--normalization 'LayerNorm'"),
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5"),
    ({"multi_latent_attention": True}, "multi-latent attention"),
])
def test_llama_export_refuses_what_it_cannot_express_in_one_line(change, named):
    with pytest.raises(UnsupportedLayout) as refused:
        plan({**LLAMA_ARGS, **change})
    message = str(refused.value)
    assert message.startswith("cannot export as Llama: ") and named in message and "\n" not in message


def test_llama_export_refuses_moe_weights_and_unknown_grouping():
    moe = {**SHAPES, "decoder.layers.mlp.experts.linear_fc1.weight": (LAYERS, 8, 256, H)}
    with pytest.raises(UnsupportedLayout, match="unexpected .*experts"):
        plan(LLAMA_ARGS, moe)
    with pytest.raises(UnsupportedLayout, match="QKV has 128 rows"):
        plan({**LLAMA_ARGS, "num_query_groups": 4})
    with pytest.raises(UnsupportedLayout, match="records no arguments"):
        hf_llama.plan_llama(SHAPES, dict.fromkeys(SHAPES, torch.float32), None, lambda k, n: None, None)


def test_grouped_qkv_split_and_fuse():
    shape = hf_llama.LlamaShape(layers=1, hidden=8, heads=4, groups=2, head_dim=2, ffn=4, vocab=8, max_positions=8,
                                rope_theta=10000, rope_scaling=None, eps=1e-5, tied=True)
    rows = torch.arange(shape.qkv_rows).repeat_interleave(8).reshape(shape.qkv_rows, 8).float()
    q, k, v = hf_llama.split_qkv(rows, shape)
    # Group g's rows: q of heads 2g and 2g+1 (2 rows each), then k, then v of key/value head g.
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert k[:, 0].tolist() == [4, 5, 12, 13] and v[:, 0].tolist() == [6, 7, 14, 15]
    assert torch.equal(hf_llama.fuse_qkv(q, k, v, shape), rows)


def test_imported_model_arguments_against_the_run():
    shape = hf_llama.LlamaShape(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=128, vocab=1000,
                                max_positions=64, rope_theta=500000, rope_scaling=None, eps=1e-5, tied=True)
    saved = hf_llama.saved_args(shape, tp=2, pp=2, dp=1, divisible_by=128, dtype=torch.float32)
    run = argparse.Namespace(**vars(saved))
    assert hf_llama.argument_mismatches(saved, run) == []
    run.rotary_base, run.layernorm_epsilon, run.untie_embeddings_and_output_weights = 10000, 1e-6, True
    problems = hf_llama.argument_mismatches(saved, run)
    assert problems == ["--norm-epsilon 1e-06 (the model: 1e-05)", "--rotary-base 10000 (the model: 500000)",
                        "--untie-embeddings-and-output-weights True (the model: False)"]


# ------------------------------------------------------------------------------ bad Hugging Face input
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="10KB")
    return directory


def copy_of(hf_dir, tmp_path):
    import shutil

    return shutil.copytree(hf_dir, tmp_path / "copy")


def refused(directory, tmp_path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as error:
        hf_import.import_hf(str(directory), str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out" / "release").exists()
    return str(error.value)


def test_import_writes_every_rank_and_a_release_tracker(hf_dir, tmp_path):
    summary = hf_import.import_hf(str(hf_dir), str(tmp_path / "out"), tp=2, pp=2)
    assert summary["ranks"] == 4 and summary["padded_vocab_size"] == 256
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "release"
    with pytest.raises(FileExistsError, match="release"):
        hf_import.import_hf(str(hf_dir), str(tmp_path / "out"))


def test_import_into_an_object_store_commits_there(hf_dir, s3_root):
    from megatron_ext.engine import object_store
    from megatron_ext.engine.read.verify import verify_root

    summary = hf_import.import_hf(str(hf_dir), s3_root, tp=2)
    assert summary["out"] == f"{s3_root}/release" and summary["ranks"] == 2
    assert object_store.get(f"{s3_root}/latest_checkpointed_iteration.txt") == b"release"
    assert verify_root(s3_root, None, deep=True) == (["release"], [])
    with pytest.raises(FileExistsError, match="release exists"):
        hf_import.import_hf(str(hf_dir), s3_root)


def test_import_refuses_a_missing_shard(hf_dir, tmp_path):
    directory = copy_of(hf_dir, tmp_path)
    victim = sorted(directory.glob("model-*.safetensors"))[1]
    victim.unlink()
    message = refused(directory, tmp_path)
    assert message.startswith(f"{victim}: missing; model.safetensors.index.json lists it")


def test_import_reads_no_link_out_of_the_directory(hf_dir, tmp_path):
    directory = copy_of(hf_dir, tmp_path)
    victim = sorted(directory.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    victim.rename(outside)
    victim.symlink_to(outside)
    assert refused(directory, tmp_path) == (f"{victim}: a symbolic link; the importer reads this directory's own "
                                            "files only")


def test_import_refuses_a_tensor_of_the_wrong_shape(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = copy_of(hf_dir, tmp_path)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    path = directory / index["weight_map"][name]
    tensors = load_file(path)
    tensors[name] = torch.zeros(16, 16)
    save_file(tensors, path, metadata={"format": "pt"})
    message = refused(directory, tmp_path)
    assert message == f"{path}: {name} has shape [16, 16]; the model of config.json needs [8, 16]"


@pytest.mark.parametrize("change", [{"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
                                    {"model_type": "llama-but-not"}])
def test_import_refuses_an_unknown_architecture(hf_dir, tmp_path, change):
    directory = copy_of(hf_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    message = refused(directory, tmp_path)
    assert message.startswith(f"{directory / 'config.json'}: architecture ") and "takes LlamaForCausalLM" in message


def test_import_refuses_what_megatron_cannot_express(hf_dir, tmp_path):
    directory = copy_of(hf_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "attention_bias": True, "hidden_act": "gelu",
                                                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    message = refused(directory, tmp_path)
    assert "attention_bias true" in message and "hidden_act 'gelu'" in message and "rope_type 'yarn'" in message
    assert refused(hf_dir, tmp_path, pp=3).endswith("PP 3 does not divide num_hidden_layers 2")


def test_import_reads_no_pickle_and_names_a_broken_file(hf_dir, tmp_path):
    directory = copy_of(hf_dir, tmp_path)
    for path in directory.glob("model*"):
        path.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not read")
    message = refused(directory, tmp_path)
    assert message.startswith(f"{directory / 'pytorch_model.bin'}: pickled weights are not read")
    (directory / "pytorch_model.bin").unlink()
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    assert refused(directory, tmp_path).startswith(f"{directory / 'model.safetensors'}: not a readable safetensors")
    os.unlink(directory / "config.json")
    assert refused(directory, tmp_path) == f"{directory / 'config.json'}: missing; a Hugging Face model directory has one"


def test_convert_cli_refusals_are_one_line(hf_dir, tmp_path, capsys):
    from megatron_ext import cli

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cli.main(list(args))
        return code, capsys.readouterr().err

    code, err = run("convert", str(hf_dir), "--to", "torch_dist", str(tmp_path / "x"))
    assert code == 2 and "is a Hugging Face model directory: it converts --to datastates" in err
    code, err = run("convert", str(tmp_path), "--to", "datastates", str(tmp_path / "x"), "--tp", "2")
    assert code == 2 and "--tp: for a Hugging Face source only" in err
    directory = copy_of(hf_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    code, err = run("-q", "convert", str(directory), "--to", "datastates", str(tmp_path / "y"))
    assert code == 2 and err.count("\n") == 1 and "MistralForCausalLM" in err and "config.json" in err
