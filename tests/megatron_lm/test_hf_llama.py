"""Hugging Face Llama both ways, checked by transformers against Megatron-LM's own forward (fp32, CPU ranks).

* export: a Llama-style model (SwiGLU, RMSNorm, rotary, 4 heads in 2 query groups, untied
  embeddings) trained 3 iterations by ``pretrain_gpt.py`` at TP2 x PP2, exported ``--to hf``,
  loaded by ``transformers.AutoModelForCausalLM`` with no missing or unexpected keys: its logits
  on the tokens of Megatron-LM's first forward of that checkpoint (loaded at TP2 x PP1, a
  ``--finetune`` start) equal Megatron-LM's, padding columns aside, within ``LOGITS_ATOL``;
* import: a random ``LlamaForCausalLM`` (tied embeddings, rope theta 500000) saved by
  ``save_pretrained``, converted ``--to datastates --tp 2 --pp 2``: Megatron-LM's first forward
  from it (``--load OUT --finetune``) gives transformers' logits within ``LOGITS_ATOL``; a run
  with another rotary base is refused at the load, naming it;
* export, import, export again gives the same tensors, bit for bit, both ways round.

The logits are O(1) (max about 0.7); measured differences are about 2e-7.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers.megatron_lm_runs import DATASTATES, run  # noqa: E402
from helpers.procs import REPO, python_command  # noqa: E402
from megatron_ext.testing.megatron_lm import TINY_GPT, read_first_forward  # noqa: E402

LOGITS_ATOL = 1e-4
VOCAB = 1000  # TINY_GPT's --vocab-size (NullTokenizer): padded to 1024 at TP 2
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--num-layers", "2", "--norm-epsilon", "1e-5",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
UNTIED = ["--untie-embeddings-and-output-weights"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]


def cli(*args: str) -> subprocess.CompletedProcess:
    from helpers.trainer_runs import trainer_env

    proc = subprocess.run(python_command("-m", "megatron_ext", *args), cwd=REPO, env=trainer_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"megatron-ext {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def first_forward(checkout: Path, nproc: int, load: Path, model: list[str], workdir: Path, name: str):
    """Megatron-LM's first forward from ``load`` (a ``--finetune`` start): (tokens, logits)."""
    logits_dir = workdir / f"{name}-logits"
    run(checkout, nproc, [*model, "--load", str(load), "--finetune", "--train-iters", "1",
                          "--save", str(workdir / f"{name}-save"), "--save-interval", "100", *DATASTATES],
        workdir, name, record_logits=logits_dir)
    return read_first_forward(logits_dir)


def load_hf(directory: Path):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                                    output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched keys
    return model.eval()


def hf_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / name))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


def assert_same_tensors(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different[:5]


@pytest.fixture(scope="module")
def trained(checkout, tmp_path_factory) -> Path:
    """A Llama-style model trained 3 iterations by Megatron-LM at TP2 x PP2; its save directory."""
    workdir = tmp_path_factory.mktemp("llama-trained")
    result = run(checkout, 4, [*TINY_GPT, *LLAMA, *UNTIED, *TP2, *PP2, "--train-iters", "3", "--save-interval", "3",
                               "--save", str(workdir / "ckpt"), *DATASTATES], workdir, "train")
    assert [r["iteration"] for r in result.records] == [1, 2, 3]
    return workdir / "ckpt"


def test_megatron_lm_llama_exports_to_transformers_with_megatron_lm_logits(checkout, trained, tmp_path):
    import torch

    hf_dir = tmp_path / "hf"
    summary = json.loads(cli("export", str(trained), "--to", "hf", str(hf_dir), "--max-shard-size", "100KB",
                             "--json").stdout)
    assert summary["architecture"] == "LlamaForCausalLM" and summary["files"] > 1
    config = json.loads((hf_dir / "config.json").read_text())
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                   "max_position_embeddings", "tie_word_embeddings", "attention_bias")} == {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "attention_bias": False}
    model = load_hf(hf_dir)

    # Megatron-LM's own load and forward of the checkpoint, on another layout (TP2 x PP1).
    tokens, logits = first_forward(checkout, 2, trained, [*TINY_GPT, *LLAMA, *UNTIED, *TP2], tmp_path, "forward")
    assert logits.shape == (*tokens.shape, 1024) and int(tokens.max()) < VOCAB
    with torch.no_grad():
        theirs = model(tokens).logits
    diff = (theirs - logits[..., :VOCAB]).abs().max().item()
    print(f"export: max abs logit difference {diff:.3g}")
    assert diff <= LOGITS_ATOL

    # The per-group QKV split matters: Megatron's fused rows read as [all q | all k | all v] give other logits.
    from megatron_ext.megatron import hf_llama

    shape = hf_llama.shape_from_hf(config)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            fused = hf_llama.fuse_qkv(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, shape)
            for proj, rows in zip((attn.q_proj, attn.k_proj, attn.v_proj), fused.split([64, 32, 32])):
                proj.weight.copy_(rows)
        wrong = model(tokens).logits
    assert (wrong - logits[..., :VOCAB]).abs().max().item() > 100 * LOGITS_ATOL

    # Export, import (another layout), export again: the same tensors.
    again = tmp_path / "imported"
    cli("convert", str(hf_dir), "--to", "datastates", str(again), "--tp", "1", "--pp", "2")
    cli("export", str(again), "--to", "hf", str(tmp_path / "hf-again"))
    assert_same_tensors(hf_tensors(hf_dir), hf_tensors(tmp_path / "hf-again"))
    assert json.loads((tmp_path / "hf-again" / "config.json").read_text()) == config


def random_llama(directory: Path, tied: bool) -> None:
    """A small random ``LlamaForCausalLM`` as transformers saves it (norm weights moved off 1 so they count)."""
    import torch
    import transformers

    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, max_shard_size="100KB")


def test_transformers_llama_imports_and_megatron_lm_first_forward_matches(checkout, tmp_path):
    import torch

    hf_dir = tmp_path / "hf"
    random_llama(hf_dir, tied=True)
    summary = json.loads(cli("convert", str(hf_dir), "--to", "datastates", str(tmp_path / "ckpt"), "--tp", "2",
                             "--pp", "2", "--json").stdout)
    assert summary["ranks"] == 4 and summary["iteration"] == "release" and summary["padded_vocab_size"] == 1024
    assert "--rotary-base 500000" in summary["megatron_args"] and "--untie" not in summary["megatron_args"]
    assert cli("verify", str(tmp_path / "ckpt")).returncode == 0

    tokens, logits = first_forward(checkout, 4, tmp_path / "ckpt", [*TINY_GPT, *LLAMA, *TP2, *PP2,
                                                                     "--rotary-base", "500000"], tmp_path, "forward")
    model = load_hf(hf_dir)
    with torch.no_grad():
        theirs = model(tokens).logits
    diff = (theirs - logits[..., :VOCAB]).abs().max().item()
    print(f"import: max abs logit difference {diff:.3g}")
    assert diff <= LOGITS_ATOL
    assert logits[..., VOCAB:].abs().max().item() == 0  # the padding rows are zeros

    # A run whose arguments build another model (the shapes agree) is refused by name, also with --finetune.
    refused = run(checkout, 2, [*TINY_GPT, *LLAMA, *TP2, "--load", str(tmp_path / "ckpt"), "--finetune",
                                "--train-iters", "1", "--save", str(tmp_path / "refused-save"), "--save-interval", "100",
                                *DATASTATES],
                  tmp_path, "refused", expect_failure=True)
    assert ("which this run's arguments do not build: --rotary-base 10000 (the model: 500000)" in refused.log
            and str(hf_dir) in refused.log)

    # Import, export: transformers' own tensors again.
    cli("export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf-again"))
    assert_same_tensors(hf_tensors(hf_dir), hf_tensors(tmp_path / "hf-again"))
