#!/usr/bin/env bash
# GPU node check, one command: every CUDA-only line of the engine (pytest tests/gpu) and the engine
# benchmark on this node's GPU (megatron-ext bench engine --device cuda). Run it from the checkout
# on a GPU node (two GPUs also run the NCCL test), or through Slurm: scripts/slurm_submit.sh gpu_check
#
#   scripts/gpu_check.sh [--size-gb G] [--out DIR] [--dir BENCH_DIR]
#
# Environment: configs/site.env (or $SITE_ENV) when present: SITE_SETUP is run first, $PYTHON is
# the interpreter (default python3: torch with CUDA, this package and pytest importable), and the
# benchmark writes under $LOCAL_SCRATCH (else --dir, else the output directory).
# Output: DIR/tests.log, DIR/junit.xml, DIR/bench_engine.json, a summary on stdout.
# Exit status: 0 all passed, 1 a test or the benchmark failed, 2 no usable GPU.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SIZE_GB=4
OUT=""
BENCH_DIR=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --size-gb) SIZE_GB="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --dir) BENCH_DIR="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
SITE="${SITE_ENV:-$ROOT/configs/site.env}"
if [[ -f "$SITE" ]]; then
    # shellcheck disable=SC1090
    source "$SITE"
    if [[ -n "${SITE_SETUP:-}" ]]; then eval "$SITE_SETUP" || { echo "gpu_check.sh: SITE_SETUP failed" >&2; exit 2; }; fi
fi
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/runs/gpu-check-$(hostname -s)-$(date +%Y%m%d-%H%M%S)}"
BENCH_DIR="${BENCH_DIR:-${LOCAL_SCRATCH:-$OUT}}/gpu-check-bench-$$"
mkdir -p "$OUT"
cd "$ROOT"

"$PY" - <<'PYEOF' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch {torch.__version__} sees no CUDA device")
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"gpu_check.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {names}")
PYEOF

status=0
echo "gpu_check.sh: pytest tests/gpu -> $OUT/tests.log"
"$PY" -m pytest -q -rs tests/gpu --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
echo "gpu_check.sh: bench engine --device cuda --size-gb $SIZE_GB (writing under $BENCH_DIR)"
if "$PY" -m megatron_ext bench engine --device cuda --size-gb "$SIZE_GB" --json --dir "$BENCH_DIR" \
        > "$OUT/bench_engine.json"; then
    "$PY" - "$OUT/bench_engine.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"bench engine, {r['state_bytes'] / 1e9:.2f} GB on the GPU:")
print(f"  blocked (save + wait_snapshot) {r['datastates_blocking_s'] * 1e3:.1f} ms vs DCP async_save"
      f" {r['dcp_async_blocking_s'] * 1e3:.0f} ms (ratio {r['ratio_blocking_vs_dcp']:.4f}, target <= 0.02)")
print(f"  snapshot {r['datastates_snapshot_s']:.2f} s (device-to-host limit {r['d2h_gbps']:.1f} GB/s:"
      f" {r['state_bytes'] / 1e9 / r['d2h_gbps']:.2f} s), persisted {r['datastates_persisted_s']:.2f} s")
print(f"  flush {r['datastates_flush_gbps']:.2f} GB/s vs O_DIRECT write {r['direct_write_gbps']:.2f} GB/s"
      f" (ratio {r['ratio_flush_vs_direct']:.2f}, target >= 0.90)")
print(f"  torch.save {r['torch_save_s']:.2f} s; peak RSS / (state + cache) {r['ratio_rss_vs_state_plus_cache']:.2f}")
PYEOF
else
    status=1
    echo "gpu_check.sh: bench engine failed" >&2
fi
rm -rf "$BENCH_DIR"
echo "gpu_check.sh: $([[ $status -eq 0 ]] && echo passed || echo FAILED); results in $OUT"
exit $status
