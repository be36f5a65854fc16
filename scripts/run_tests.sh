#!/usr/bin/env bash
# The test command of README.md: sets up .venv when needed, then runs the default test suite.
# Extra arguments go to pytest (e.g. --run-slow for the long crash trials and benchmarks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$ROOT/.venv/bin/python" -m pytest -q --durations=25 "$@" tests
