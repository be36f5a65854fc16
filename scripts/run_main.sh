#!/usr/bin/env bash
# The main job of README.md: sets up .venv when needed, then runs the demo end to end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/megatron-ext" -v demo --out "$ROOT/runs/demo" "$@"
