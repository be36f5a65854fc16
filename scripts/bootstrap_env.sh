#!/usr/bin/env bash
# Create .venv in the checkout (if missing) and install everything the demo and tests need.
# Idempotent: a second run only checks that the install is complete.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EXT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[bootstrap] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.megatron_ext_installed"
REQ="$ROOT/requirements/cpu.txt"
MEGATRON_LM_REQ="$ROOT/requirements/megatron-lm.txt"  # what megatron/training imports (tests run pretrain_gpt.py)
want="$(cat "$REQ" "$MEGATRON_LM_REQ" "$ROOT/setup.cfg" | sha1sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
echo "[bootstrap] installing requirements into $VENV (first run takes a few minutes)"
"$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
# torch first, from the exact pin, so no other package pulls a CUDA build.
"$VENV/bin/python" -m pip install --quiet "$(grep -E '^torch==' "$REQ")"
"$VENV/bin/python" -m pip install --quiet -r "$REQ" -r "$MEGATRON_LM_REQ"
# DeepSpeed builds against the torch already installed, never an isolated (CUDA) one.
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install --quiet --no-build-isolation "$(grep -E '^deepspeed' "$ROOT/requirements/deepspeed.txt")"
"$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT"
echo "$want" > "$STAMP"
echo "[bootstrap] done"
