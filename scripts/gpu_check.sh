#!/usr/bin/env bash
# GPU node check, one command, on a bare GPU node (torch with CUDA, plus the wheels it is given):
#   1. tests/gpu: every CUDA-only line of the engine (two GPUs also run the NCCL test);
#   2. bench engine --device cuda: blocked time, snapshot and flush against their limits;
#   3. Megatron-LM's own pretrain_gpt.py (the patched pin) over NCCL on all of this node's GPUs
#      (world size 1 on a one-GPU node): a Llama-style GPT, --transformer-impl transformer_engine
#      when TE imports (else local), --use-datastates --save-interval 1, SIGKILL, resume, bit for
#      bit against an uninterrupted run (megatron-ext main-job --device cuda, deterministic mode).
# One PASS/FAIL line per part, with its figures. Under 10 minutes on one H100.
#
#   scripts/gpu_check.sh [--megatron-dir DIR] [--wheels DIR] [--size-gb G] [--out DIR] [--dir BENCH_DIR]
#                        [--skip PART]...
#
# --megatron-dir DIR  the patched Megatron-LM checkout of the pin (its megatron/, pretrain_gpt.py,
#                     gpt_builders.py, model_provider.py suffice); default: scripts/fetch_megatron.sh's
# --wheels DIR        wheels for what the node lacks (megatron-core, pytest and their needs, see
#                     requirements/gpu-check.txt); installed with pip --no-index into OUT/site
# --skip PART         tests, bench or megatron (repeatable)
# Environment: configs/site.env (or $SITE_ENV) when present: SITE_SETUP is run first, $PYTHON is
# the interpreter (default python3), the benchmark writes under $LOCAL_SCRATCH (else --dir, else OUT).
# Output: OUT/tests.log, OUT/junit.xml, OUT/bench_engine.json, OUT/main-job/, OUT/summary.txt.
# Exit status: 0 all passed, 1 a part failed, 2 no usable GPU or a bad argument.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SIZE_GB=4
OUT=""
BENCH_DIR=""
MEGATRON_DIR=""
WHEELS=""
SKIP=" "
while [[ $# -gt 0 ]]; do
    case "$1" in
        --size-gb) SIZE_GB="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --dir) BENCH_DIR="$2"; shift 2 ;;
        --megatron-dir) MEGATRON_DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --skip)
            case "$2" in tests|bench|megatron) SKIP+="$2 " ;; *) echo "gpu_check.sh: --skip takes tests, bench or megatron, not '$2'" >&2; exit 2 ;; esac
            shift 2 ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || { echo "gpu_check.sh: cannot create $OUT" >&2; exit 2; }
BENCH_DIR="${BENCH_DIR:-${LOCAL_SCRATCH:-$OUT}}/gpu-check-bench-$$"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
line() { echo "$*" | tee -a "$SUMMARY"; }

if [[ -n "$WHEELS" ]]; then
    [[ -d "$WHEELS" ]] || { echo "gpu_check.sh: --wheels $WHEELS is not a directory" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
        "$WHEELS"/*.whl || { echo "gpu_check.sh: installing the wheels of $WHEELS failed" >&2; exit 2; }
    export PYTHONPATH="$PYTHONPATH:$OUT/site"  # after the node's own packages (its torch wins)
fi

"$PY" - <<'PYEOF' | tee -a "$SUMMARY" || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch {torch.__version__} sees no CUDA device")
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"gpu_check.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {names}")
PYEOF
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 2

status=0
# ------------------------------------------------------------------ 1. tests/gpu
if [[ "$SKIP" != *" tests "* ]]; then
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu --junitxml "$OUT/junit.xml" > "$OUT/tests.log" 2>&1
    rc=$?
    counts="$(tail -1 "$OUT/tests.log")"
    if [[ $rc -eq 0 ]]; then line "PASS tests/gpu: $counts"; else status=1; line "FAIL tests/gpu (exit $rc): $counts; see $OUT/tests.log"; fi
fi

# ------------------------------------------------------------------ 2. bench engine
if [[ "$SKIP" != *" bench "* ]]; then
    if "$PY" -m megatron_ext bench engine --device cuda --size-gb "$SIZE_GB" --json --dir "$BENCH_DIR" \
            > "$OUT/bench_engine.json" 2> "$OUT/bench_engine.log"; then
        "$PY" - "$OUT/bench_engine.json" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"PASS bench engine, {r['state_bytes'] / 1e9:.2f} GB on the GPU: blocked {r['datastates_blocking_s'] * 1e3:.1f} ms"
      f" vs DCP async_save {r['dcp_async_blocking_s'] * 1e3:.0f} ms (ratio {r['ratio_blocking_vs_dcp']:.4f});"
      f" snapshot {r['datastates_snapshot_s']:.2f} s at a device-to-host limit of {r['d2h_gbps']:.1f} GB/s"
      f" ({r['state_bytes'] / 1e9 / r['d2h_gbps']:.2f} s); flush {r['datastates_flush_gbps']:.2f} GB/s vs O_DIRECT"
      f" write {r['direct_write_gbps']:.2f} GB/s (ratio {r['ratio_flush_vs_direct']:.2f}); persisted"
      f" {r['datastates_persisted_s']:.2f} s; peak RSS / (state + cache) {r['ratio_rss_vs_state_plus_cache']:.2f}")
PYEOF
    else
        status=1
        line "FAIL bench engine --device cuda: see $OUT/bench_engine.log"
    fi
    rm -rf "$BENCH_DIR"
fi

# ------------------------------------------------------------------ 3. Megatron-LM over NCCL
if [[ "$SKIP" != *" megatron "* ]]; then
    if [[ -z "$MEGATRON_DIR" ]]; then
        MEGATRON_DIR="$(bash "$ROOT/scripts/fetch_megatron.sh" 2>"$OUT/fetch_megatron.log" | tail -1)" || MEGATRON_DIR=""
    fi
    if [[ -z "$MEGATRON_DIR" || ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]]; then
        status=1
        line "FAIL Megatron-LM: no patched checkout (pass --megatron-dir DIR, or run MEGATRON_LM_DIR=<mirror> scripts/fetch_megatron.sh first; $OUT/fetch_megatron.log)"
    elif ! grep -q "use_datastates" "$MEGATRON_DIR/megatron/training/arguments.py" 2>/dev/null; then
        status=1
        line "FAIL Megatron-LM: $MEGATRON_DIR does not carry the megatron_ext patches (scripts/apply_patches.sh)"
    else
        "$PY" -m megatron_ext main-job --device cuda --checkout "$MEGATRON_DIR" --out "$OUT/main-job" \
            > "$OUT/main-job.log" 2>&1
        rc=$?
        verdict="$(grep -E '^\[main-job\] (PASS|FAIL|error)' "$OUT/main-job.log" | tail -1 | sed 's/^\[main-job\] //')"
        figures="$(grep -E '^    (run|kill|checkpoints):' "$OUT/main-job.log" | sed 's/^ *//' | tr '\n' ';' | sed 's/;$//')"
        loaded="$(grep -E 'loaded iter_' "$OUT/main-job.log" | tail -1 | sed 's/^ *\[main-job\] *//')"
        if [[ $rc -eq 0 ]]; then line "PASS Megatron-LM over NCCL: $verdict; $figures; $loaded"
        else status=1; line "FAIL Megatron-LM over NCCL (exit $rc): ${verdict:-no verdict}; $figures; see $OUT/main-job.log"; fi
    fi
fi

line "gpu_check.sh: $([[ $status -eq 0 ]] && echo passed || echo FAILED); results in $OUT"
exit $status
