#!/usr/bin/env bash
# Create .venv in the checkout (if missing) and install everything the demo and tests need.
# Idempotent: a second run only checks that the install is complete.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_EXT_VENV:-$ROOT/.venv}"
# Megatron-LM at the pin (core_v0.19.0) needs Python >= 3.12 (its pyproject's requires-python).
MIN_PY="3.12"
is_new_enough() { "$1" -c "import sys; sys.exit(sys.version_info < (${MIN_PY/./, }))" >/dev/null 2>&1; }

find_python() {
    # $PYTHON when set, else python3.12+ on PATH, else an interpreter pyenv installed (called directly:
    # a pyenv shim answers only for the version pyenv has selected).
    local cand
    if [[ -n "${PYTHON:-}" ]]; then
        is_new_enough "$PYTHON" || { echo "error: PYTHON=$PYTHON is not Python >= $MIN_PY" >&2; exit 1; }
        echo "$PYTHON"; return
    fi
    for cand in python3.12 python3.13 python3.14 python3; do
        if command -v "$cand" >/dev/null 2>&1 && is_new_enough "$cand"; then echo "$cand"; return; fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for cand in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
            cand="$(pyenv root)/versions/$cand/bin/python3"
            if is_new_enough "$cand"; then echo "$cand"; return; fi
        done
    fi
    echo "error: no Python >= $MIN_PY found (Megatron-LM core_v0.19.0 needs it): install one (e.g. pyenv install 3.12) or set PYTHON=/path/to/python3.12" >&2
    exit 1
}

if [[ -x "$VENV/bin/python" ]] && ! is_new_enough "$VENV/bin/python"; then
    echo "[bootstrap] $VENV is $("$VENV/bin/python" -V 2>&1), older than $MIN_PY: creating it again"
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    PY="$(find_python)"
    echo "[bootstrap] creating virtual environment $VENV with $("$PY" -V 2>&1) ($PY)"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.megatron_ext_installed"
REQ="$ROOT/requirements/cpu.txt"
MEGATRON_LM_REQ="$ROOT/requirements/megatron-lm.txt"  # what megatron/training imports (tests run pretrain_gpt.py)
NVRX_REQ="$ROOT/requirements/nvrx.txt"  # apart, in $VENV/nvrx (see the file)
want="$(cat "$REQ" "$MEGATRON_LM_REQ" "$NVRX_REQ" "$ROOT/setup.cfg" | sha1sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
echo "[bootstrap] installing requirements into $VENV (first run takes a few minutes)"
"$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
# torch first, from the exact pin, so no other package pulls another build. For Python 3.12 the
# registry's torch is its CUDA build (~4.7 GB with its CUDA libraries); it runs on CPUs unchanged.
"$VENV/bin/python" -m pip install --quiet "$(grep -E '^torch==' "$REQ")"
"$VENV/bin/python" -m pip install --quiet -r "$REQ" -r "$MEGATRON_LM_REQ"
# DeepSpeed builds against the torch already installed, never an isolated (CUDA) one.
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install --quiet --no-build-isolation "$(grep -E '^deepspeed' "$ROOT/requirements/deepspeed.txt")"
"$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT"
rm -rf "$VENV/nvrx"
"$VENV/bin/python" -m pip install --quiet --no-deps --target "$VENV/nvrx" -r "$NVRX_REQ"
echo "$want" > "$STAMP"
echo "[bootstrap] done"
