#!/usr/bin/env bash
# GPU node check, one command, on a GPU node (torch with CUDA, plus what --prepare packed):
#   1. tests: pytest tests/gpu, every CUDA-only line of the engine (one NCCL rank per GPU);
#   2. bench: bench engine --device cuda --check, its figures against their limits; then bench offload
#      (a 200M-parameter shard: all-GPU, HDO at 1.0, a static split, interleaved; figures reported,
#      no limit enforced yet; on --device cpu a small shard whose variants must be bit-identical);
#   3. megatron: Megatron-LM's own pretrain_gpt.py (the patched pin) over NCCL on all of this
#      node's GPUs (world size 1 on one GPU): a Llama-style GPT, --use-datastates --save-interval 1,
#      SIGKILL once a checkpoint is committed, resume, bit for bit against an uninterrupted run
#      (megatron-ext main-job --device cuda, deterministic, Transformer Engine when it imports).
# Each part runs under a timeout (about 320 s in all) and ends in one PASS/FAIL/SKIP line.
#
#   scripts/gpu_check.sh --prepare DIR      here, with network: pack what a node without network needs
#   scripts/gpu_check.sh --from DIR         there: install from DIR only, run the three parts
#   scripts/gpu_check.sh [--megatron-dir M] [--wheels W]   a node with network (fetch_megatron.sh)
# Options: [--out RES] [--size-gb G] [--skip PART]... [--device cpu] [--keep-work]
#
# --prepare DIR   DIR/megatron-lm: the pin's patched megatron/, pretrain_gpt.py, gpt_builders.py,
#                 model_provider.py (scripts/fetch_megatron.sh's checkout); DIR/wheels: the cp312
#                 manylinux wheels of requirements/gpu-check.txt (megatron-core at the pin, with its
#                 compiled dataset helpers); DIR/MANIFEST; under 48 MiB. Inside the repository DIR
#                 must be ignored by git (.gpu-check/ is) so it travels as a carried path. Prints
#                 the device calls to make.
# --from DIR      --megatron-dir DIR/megatron-lm --wheels DIR/wheels, no network, no fallback.
# --wheels W      installed with pip --no-index --no-deps into a private folder put on PYTHONPATH;
#                 a wheel that holds a package the node already has is refused (it would shadow it).
# --out RES       where the results go (default $OUT when set, else runs/gpu-check-HOST-DATE),
#                 at most 8 files, none in folders: summary.txt, junit.xml, bench_engine.json,
#                 bench_offload.json, logs.tar.gz.
#                 Checkpoints and the benchmark's files go to a work folder ($LOCAL_SCRATCH, else
#                 /tmp), removed at the end unless --keep-work.
# --skip PART     tests, bench or megatron (repeatable); its line says SKIP.
# --device cpu    the same script path on a machine without a GPU (a shake-out): the CPU twins of
#                 tests/gpu, bench engine --device cpu, main-job on one CPU rank.
# Timeouts (seconds): GPU_CHECK_TIMEOUT_TESTS (90), _BENCH (80), _BENCH_OFFLOAD (60), _MEGATRON (150).
# Environment: configs/site.env (or $SITE_ENV) when present: SITE_SETUP is run first, $PYTHON is
# the interpreter (default python3), $LOCAL_SCRATCH the work folder's parent.
# Exit status: 0 all passed, 1 a part failed, 2 no CUDA, a bad argument or nothing to install from.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SIZE_GB=2
RES=""
MEGATRON_DIR=""
WHEELS=""
PREPARE=""
FROM=""
DEVICE=cuda
KEEP_WORK=0
SKIP=" "
MAX_PREPARED_MIB=48
T_TESTS="${GPU_CHECK_TIMEOUT_TESTS:-90}"
T_BENCH="${GPU_CHECK_TIMEOUT_BENCH:-80}"
T_BENCH_OFFLOAD="${GPU_CHECK_TIMEOUT_BENCH_OFFLOAD:-60}"
T_MEGATRON="${GPU_CHECK_TIMEOUT_MEGATRON:-150}"
die2() { echo "gpu_check.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --size-gb) SIZE_GB="$2"; shift 2 ;;
        --out) RES="$2"; shift 2 ;;
        --megatron-dir) MEGATRON_DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --prepare) PREPARE="$2"; shift 2 ;;
        --from) FROM="$2"; shift 2 ;;
        --device)
            case "$2" in cpu|cuda) DEVICE="$2" ;; *) die2 "--device takes cpu or cuda, not '$2'" ;; esac
            shift 2 ;;
        --keep-work) KEEP_WORK=1; shift ;;
        --skip)
            case "$2" in tests|bench|megatron) SKIP+="$2 " ;; *) die2 "--skip takes tests, bench or megatron, not '$2'" ;; esac
            shift 2 ;;
        -h|--help) sed -n '2,35p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die2 "unknown argument $1" ;;
    esac
done
[[ -n "$PREPARE" && -n "$FROM" ]] && die2 "--prepare and --from do not go together (--prepare here, --from there)"
SITE="${SITE_ENV:-$ROOT/configs/site.env}"
if [[ -f "$SITE" ]]; then
    # shellcheck disable=SC1090
    source "$SITE"
    if [[ -n "${SITE_SETUP:-}" ]]; then eval "$SITE_SETUP" || die2 "SITE_SETUP failed"; fi
fi
PY="${PYTHON:-python3}"
cd "$ROOT" || exit 2

# ================================================================== --prepare DIR (here, no device time)
if [[ -n "$PREPARE" ]]; then
    mkdir -p "$PREPARE" && DIR="$(cd "$PREPARE" && pwd)" || die2 "cannot create $PREPARE"
    case "$DIR/" in
        "$ROOT"/*)
            REL="${DIR#"$ROOT"/}"
            git -C "$ROOT" check-ignore -q "$REL/" \
                || die2 "$REL is inside the repository but not ignored by git: it would travel as part of the tree, not as a carried path (use .gpu-check, or add it to .gitignore)" ;;
        *) REL="$DIR"
           echo "gpu_check.sh: note: $DIR is outside the repository; the device tool carries only paths inside it" >&2 ;;
    esac
    rm -rf "$DIR/megatron-lm" "$DIR/wheels" "$DIR/MANIFEST"
    mkdir -p "$DIR/megatron-lm" "$DIR/wheels"
    SRC="$(bash "$ROOT/scripts/fetch_megatron.sh" | tail -1)" || die2 "scripts/fetch_megatron.sh failed (see above)"
    grep -q "use_datastates" "$SRC/megatron/training/arguments.py" 2>/dev/null || die2 "$SRC does not carry the megatron_ext patches"
    # megatron/ (megatron.training is the patched one the harness imports), the three entry files.
    tar -C "$SRC" --exclude=__pycache__ --exclude='*.pyc' -cf - megatron pretrain_gpt.py gpt_builders.py model_provider.py \
        | tar -C "$DIR/megatron-lm" -xf - || die2 "copying the checkout $SRC failed"
    req="$(grep -v '^\s*#' "$ROOT/requirements/gpu-check.txt" | grep -v '^\s*$')"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR/wheels" $req \
        || die2 "pip download of requirements/gpu-check.txt failed"
    source "$ROOT/scripts/megatron_pin.sh"
    {
        echo "megatron-lm $MEGATRON_PIN_TAG $MEGATRON_PIN_COMMIT patches $(cat "$PATCH_DIR"/[0-9][0-9][0-9][0-9]-*.patch | sha1sum | cut -d' ' -f1)"
        echo "prepared $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$ROOT" rev-parse --short HEAD)"
        (cd "$DIR" && sha256sum wheels/*.whl)
    } > "$DIR/MANIFEST"
    mib=$(( ($(du -sk "$DIR" | cut -f1) + 1023) / 1024 ))
    [[ $mib -le $MAX_PREPARED_MIB ]] || die2 "$DIR holds $mib MiB, over the $MAX_PREPARED_MIB MiB a carried path may take here"
    echo "gpu_check.sh: prepared $DIR: $mib MiB ($(du -sh "$DIR/megatron-lm" | cut -f1) Megatron-LM, $(du -sh "$DIR/wheels" | cut -f1) wheels: $(cd "$DIR/wheels" && ls | tr '\n' ' '))"
    echo "gpu_check.sh: the device calls (one run of about 6 minutes, of a session's 15; results come back under files_at):"
    echo "  run(command=\"bash scripts/gpu_check.sh --from $REL\", carry=[\"$REL\"], timeout_s=420)"
    echo "  give_back()   # at once, unless you rerun after a fix"
    exit 0
fi

# ================================================================== the check
if [[ -n "$FROM" ]]; then
    [[ -d "$FROM" && -f "$FROM/MANIFEST" ]] || die2 "--from $FROM: no prepared folder there (scripts/gpu_check.sh --prepare $FROM, here first)"
    MEGATRON_DIR="$FROM/megatron-lm"
    WHEELS="$FROM/wheels"
fi

[[ -z "$WHEELS" || -d "$WHEELS" ]] || die2 "--wheels $WHEELS is not a directory"

if [[ "$DEVICE" == cuda ]]; then
    gpus="$("$PY" -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: no CUDA: torch {torch.__version__} sees no GPU here; nothing was run (--device cpu runs the CPU twin)")
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {names}")
' 2>&1)" || { echo "${gpus##*$'\n'}" >&2; exit 2; }
else
    gpus="--device cpu (no GPU used: the CPU twin of each part)"
fi

RES="${RES:-${OUT:-$ROOT/runs/gpu-check-$(hostname -s)-$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$RES" && RES="$(cd "$RES" && pwd)" || die2 "cannot create $RES"
WORK="$(mktemp -d "${LOCAL_SCRATCH:-${TMPDIR:-/tmp}}/gpu-check.XXXXXX")" || die2 "cannot create a work folder"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
SUMMARY="$RES/summary.txt"
: > "$SUMMARY"
line() { echo "$*" | tee -a "$SUMMARY"; }
finish() {
    tar -C "$WORK" -czf "$RES/logs.tar.gz" logs 2>/dev/null || line "note: the logs could not be tarred"
    if [[ $KEEP_WORK -eq 1 ]]; then echo "gpu_check.sh: work folder kept: $WORK"; else rm -rf "$WORK"; fi
}
line "gpu_check.sh: $gpus"
export PYTHONPATH="$ROOT"

if [[ -n "$WHEELS" ]]; then
    if [[ -n "$FROM" ]] && ! (cd "$FROM" && sha256sum --quiet -c <(grep ' wheels/' MANIFEST)) > "$LOGS/install.log" 2>&1; then
        finish; die2 "$FROM/wheels do not match $FROM/MANIFEST ($RES/logs.tar.gz: install.log)"
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
        >> "$LOGS/install.log" 2>&1 || { finish; die2 "installing the wheels of $WHEELS failed (logs.tar.gz: install.log)"; }
    # PYTHONPATH comes before the node's site-packages: only what the node lacks may be there.
    shadowed="$("$PY" - "$WORK/site" <<'PYEOF'
import importlib.util, os, sys
names = {n[:-3] if n.endswith(".py") else n for n in os.listdir(sys.argv[1])
         if not n.endswith((".dist-info", ".data")) and not n.startswith(("_", ".")) and n != "bin"}
print(" ".join(sorted(n for n in names if importlib.util.find_spec(n) is not None)))
PYEOF
)"
    if [[ -n "$shadowed" ]]; then
        finish; die2 "the wheels hold packages this Python already has ($shadowed): they would shadow its own; keep them out of requirements/gpu-check.txt"
    fi
    export PYTHONPATH="$ROOT:$WORK/site"
fi

run_part() {  # run_part SECONDS LOG CMD...: the command under a timeout, its output to LOG; its exit code
    local t="$1" log="$2"
    shift 2
    timeout -k 15 "$t" "$@" > "$log" 2>&1
}
verdict() {  # verdict RC SECONDS: "" when 0, else why
    case "$1" in
        0) echo "" ;;
        124|137) echo "timed out after ${2}s" ;;
        *) echo "exit $1" ;;
    esac
}
status=0

# ------------------------------------------------------------------ 1. tests
if [[ "$SKIP" == *" tests "* ]]; then
    line "SKIP tests: --skip tests"
else
    if [[ "$DEVICE" == cuda ]]; then targets=(tests/gpu)
    else targets=(tests/gpu tests/engine/test_cuda_logic.py tests/engine/test_device_scenarios.py tests/engine/test_device.py); fi
    start=$SECONDS
    run_part "$T_TESTS" "$LOGS/tests.log" "$PY" -m pytest -q -rs -p no:cacheprovider "${targets[@]}" --junitxml "$RES/junit.xml"
    rc=$?
    why="$(verdict $rc "$T_TESTS")"
    counts="$(grep -E '(passed|failed|skipped|error)' "$LOGS/tests.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
    if [[ -z "$why" ]]; then line "PASS tests (${targets[*]}): $counts, $((SECONDS - start))s"
    else status=1; line "FAIL tests (${targets[*]}, $why): ${counts:-no counts}; logs.tar.gz: logs/tests.log"; fi
fi

# ------------------------------------------------------------------ 2. bench engine
if [[ "$SKIP" == *" bench "* ]]; then
    line "SKIP bench engine: --skip bench"
else
    start=$SECONDS
    size="$SIZE_GB"
    [[ "$DEVICE" == cpu ]] && size=0.05
    check=--check
    [[ "$DEVICE" == cpu ]] && check=""  # a 50 MB state on a CPU says nothing about the limits: reported only
    # One round (--repeats 1): the limits check, timed for one pass of every mode by T_BENCH.
    run_part "$T_BENCH" "$LOGS/bench_engine.log" sh -c '"$0" -m megatron_ext bench engine --device "$1" --size-gb "$2" --compute-s 1 --repeats 1 --json $5 --dir "$3" > "$4"' \
        "$PY" "$DEVICE" "$size" "$WORK/bench" "$RES/bench_engine.json" "$check"
    rc=$?
    why="$(verdict $rc "$T_BENCH")"
    figures="$("$PY" - "$RES/bench_engine.json" "$check" <<'PYEOF' 2>/dev/null
import json, sys
from megatron_ext.bench.engine_bench import LIMITS, check_limits
r = json.load(open(sys.argv[1]))
d2h = f"; d2h {r['d2h_gbps']:.1f} GB/s" if r.get("d2h_gbps") else ""
print(f"{r['state_bytes'] / 1e9:.2f} GB on {r['device']}: blocked {r['datastates_blocking_s'] * 1e3:.1f} ms vs DCP "
      f"{r['dcp_async_blocking_s'] * 1e3:.0f} ms (ratio {r['ratio_blocking_vs_dcp']:.4f}, limit <= 0.02); snapshot "
      f"{r['datastates_snapshot_s']:.2f} s{d2h}; flush/direct {r['ratio_flush_vs_direct']:.2f} (limit >= 0.90); "
      f"peak RSS/(state+cache) {r['ratio_rss_vs_state_plus_cache']:.2f} (limit <= 1.10)")
for broken in check_limits(r):
    print(f"outside its limit{'' if sys.argv[2] else ' (not enforced on CPU)'}: {broken}")
PYEOF
)"
    figures="$(echo "$figures" | tr '\n' ';' | sed 's/;$//; s/;/; /g' | tr -s ' ')"
    if [[ -z "$why" ]]; then line "PASS bench engine ($((SECONDS - start))s): $figures"
    elif [[ $rc -eq 1 && -n "$figures" ]]; then status=1; line "FAIL bench engine (a figure outside its limit): $figures"
    else status=1; line "FAIL bench engine ($why): ${figures:-no figures}; logs.tar.gz: logs/bench_engine.log"; fi
    start=$SECONDS
    params=200000000
    [[ "$DEVICE" == cpu ]] && params=200000
    run_part "$T_BENCH_OFFLOAD" "$LOGS/bench_offload.log" "$PY" -m megatron_ext bench offload --device "$DEVICE" \
        --params "$params" --fractions 0.5 --strides 2 --out "$RES/bench_offload.json"
    rc=$?
    why="$(verdict $rc "$T_BENCH_OFFLOAD")"
    figures="$("$PY" - "$RES/bench_offload.json" <<'PYEOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
print(", ".join(f"{v['variant']} {v['update_s'] * 1e3:.0f} ms ({v['params_per_s'] / 1e9:.2f} G params/s)" for v in r["variants"]))
PYEOF
)"
    if [[ -z "$why" ]]; then line "PASS bench offload ($((SECONDS - start))s): $figures"
    else status=1; line "FAIL bench offload ($why): ${figures:-no figures}; logs.tar.gz: logs/bench_offload.log"; fi
fi

# ------------------------------------------------------------------ 3. Megatron-LM over NCCL
if [[ "$SKIP" == *" megatron "* ]]; then
    line "SKIP Megatron-LM: --skip megatron"
else
    if [[ -z "$MEGATRON_DIR" ]]; then
        MEGATRON_DIR="$(bash "$ROOT/scripts/fetch_megatron.sh" 2>"$LOGS/fetch_megatron.log" | tail -1)" || MEGATRON_DIR=""
    fi
    if [[ -z "$MEGATRON_DIR" || ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]]; then
        status=1
        line "FAIL Megatron-LM: no patched checkout (--from DIR after --prepare DIR, or --megatron-dir DIR; logs.tar.gz: logs/fetch_megatron.log)"
    elif ! grep -q "use_datastates" "$MEGATRON_DIR/megatron/training/arguments.py" 2>/dev/null; then
        status=1
        line "FAIL Megatron-LM: $MEGATRON_DIR does not carry the megatron_ext patches (scripts/apply_patches.sh)"
    else
        ranks=()
        over=NCCL
        [[ "$DEVICE" == cpu ]] && ranks=(--ranks 1) && over="emulated NCCL on one CPU rank"
        start=$SECONDS
        run_part "$T_MEGATRON" "$LOGS/main-job.log" "$PY" -m megatron_ext main-job --trainer megatron --device "$DEVICE" \
            "${ranks[@]}" --checkout "$MEGATRON_DIR" --out "$WORK/main-job"
        rc=$?
        why="$(verdict $rc "$T_MEGATRON")"
        # Its logs, records and telemetry (not the checkpoints) go into the tarball.
        (cd "$WORK" && find main-job -path main-job/checkpoints -prune -o -type f -print 2>/dev/null; \
         find main-job/checkpoints -path '*datastates_telemetry*' -type f 2>/dev/null) \
            | (cd "$WORK" && xargs -r cp --parents -t "$LOGS") 2>/dev/null
        result="$(grep -E '^\[main-job\] (PASS|FAIL|error)' "$LOGS/main-job.log" | tail -1 | sed 's/^\[main-job\] //')"
        figures="$(grep -E '^    (run|kill|checkpoints):' "$LOGS/main-job.log" | sed 's/^ *//' | tr '\n' ';' | sed 's/;$//; s/;/; /g' | tr -s ' ')"
        loaded="$(grep -E 'loaded iter_' "$LOGS/main-job.log" | tail -1 | sed 's/^ *\[main-job\] *//')"
        if [[ -z "$why" ]]; then line "PASS Megatron-LM over $over ($((SECONDS - start))s): $result; $figures; $loaded"
        else status=1; line "FAIL Megatron-LM over $over ($why): ${result:-no verdict}; $figures; logs.tar.gz: logs/main-job.log"; fi
    fi
fi

finish
line "gpu_check.sh: $([[ $status -eq 0 ]] && echo passed || echo FAILED); results in $RES ($(ls "$RES" | tr '\n' ' '))"
exit $status
