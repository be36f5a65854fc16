"""The paper's model templates (configs/gpt_*.env) are the paper's real architectures.

* Each template's parameter count, computed from its env file (sourced by bash, as
  ``scripts/launch.sh`` sources it) the way Megatron-LM builds a GPT, is the published model's:
  within 2 % of the headline size, and exactly the published total where Megatron-LM can build the
  model (BLOOM-3B: less its embedding LayerNorm, which Megatron-LM does not have).
* ``CHECKPOINT_GB`` is that count at 14 bytes per parameter; ``PAPER_CHECKPOINT_GB`` the paper's table.
* ``launch.sh --dry-run`` passes the architecture to Megatron-LM (LLaMA2-70B's flags), leaves the
  CPU test configurations as they were, and rejects impossible architectures with one line.
* With the patched checkout (``scripts/fetch_megatron.sh``), Megatron-LM's own argument parser,
  ``validate_args`` and ``pretrain_gpt.py``'s model builder read each template's dry-run command
  line and build (on the meta device) a model of exactly the counted size.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch_site import placeholder_site
from helpers.procs import REPO, child_env

LAUNCH = REPO / "scripts" / "launch.sh"
CONFIGS = REPO / "configs"
WORKER = Path(__file__).with_name("megatron_count_worker.py")

# template -> (model, headline size as published, exact parameter count of the published model)
PUBLISHED = {
    "gpt_3b": ("BLOOM-3B", 3.00e9, 3_002_557_440),
    "gpt_7b": ("LLaMA2-7B", 6.74e9, 6_738_415_616),
    "gpt_13b": ("LLaMA2-13B", 13.0e9, 13_015_864_320),
    "gpt_30b": ("LLaMA-30B", 32.5e9, 32_528_943_616),
    "gpt_70b": ("LLaMA2-70B", 69.0e9, 68_976_648_192),
    "gpt_70b_180gpu": ("LLaMA2-70B", 69.0e9, 68_976_648_192),
}
# Published parameters Megatron-LM (core_v0.19.0) has no module for: BLOOM's LayerNorm of the word
# embeddings (weight and bias of hidden 2560). ALiBi, BLOOM's position scheme, has no parameters.
NOT_IN_MEGATRON = {"gpt_3b": 2 * 2560}
PAPER_CHECKPOINT_GB = {"gpt_3b": 45, "gpt_7b": 83, "gpt_13b": 166, "gpt_30b": 444, "gpt_70b": 1065,
                       "gpt_70b_180gpu": 1065}  # anchors.md: the paper's table, all ranks
BYTES_PER_PARAMETER = 2 + 4 + 4 + 4  # bf16 weights, fp32 main params, Adam's two fp32 moments

MODEL_VARS = ["NODES", "GPUS_PER_NODE", "TP", "PP", "NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH",
              "CHECKPOINT_GB", "PAPER_CHECKPOINT_GB"]
ARCH_VARS = ["VOCAB_SIZE", "MAKE_VOCAB_SIZE_DIVISIBLE_BY", "FFN_HIDDEN_SIZE", "NUM_QUERY_GROUPS", "SWIGLU",
             "NORMALIZATION", "NORM_EPSILON", "POSITION_EMBEDDING_TYPE", "ROTARY_BASE", "MAX_POSITION_EMBEDDINGS",
             "UNTIE_EMBEDDINGS", "DISABLE_BIAS_LINEAR", "HIDDEN_DROPOUT", "ATTENTION_DROPOUT"]
ARCH_FLAGS = ["--swiglu", "--normalization", "--norm-epsilon", "--position-embedding-type", "--rotary-base",
              "--group-query-attention", "--num-query-groups", "--ffn-hidden-size",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--make-vocab-size-divisible-by",
              "--hidden-dropout", "--attention-dropout"]


def read_config(path: Path) -> dict[str, str]:
    """The variables the env file sets, as bash (and so launch.sh) sees them; unset ones are ''."""
    script = 'set -a; source "$1"; set +a; shift; for v in "$@"; do printf "%s=%s\\n" "$v" "${!v-}"; done'
    res = subprocess.run(["bash", "-c", script, "_", str(path), *MODEL_VARS, *ARCH_VARS],
                         env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True, timeout=30)
    return dict(line.split("=", 1) for line in res.stdout.splitlines())


def padded_vocab(cfg: dict[str, str]) -> int:
    """Rows of the embedding: launch.sh's mock data gives the NullTokenizer VOCAB_SIZE - 1 ids plus its
    end-of-document id, and Megatron-LM pads to a multiple of make-vocab-size-divisible-by x TP."""
    multiple = int(cfg["MAKE_VOCAB_SIZE_DIVISIBLE_BY"] or 128) * int(cfg["TP"])
    return math.ceil(int(cfg["VOCAB_SIZE"]) / multiple) * multiple


def gpt_parameters(cfg: dict[str, str]) -> int:
    """Parameters of the GPT Megatron-LM builds from these settings (its defaults where unset)."""
    h, layers, heads = int(cfg["HIDDEN_SIZE"]), int(cfg["NUM_LAYERS"]), int(cfg["NUM_ATTENTION_HEADS"])
    groups = int(cfg["NUM_QUERY_GROUPS"] or heads)
    head_dim = h // heads
    gated = cfg["SWIGLU"] == "1"
    ffn = int(cfg["FFN_HIDDEN_SIZE"] or (int(4 * h * 2 / 3 / 64) * 64 if gated else 4 * h))
    bias = cfg["DISABLE_BIAS_LINEAR"] != "1"
    norm = h if cfg["NORMALIZATION"] == "RMSNorm" else 2 * h  # RMSNorm: a scale; LayerNorm: scale and shift
    qkv_out = (heads + 2 * groups) * head_dim  # queries, then keys and values of each key/value group
    fc1_out = 2 * ffn if gated else ffn  # SwiGLU: gate and up projections
    layer = (norm + h * qkv_out + heads * head_dim * h  # input norm, QKV, output projection
             + norm + h * fc1_out + ffn * h)  # pre-MLP norm, fc1, fc2
    if bias:
        layer += qkv_out + h + fc1_out + h
    vocab = padded_vocab(cfg)
    embedding = vocab * h
    if (cfg["POSITION_EMBEDDING_TYPE"] or "learned_absolute") == "learned_absolute":
        embedding += int(cfg["MAX_POSITION_EMBEDDINGS"] or cfg["SEQ_LENGTH"]) * h
    output = vocab * h if cfg["UNTIE_EMBEDDINGS"] == "1" else 0  # tied: the embedding is the output layer
    return embedding + layers * layer + norm + output  # + the final norm


@pytest.fixture()
def site(tmp_path):
    return placeholder_site(tmp_path)


def dry_run(site: Path, config: str, nodes: int, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_")) and k not in (*MODEL_VARS, *ARCH_VARS, "MODEL_CONFIG", "TRAINER",
                                                                    "MEGATRON_ENTRY", "MEGATRON_DATA_ARGS",
                                                                    "EXTRA_TRAINER_ARGS", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env.update(SITE_ENV=str(site), **extra)
    return subprocess.run([str(LAUNCH), "--config", config, "--dry-run", "--nodes", str(nodes)], env=env,
                          capture_output=True, text=True, timeout=60)


def trainer_argv(stdout: str) -> list[str]:
    """pretrain_gpt.py's arguments on the first node's command line."""
    line = next(line for line in stdout.splitlines() if line.startswith("node 0 "))
    return shlex.split(line.split("pretrain_gpt.py ", 1)[1])


# ---------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_models(name):
    model, headline, exact = PUBLISHED[name]
    cfg = read_config(CONFIGS / f"{name}.env")
    count = gpt_parameters(cfg)
    assert abs(count - headline) / headline < 0.02, f"{name} ({model}): {count:,} parameters, published {headline:,.0f}"
    assert count == exact - NOT_IN_MEGATRON.get(name, 0), f"{name} ({model}): {count:,}, published {exact:,}"
    assert padded_vocab(cfg) == int(cfg["VOCAB_SIZE"])  # the model's own vocabulary: nothing padded


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_checkpoint_size_is_what_adam_checkpoints(name):
    """bf16 weights + fp32 main params + two fp32 moments; the rest (RNG, args, index) is megabytes."""
    cfg = read_config(CONFIGS / f"{name}.env")
    assert int(cfg["CHECKPOINT_GB"]) == round(gpt_parameters(cfg) * BYTES_PER_PARAMETER / 1e9)
    assert int(cfg["PAPER_CHECKPOINT_GB"]) == PAPER_CHECKPOINT_GB[name]


def test_counter_counts_megatron_defaults():
    """The counter on Megatron-LM's default GPT (learned positions, LayerNorm, GeLU 4h, biases, tied):
    GPT-2 small's 124,439,808 parameters (vocabulary 50257 unpadded, 1024 positions)."""
    cfg = {**{v: "" for v in MODEL_VARS + ARCH_VARS}, "NUM_LAYERS": "12", "HIDDEN_SIZE": "768",
           "NUM_ATTENTION_HEADS": "12", "SEQ_LENGTH": "1024", "TP": "1", "VOCAB_SIZE": "50257",
           "MAKE_VOCAB_SIZE_DIVISIBLE_BY": "1"}
    assert gpt_parameters(cfg) == 124_439_808


# ---------------------------------------------------------------------------- launcher
LLAMA2_70B_FLAGS = ("--max-position-embeddings 4096 --ffn-hidden-size 28672 --group-query-attention "
                    "--num-query-groups 8 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 "
                    "--position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights "
                    "--disable-bias-linear --make-vocab-size-divisible-by 1 --hidden-dropout 0 --attention-dropout 0 ")


def test_gpt_70b_dry_run_passes_the_llama_flags(site):
    res = dry_run(site, "gpt_70b", 20)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("node ")]
    assert len(lines) == 20
    for line in lines:
        assert "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 2048 " in line
        assert LLAMA2_70B_FLAGS in line
        # Mock data: the NullTokenizer's 31999 ids + end-of-document = LLaMA's 32000, not padded.
        assert "--mock-data --tokenizer-type NullTokenizer --vocab-size 31999 " in line
    assert ("# model: 80 layers, hidden 8192, 64 heads in 8 key/value groups, SwiGLU MLP 28672, RMSNorm eps 1e-5, "
            "positions rope base 10000, vocabulary 32000, untied output layer, no biases\n") in res.stdout


def test_bloom_dry_run_has_no_position_table_and_keeps_megatron_defaults(site):
    res = dry_run(site, "gpt_3b", 1)
    assert res.returncode == 0, res.stderr
    line = res.stdout.splitlines()[-1]
    assert ("--max-position-embeddings 2048 --ffn-hidden-size 10240 --normalization LayerNorm --norm-epsilon 1e-5 "
            "--position-embedding-type none --hidden-dropout 0 --attention-dropout 0 ") in line
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention"):
        assert flag not in line
    assert "--vocab-size 250879 " in line


def test_a_real_tokenizer_decides_the_vocabulary(site):
    data = "--data-path /lustre/data/text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model /lustre/tok"
    res = dry_run(site, "gpt_70b", 20, MEGATRON_DATA_ARGS=data)
    assert res.returncode == 0, res.stderr
    line = res.stdout.splitlines()[-1]
    assert data in line and "--vocab-size" not in line and "--mock-data" not in line
    assert LLAMA2_70B_FLAGS in line


@pytest.mark.parametrize("config", ["cpu_tiny", "cpu_tiny_megatron"])
def test_cpu_configs_get_no_architecture_flags(site, config):
    res = dry_run(site, config, 1)
    assert res.returncode == 0, res.stderr
    args = trainer_argv(res.stdout) if "pretrain_gpt.py" in res.stdout else res.stdout.splitlines()[-1].split()
    assert not set(ARCH_FLAGS) & set(args), sorted(set(ARCH_FLAGS) & set(args))
    if config == "cpu_tiny_megatron":
        assert "--max-position-embeddings 32 " in res.stdout and "--vocab-size 1000 " in res.stdout


BASE = """TRAINER=megatron
NODES=1
GPUS_PER_NODE=4
NUM_LAYERS=2
HIDDEN_SIZE=768
NUM_ATTENTION_HEADS=12
SEQ_LENGTH=2048
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=1
TP=4
PP=nodes
TRAIN_ITERS=10
HOST_CACHE_GB=1
"""


@pytest.mark.parametrize("settings, message", [
    ("NUM_QUERY_GROUPS=5", "12 attention heads do not split into NUM_QUERY_GROUPS=5 key/value groups"),
    ("NUM_QUERY_GROUPS=6", "NUM_QUERY_GROUPS=6 is neither a multiple nor a divisor of TP=4"),
    ("NUM_QUERY_GROUPS=0", "NUM_QUERY_GROUPS must be a positive whole number, not '0'"),
    ("FFN_HIDDEN_SIZE=2050", "FFN_HIDDEN_SIZE=2050 does not split over TP=4"),
    ("HIDDEN_SIZE=770", "hidden size 770 is not a multiple of the 12 attention heads"),
    ("SWIGLU=yes", "SWIGLU must be 0 or 1, not 'yes'"),
    ("NORMALIZATION=BatchNorm", "NORMALIZATION must be LayerNorm or RMSNorm, not 'BatchNorm'"),
    ("NORM_EPSILON=-1e-5", "NORM_EPSILON must be a non-negative number, not '-1e-5'"),
    ("NORM_EPSILON=0", "NORM_EPSILON must be greater than 0, not '0'"),
    ("POSITION_EMBEDDING_TYPE=alibi", "POSITION_EMBEDDING_TYPE must be learned_absolute, rope or none, not 'alibi'"),
    ("ROTARY_BASE=10000", "ROTARY_BASE=10000 needs POSITION_EMBEDDING_TYPE=rope (it is 'learned_absolute')"),
    ("MAX_POSITION_EMBEDDINGS=1024", "MAX_POSITION_EMBEDDINGS=1024 is below SEQ_LENGTH=2048"),
    ("HIDDEN_DROPOUT=1", "HIDDEN_DROPOUT must be below 1, not '1'"),
    ("VOCAB_SIZE=1", "VOCAB_SIZE must be at least 2, not '1'"),
    ("TRAINER=reference\nSWIGLU=1\nVOCAB_SIZE=32000",
     "the reference trainer builds a plain GPT and cannot honour SWIGLU=1 of bad (use TRAINER=megatron)"),
])
def test_launcher_rejects_impossible_architectures(site, tmp_path, settings, message):
    config = tmp_path / "bad.env"
    config.write_text(BASE + settings + "\n")
    res = dry_run(site, str(config), 1)
    assert res.returncode == 2, res.stdout
    assert res.stderr.startswith(f"launch.sh: error: {message}") and res.stderr.count("\n") == 1, res.stderr


def test_reference_trainer_takes_vocabulary_and_dropout(site, tmp_path):
    config = tmp_path / "ref.env"
    config.write_text(BASE.replace("TRAINER=megatron", "TRAINER=reference") + "VOCAB_SIZE=512\nHIDDEN_DROPOUT=0\nATTENTION_DROPOUT=0\n")
    res = dry_run(site, str(config), 1)
    assert res.returncode == 0, res.stderr
    assert "--exit-signal-handler --vocab-size 512 --hidden-dropout 0 --attention-dropout 0" in res.stdout


# ---------------------------------------------------------------------------- Megatron-LM itself
@pytest.fixture(scope="module")
def megatron_builds(tmp_path_factory):
    """Megatron-LM's reading of every template's dry-run command line (megatron_count_worker.py)."""
    from helpers.megatron_lm_runs import checkout_or_skip

    checkout = checkout_or_skip()
    tmp = tmp_path_factory.mktemp("megatron_count")
    site = placeholder_site(tmp)
    requests = []
    for name in sorted(PUBLISHED):
        nodes = int(read_config(CONFIGS / f"{name}.env")["NODES"])
        res = dry_run(site, name, nodes)
        assert res.returncode == 0, res.stderr
        requests.append({"name": name, "world_size": 4 * nodes, "argv": trainer_argv(res.stdout)})
    (tmp / "requests.json").write_text(json.dumps(requests))
    proc = subprocess.run([sys.executable, str(WORKER), str(checkout), str(tmp / "requests.json")],
                          env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in results}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_megatron_builds_the_counted_model(megatron_builds, name):
    cfg = read_config(CONFIGS / f"{name}.env")
    built = megatron_builds[name]
    assert built["parameters"] == gpt_parameters(cfg)
    assert built["padded_vocab_size"] == int(cfg["VOCAB_SIZE"])
    heads = int(cfg["NUM_ATTENTION_HEADS"])
    llama = cfg["SWIGLU"] == "1"
    assert (built["num_layers"], built["hidden_size"], built["num_attention_heads"]) == (
        int(cfg["NUM_LAYERS"]), int(cfg["HIDDEN_SIZE"]), heads)
    assert built["num_query_groups"] == int(cfg["NUM_QUERY_GROUPS"] or heads)
    assert built["ffn_hidden_size"] == int(cfg["FFN_HIDDEN_SIZE"])
    assert built["gated_linear_unit"] is llama and built["activation"] == ("silu" if llama else "gelu")
    assert built["normalization"] == cfg["NORMALIZATION"]
    assert built["norm_epsilon"] == float(cfg["NORM_EPSILON"])
    assert built["position_embedding_type"] == cfg["POSITION_EMBEDDING_TYPE"]
    assert built["has_position_table"] is False  # rope or (BLOOM) none: no learned table
    if llama:
        assert built["rotary_base"] == int(cfg["ROTARY_BASE"])
    assert built["untied"] is llama and built["has_output_layer"] is llama
    assert built["add_bias_linear"] is not llama
    assert built["hidden_dropout"] == built["attention_dropout"] == 0.0
    assert built["seq_length"] == 2048
    assert built["max_position_embeddings"] == int(cfg["MAX_POSITION_EMBEDDINGS"] or cfg["SEQ_LENGTH"])
