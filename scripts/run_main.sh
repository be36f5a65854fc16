#!/usr/bin/env bash
# The main job of README.md: sets up .venv when needed, then runs Megatron-LM's own pretrain_gpt.py
# (the patched checkout from scripts/fetch_megatron.sh; without it, the reference trainer, and it
# says so) training a Llama-style GPT on 8 CPU ranks (TP=2 x PP=2 x DP=2, bf16, distributed optimizer,
# NCCL emulated) with --use-datastates
# --save-interval 1, kills every rank with SIGKILL in the middle of the run, resumes from the
# newest committed checkpoint, and checks loss and grad norm against an uninterrupted run bit for bit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/megatron-ext" main-job --out "$ROOT/runs/main" "$@"
