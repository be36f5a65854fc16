#!/usr/bin/env bash
# Shared launcher of the Slurm templates (slurm/*.sh): one torchrun per node through srun, c10d
# rendezvous on the first node of the allocation, --use-datastates --save-interval 1, the shared
# level (--save = --load, so a requeued job resumes from the newest committed checkpoint) on the
# parallel file system and the node-local level on each node's scratch disk.
#
#   scripts/launch.sh --config gpt_70b [--site FILE] [--dry-run | --check] [--nodes N] [-- extra trainer args]
#
# --config NAME|FILE  model config (configs/NAME.env); default $MODEL_CONFIG
# --site FILE         site config; default $SITE_ENV, else configs/site.env when it exists
# --dry-run           print the command line of every node and exit (no srun, nothing created)
# --check             preflight on the login node, before any allocation (scripts/slurm_submit.sh runs it
#                     before every submission): the Megatron-LM checkout is at the pin with the patches
#                     applied, megatron_ext (and megatron.core) import under SITE_SETUP with $PYTHON,
#                     Transformer Engine imports or TRANSFORMER_IMPL=local, the data paths exist or mock
#                     data is explicit (MOCK_DATA=1), the checkpoint root is writable, no placeholder left
# --nodes N           outside Slurm (with --dry-run or --check): pretend an allocation of N nodes
#
# Inside the job, the batch shell traps SIGUSR1 (#SBATCH --signal=B:USR1@300) and SIGTERM: it
# forwards $FORWARD_SIGNAL (default SIGTERM) to the training step, waits up to $STOP_GRACE_S for it
# to end (Megatron-LM with --exit-signal-handler saves, and the patched finalize waits until every
# checkpoint is committed), prints the committed iteration, then `scontrol requeue`s the job.
# Before a step starts, the rendezvous port must be free (waits $PORT_WAIT_S, then takes the next
# free port); a step that fails before committing any checkpoint is retried $STEP_RETRIES times
# (default 2) after $STEP_RETRY_DELAY_S, each with a fresh rendezvous id. docs/SLURM.md has all
# settings, including MEGATRON_ENTRY (how pretrain_gpt.py is run; unset on GPU clusters).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "launch.sh: error: $*" >&2; exit 2; }
say() { echo "launch.sh: $*" >&2; }

CONFIG="${MODEL_CONFIG:-}"
SITE="${SITE_ENV:-}"
DRY_RUN=0
CHECK=0
FAKE_NODES=""
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) [[ $# -ge 2 ]] || die "--config needs a value"; CONFIG="$2"; shift 2 ;;
        --config=*) CONFIG="${1#*=}"; shift ;;
        --site) [[ $# -ge 2 ]] || die "--site needs a value"; SITE="$2"; shift 2 ;;
        --site=*) SITE="${1#*=}"; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --check) CHECK=1; shift ;;
        --nodes) [[ $# -ge 2 ]] || die "--nodes needs a value"; FAKE_NODES="$2"; shift 2 ;;
        --nodes=*) FAKE_NODES="${1#*=}"; shift ;;
        -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown argument '$1' (trainer arguments go after --)" ;;
    esac
done
[[ $DRY_RUN -eq 0 || $CHECK -eq 0 ]] || die "--dry-run and --check exclude each other"

# ------------------------------------------------------------------ configuration
[[ -n "$CONFIG" ]] || die "no model config: pass --config NAME (one of: $(cd "$ROOT/configs" && ls *.env | sed 's/\.env$//' | tr '\n' ' '))"
if [[ -f "$CONFIG" ]]; then CONFIG_FILE="$CONFIG"; else CONFIG_FILE="$ROOT/configs/${CONFIG%.env}.env"; fi
[[ -f "$CONFIG_FILE" ]] || die "model config '$CONFIG' not found (looked for $CONFIG_FILE)"
CONFIG_NAME="$(basename "${CONFIG_FILE%.env}")"

if [[ -n "$SITE" ]]; then
    [[ -f "$SITE" ]] || die "site config '$SITE' not found (from --site or SITE_ENV)"
    SITE_FILE="$SITE"
elif [[ -f "$ROOT/configs/site.env" ]]; then
    SITE_FILE="$ROOT/configs/site.env"
else
    SITE_FILE=""  # everything from the environment
fi
# Site first (paths, environment), then the model (sizes); the environment fills what neither sets.
set -a
# shellcheck disable=SC1090
[[ -n "$SITE_FILE" ]] && source "$SITE_FILE"
# shellcheck disable=SC1090
source "$CONFIG_FILE"
set +a

for v in TRAINER GPUS_PER_NODE NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH MICRO_BATCH_SIZE \
         GLOBAL_BATCH_SIZE TP PP TRAIN_ITERS HOST_CACHE_GB; do
    [[ -n "${!v:-}" ]] || die "$v is not set by $CONFIG_FILE"
done
for v in CKPT_ROOT LOCAL_SCRATCH; do
    [[ -n "${!v:-}" ]] || die "$v is not set: put it in configs/site.env (see configs/site.env.example) or the environment"
done
# Placeholders of configs/site.env.example (<account>, /path/to/...) anywhere a node would use them.
for v in CKPT_ROOT LOCAL_SCRATCH MEGATRON_LM_DIR MEGATRON_EXT_DIR PYTHON SITE_SETUP SRUN_EXTRA_ARGS \
         MEGATRON_DATA_ARGS EXTRA_TRAINER_ARGS MEGATRON_ENTRY; do
    value="${!v:-}"
    if [[ "$value" == *"<"*">"* || "$value" == *"/path/to/"* || "$value" == "/path/to" ]]; then
        die "site config still has a placeholder: $v=$value (fill it in ${SITE_FILE:-the environment}; see configs/site.env.example)"
    fi
done
PYTHON="${PYTHON:-python3}"
RUN_NAME="${RUN_NAME:-$CONFIG_NAME}"
CKPT_DIR="$CKPT_ROOT/$RUN_NAME"
LOCAL_DIR="$LOCAL_SCRATCH/$RUN_NAME"
MASTER_PORT="${MASTER_PORT:-29500}"
STOP_GRACE_S="${STOP_GRACE_S:-240}"
FORWARD_SIGNAL="${FORWARD_SIGNAL:-TERM}"
DATASTATES_TIMEOUT="${DATASTATES_TIMEOUT:-1800}"
STEP_RETRIES="${STEP_RETRIES:-2}"              # retries of a step that fails before committing anything
STEP_RETRY_DELAY_S="${STEP_RETRY_DELAY_S:-15}"
PORT_WAIT_S="${PORT_WAIT_S:-60}"              # wait for a busy rendezvous port before taking another
STEP_END_WAIT_S="${STEP_END_WAIT_S:-120}"     # wait for a failed step to be gone before retrying
for v in MASTER_PORT STOP_GRACE_S STEP_RETRIES STEP_RETRY_DELAY_S PORT_WAIT_S STEP_END_WAIT_S; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, not '${!v}'"
done

# ------------------------------------------------------------------ nodes
if [[ -n "${SLURM_JOB_NODELIST:-}" && -z "$FAKE_NODES" ]]; then
    command -v scontrol >/dev/null || die "SLURM_JOB_NODELIST is set but scontrol is not on PATH"
    mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    NNODES="${SLURM_NNODES:-${#HOSTS[@]}}"
    [[ "$NNODES" -eq "${#HOSTS[@]}" ]] || die "SLURM_NNODES=$NNODES but the node list has ${#HOSTS[@]} hosts"
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)"
    RDZV_ID="${SLURM_JOB_ID:-$RUN_NAME}"
elif [[ -n "$FAKE_NODES" || $CHECK -eq 1 ]]; then
    FAKE_NODES="${FAKE_NODES:-${NODES:-1}}"
    [[ "$FAKE_NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, not '$FAKE_NODES'"
    [[ $DRY_RUN -eq 1 || $CHECK -eq 1 ]] || die "--nodes only makes sense with --dry-run or --check (inside Slurm the allocation decides)"
    NNODES="$FAKE_NODES"
    HOSTS=(); for ((i = 0; i < NNODES; i++)); do HOSTS+=("$(printf 'node%03d' "$i")"); done
    MASTER_ADDR="${HOSTS[0]}"
    RDZV_ID="dryrun"
else
    die "no allocation: run inside a Slurm job (SLURM_JOB_NODELIST), or pass --dry-run --nodes N or --check"
fi
if [[ -n "${NODES:-}" && "$NODES" != "$NNODES" ]]; then
    say "warning: $CONFIG_NAME is sized for $NODES nodes, the allocation has $NNODES"
fi

[[ "$PP" == "nodes" ]] && PP="$NNODES"
WORLD=$((NNODES * GPUS_PER_NODE))
(( WORLD % (TP * PP) == 0 )) || die "world size $NNODES nodes x $GPUS_PER_NODE = $WORLD is not a multiple of TP x PP = $TP x $PP"
DP=$((WORLD / (TP * PP)))
FIRST="${PIPELINE_FIRST_STAGE_LAYERS:-}"; LAST="${PIPELINE_LAST_STAGE_LAYERS:-}"
if [[ -n "$FIRST$LAST" ]]; then  # uneven pipeline (Megatron-LM --decoder-first/last-pipeline-num-layers)
    [[ -n "$FIRST" && -n "$LAST" && "$PP" -gt 2 ]] || die "PIPELINE_FIRST_STAGE_LAYERS and PIPELINE_LAST_STAGE_LAYERS need each other and PP > 2"
    (( (NUM_LAYERS - FIRST - LAST) % (PP - 2) == 0 && NUM_LAYERS > FIRST + LAST )) || die "$NUM_LAYERS layers minus $FIRST (first stage) and $LAST (last stage) do not split into the $((PP - 2)) middle stages"
else
    (( NUM_LAYERS % PP == 0 )) || die "$NUM_LAYERS layers do not split into PP=$PP pipeline stages (set PIPELINE_FIRST_STAGE_LAYERS/PIPELINE_LAST_STAGE_LAYERS for an uneven split)"
fi
(( NUM_ATTENTION_HEADS % TP == 0 )) || die "$NUM_ATTENTION_HEADS heads do not split over TP=$TP"
(( GLOBAL_BATCH_SIZE % (MICRO_BATCH_SIZE * DP) == 0 )) || die "global batch $GLOBAL_BATCH_SIZE is not a multiple of micro-batch $MICRO_BATCH_SIZE x DP $DP"

# ------------------------------------------------------------------ architecture
# Optional settings of the model config (docs/SLURM.md, "Architectures"). Unset, Megatron-LM builds
# its default GPT: learned positions, LayerNorm (eps 1e-5), GeLU MLP of 4 x hidden, biases, output
# layer tied to the embedding, dropout 0.1. Each one set becomes the flag of the pin's arguments.py.
ARCH_VARS=(VOCAB_SIZE MAKE_VOCAB_SIZE_DIVISIBLE_BY FFN_HIDDEN_SIZE NUM_QUERY_GROUPS SWIGLU NORMALIZATION
           NORM_EPSILON POSITION_EMBEDDING_TYPE ROTARY_BASE MAX_POSITION_EMBEDDINGS UNTIE_EMBEDDINGS
           DISABLE_BIAS_LINEAR HIDDEN_DROPOUT ATTENTION_DROPOUT)
is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_real() { [[ "$1" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]; }
for v in VOCAB_SIZE MAKE_VOCAB_SIZE_DIVISIBLE_BY FFN_HIDDEN_SIZE NUM_QUERY_GROUPS ROTARY_BASE MAX_POSITION_EMBEDDINGS; do
    [[ -z "${!v:-}" ]] || is_count "${!v}" || die "$v must be a positive whole number, not '${!v}'"
done
for v in SWIGLU UNTIE_EMBEDDINGS DISABLE_BIAS_LINEAR; do
    [[ -z "${!v:-}" || "${!v}" == 0 || "${!v}" == 1 ]] || die "$v must be 0 or 1, not '${!v}'"
done
for v in NORM_EPSILON HIDDEN_DROPOUT ATTENTION_DROPOUT; do
    [[ -z "${!v:-}" ]] || is_real "${!v}" || die "$v must be a non-negative number, not '${!v}'"
done
[[ -z "${NORM_EPSILON:-}" ]] || awk -v x="$NORM_EPSILON" 'BEGIN { exit !(x > 0) }' || die "NORM_EPSILON must be greater than 0, not '$NORM_EPSILON'"
for v in HIDDEN_DROPOUT ATTENTION_DROPOUT; do
    [[ -z "${!v:-}" ]] || awk -v x="${!v}" 'BEGIN { exit !(x < 1) }' || die "$v must be below 1, not '${!v}'"
done
(( HIDDEN_SIZE % NUM_ATTENTION_HEADS == 0 )) || die "hidden size $HIDDEN_SIZE is not a multiple of the $NUM_ATTENTION_HEADS attention heads"
[[ -z "${VOCAB_SIZE:-}" ]] || (( VOCAB_SIZE >= 2 )) || die "VOCAB_SIZE must be at least 2, not '$VOCAB_SIZE'"
if [[ -n "${FFN_HIDDEN_SIZE:-}" ]]; then
    (( FFN_HIDDEN_SIZE % TP == 0 )) || die "FFN_HIDDEN_SIZE=$FFN_HIDDEN_SIZE does not split over TP=$TP"
fi
if [[ -n "${NUM_QUERY_GROUPS:-}" ]]; then
    (( NUM_ATTENTION_HEADS % NUM_QUERY_GROUPS == 0 )) || die "$NUM_ATTENTION_HEADS attention heads do not split into NUM_QUERY_GROUPS=$NUM_QUERY_GROUPS key/value groups"
    (( NUM_QUERY_GROUPS % TP == 0 || TP % NUM_QUERY_GROUPS == 0 )) || die "NUM_QUERY_GROUPS=$NUM_QUERY_GROUPS is neither a multiple nor a divisor of TP=$TP (Megatron-LM splits the key/value groups over the tensor-parallel ranks)"
fi
case "${NORMALIZATION:-LayerNorm}" in LayerNorm|RMSNorm) ;; *) die "NORMALIZATION must be LayerNorm or RMSNorm, not '$NORMALIZATION'" ;; esac
case "${POSITION_EMBEDDING_TYPE:-learned_absolute}" in
    learned_absolute|rope|none) ;;
    *) die "POSITION_EMBEDDING_TYPE must be learned_absolute, rope or none, not '$POSITION_EMBEDDING_TYPE'" ;;
esac
[[ -z "${ROTARY_BASE:-}" || "${POSITION_EMBEDDING_TYPE:-}" == rope ]] || die "ROTARY_BASE=$ROTARY_BASE needs POSITION_EMBEDDING_TYPE=rope (it is '${POSITION_EMBEDDING_TYPE:-learned_absolute}')"
MAX_POSITIONS="${MAX_POSITION_EMBEDDINGS:-$SEQ_LENGTH}"
(( MAX_POSITIONS >= SEQ_LENGTH )) || die "MAX_POSITION_EMBEDDINGS=$MAX_POSITIONS is below SEQ_LENGTH=$SEQ_LENGTH"

ARCH_ARGS=()
[[ -n "${FFN_HIDDEN_SIZE:-}" ]] && ARCH_ARGS+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
[[ -n "${NUM_QUERY_GROUPS:-}" ]] && ARCH_ARGS+=(--group-query-attention --num-query-groups "$NUM_QUERY_GROUPS")
[[ "${SWIGLU:-0}" == 1 ]] && ARCH_ARGS+=(--swiglu)
[[ -n "${NORMALIZATION:-}" ]] && ARCH_ARGS+=(--normalization "$NORMALIZATION")
[[ -n "${NORM_EPSILON:-}" ]] && ARCH_ARGS+=(--norm-epsilon "$NORM_EPSILON")
[[ -n "${POSITION_EMBEDDING_TYPE:-}" ]] && ARCH_ARGS+=(--position-embedding-type "$POSITION_EMBEDDING_TYPE")
[[ -n "${ROTARY_BASE:-}" ]] && ARCH_ARGS+=(--rotary-base "$ROTARY_BASE")
[[ "${UNTIE_EMBEDDINGS:-0}" == 1 ]] && ARCH_ARGS+=(--untie-embeddings-and-output-weights)
[[ "${DISABLE_BIAS_LINEAR:-0}" == 1 ]] && ARCH_ARGS+=(--disable-bias-linear)
[[ -n "${MAKE_VOCAB_SIZE_DIVISIBLE_BY:-}" ]] && ARCH_ARGS+=(--make-vocab-size-divisible-by "$MAKE_VOCAB_SIZE_DIVISIBLE_BY")
[[ -n "${HIDDEN_DROPOUT:-}" ]] && ARCH_ARGS+=(--hidden-dropout "$HIDDEN_DROPOUT")
[[ -n "${ATTENTION_DROPOUT:-}" ]] && ARCH_ARGS+=(--attention-dropout "$ATTENTION_DROPOUT")
# One line for the dry run: what Megatron-LM builds from these flags.
ARCH_SUMMARY="$NUM_LAYERS layers, hidden $HIDDEN_SIZE, $NUM_ATTENTION_HEADS heads"
[[ -n "${NUM_QUERY_GROUPS:-}" ]] && ARCH_SUMMARY+=" in $NUM_QUERY_GROUPS key/value groups"
if [[ "${SWIGLU:-0}" == 1 ]]; then ARCH_SUMMARY+=", SwiGLU MLP ${FFN_HIDDEN_SIZE:-(Megatron-LM default)}"
else ARCH_SUMMARY+=", GeLU MLP ${FFN_HIDDEN_SIZE:-$((4 * HIDDEN_SIZE))}"; fi
ARCH_SUMMARY+=", ${NORMALIZATION:-LayerNorm}${NORM_EPSILON:+ eps $NORM_EPSILON}, positions ${POSITION_EMBEDDING_TYPE:-learned_absolute}${ROTARY_BASE:+ base $ROTARY_BASE}"
ARCH_SUMMARY+=", vocabulary ${VOCAB_SIZE:-not set}"
[[ "${UNTIE_EMBEDDINGS:-0}" == 1 ]] && ARCH_SUMMARY+=", untied output layer" || ARCH_SUMMARY+=", tied output layer"
[[ "${DISABLE_BIAS_LINEAR:-0}" == 1 ]] && ARCH_SUMMARY+=", no biases" || ARCH_SUMMARY+=", biases"

# ------------------------------------------------------------------ program
COMMON_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1
    --use-datastates --datastates-host-cache-size "$HOST_CACHE_GB" --datastates-local-dir "$LOCAL_DIR"
    --datastates-persist-timeout-s "$DATASTATES_TIMEOUT"
)
case "$TRAINER" in
    megatron)
        [[ -n "${MEGATRON_LM_DIR:-}" ]] || die "TRAINER=megatron needs MEGATRON_LM_DIR (the patched Megatron-LM checkout) in configs/site.env or the environment"
        [[ -d "$MEGATRON_LM_DIR" ]] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not a directory"
        [[ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ]] || die "no pretrain_gpt.py in MEGATRON_LM_DIR=$MEGATRON_LM_DIR"
        if [[ -n "${MEGATRON_ENTRY:-}" ]]; then
            # The one hook for machines without GPUs: the config's own way to run pretrain_gpt.py
            # (configs/cpu_tiny_megatron.env: the test harness megatron_ext.testing.megatron_lm).
            read -r -a PROGRAM <<< "$MEGATRON_ENTRY"
        else
            PROGRAM=("$MEGATRON_LM_DIR/pretrain_gpt.py")
        fi
        # Mock data: the NullTokenizer adds its end-of-document id to --vocab-size, so the model gets
        # VOCAB_SIZE ids (then padded to a multiple of MAKE_VOCAB_SIZE_DIVISIBLE_BY x TP, Megatron-LM's
        # default 128 x TP). With a real tokenizer in MEGATRON_DATA_ARGS its vocabulary decides.
        # Mock data only when asked for (MOCK_DATA=1, or --mock-data in MEGATRON_DATA_ARGS): a job that
        # forgot its data must not train on random tokens for a day.
        MOCK_DATA_ARGS="--mock-data --tokenizer-type NullTokenizer --vocab-size $(( ${VOCAB_SIZE:-32001} - 1 ))"
        [[ -z "${MOCK_DATA:-}" || "$MOCK_DATA" == 0 || "$MOCK_DATA" == 1 ]] || die "MOCK_DATA must be 0 or 1, not '$MOCK_DATA'"
        if [[ -n "${MEGATRON_DATA_ARGS:-}" ]]; then
            [[ "${MOCK_DATA:-0}" == 0 || "$MEGATRON_DATA_ARGS" == *--mock-data* ]] || die "MOCK_DATA=1 and MEGATRON_DATA_ARGS ($MEGATRON_DATA_ARGS) contradict each other: unset one"
            DATA_SUMMARY="MEGATRON_DATA_ARGS: $MEGATRON_DATA_ARGS"
            read -r -a DATA_ARGS <<< "$MEGATRON_DATA_ARGS"
        elif [[ "${MOCK_DATA:-0}" == 1 ]]; then
            DATA_SUMMARY="mock data (MOCK_DATA=1): random tokens, for benchmarks and tests"
            read -r -a DATA_ARGS <<< "$MOCK_DATA_ARGS"
        else
            DATA_SUMMARY="NOT SET: set MEGATRON_DATA_ARGS (--data-path ... --tokenizer-type ...) or MOCK_DATA=1 for mock data"
            [[ $DRY_RUN -eq 1 || $CHECK -eq 1 ]] || die "no training data: set MEGATRON_DATA_ARGS in configs/site.env (e.g. --data-path /lustre/data/my_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model /lustre/tok), or MOCK_DATA=1 to train on mock data deliberately"
            read -r -a DATA_ARGS <<< "$MOCK_DATA_ARGS"  # shown by --dry-run only; --check reports it
        fi
        # Transformer Engine is optional: TRANSFORMER_IMPL=local builds megatron-core's own layers.
        TRANSFORMER_IMPL="${TRANSFORMER_IMPL:-transformer_engine}"
        case "$TRANSFORMER_IMPL" in transformer_engine|local) ;; *) die "TRANSFORMER_IMPL must be transformer_engine or local, not '$TRANSFORMER_IMPL'" ;; esac
        IMPL_ARGS=(--transformer-impl "$TRANSFORMER_IMPL")
        if [[ " ${EXTRA_TRAINER_ARGS:-} ${EXTRA[*]:-} " == *" --transformer-impl "* ]]; then
            IMPL_ARGS=()  # the config's or the caller's own flag decides
            [[ " ${EXTRA_TRAINER_ARGS:-} ${EXTRA[*]:-} " == *" --transformer-impl local"* ]] && TRANSFORMER_IMPL=local
        fi
        TRAINER_ARGS=("${COMMON_ARGS[@]}" --bf16 --max-position-embeddings "$MAX_POSITIONS" "${ARCH_ARGS[@]}"
            "${IMPL_ARGS[@]}"
            --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 10
            --weight-decay 0.1 --clip-grad 1.0 --ckpt-format torch_dist
            --exit-signal-handler --log-interval 1 --eval-iters 0 --eval-interval "$TRAIN_ITERS"
            "${DATA_ARGS[@]}")
        if [[ -n "$FIRST" ]]; then
            TRAINER_ARGS+=(--decoder-first-pipeline-num-layers "$FIRST" --decoder-last-pipeline-num-layers "$LAST")
        fi
        if [[ "${RECOMPUTE:-none}" == full ]]; then
            TRAINER_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
        fi
        ;;
    reference)
        [[ -z "$FIRST" ]] || die "the reference trainer has no uneven pipeline split"
        # It builds a plain GPT (learned positions, LayerNorm, GeLU MLP of 4 x hidden, biases, tied
        # output layer); of the architecture settings it takes the vocabulary and the dropout only.
        UNSUPPORTED=()
        for v in "${ARCH_VARS[@]}"; do
            case "$v" in VOCAB_SIZE|HIDDEN_DROPOUT|ATTENTION_DROPOUT) ;; *) [[ -z "${!v:-}" ]] || UNSUPPORTED+=("$v=${!v}") ;; esac
        done
        [[ ${#UNSUPPORTED[@]} -eq 0 ]] || die "the reference trainer builds a plain GPT and cannot honour ${UNSUPPORTED[*]} of $CONFIG_NAME (use TRAINER=megatron)"
        PROGRAM=(-m megatron_ext.testing.reference_trainer)
        TRAINER_ARGS=("${COMMON_ARGS[@]}" --exit-signal-handler)
        [[ -n "${VOCAB_SIZE:-}" ]] && TRAINER_ARGS+=(--vocab-size "$VOCAB_SIZE")
        [[ -n "${HIDDEN_DROPOUT:-}" ]] && TRAINER_ARGS+=(--hidden-dropout "$HIDDEN_DROPOUT")
        [[ -n "${ATTENTION_DROPOUT:-}" ]] && TRAINER_ARGS+=(--attention-dropout "$ATTENTION_DROPOUT")
        ;;
    *) die "TRAINER must be 'megatron' (pretrain_gpt.py in MEGATRON_LM_DIR)" \
           "or 'reference' (megatron_ext.testing.reference_trainer), not '$TRAINER'" ;;
esac
read -r -a CONFIG_EXTRA <<< "${EXTRA_TRAINER_ARGS:-}"
TRAINER_ARGS+=("${CONFIG_EXTRA[@]}" "${EXTRA[@]}")

# torchrun forwards SIGTERM to its workers and SIGKILLs them after this many seconds.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$STOP_GRACE_S"
NODE_ENV=()
if [[ "$TRAINER" == megatron ]]; then
    # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 when TP > 1 (kernel order of the
    # tensor-parallel overlap); a site may set another value for its own reasons.
    NODE_ENV+=("CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}")
fi

# The command every node runs, for a rendezvous at port $1 with id $2.
node_script() {
    local torchrun=("$PYTHON" -m torch.distributed.run
        --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$1" --rdzv-id "$2"
        --max-restarts 0)
    local exports="" quoted
    if [[ ${#NODE_ENV[@]} -gt 0 ]]; then
        printf -v quoted '%q ' "${NODE_ENV[@]}"
        exports="export ${quoted% }; "
    fi
    echo "set -e; ${SITE_SETUP:+$SITE_SETUP; }${exports}mkdir -p $(printf '%q' "$LOCAL_DIR"); exec $(printf '%q ' "${torchrun[@]}" "${PROGRAM[@]}" "${TRAINER_ARGS[@]}")"
}

# ------------------------------------------------------------------ data paths
# The files MEGATRON_DATA_ARGS names, checked from here (the shared file system the nodes see too).
data_problems() {
    local args=() i=0 flag value prefix
    read -r -a args <<< "${MEGATRON_DATA_ARGS:-}"
    while (( i < ${#args[@]} )); do
        flag="${args[$i]}"; i=$((i + 1))
        case "$flag" in
            --data-path|--train-data-path|--valid-data-path|--test-data-path)
                # A list of prefixes, optionally weighted ("0.3 /data/a 0.7 /data/b"), up to the next flag.
                while (( i < ${#args[@]} )) && [[ "${args[$i]}" != --* ]]; do
                    prefix="${args[$i]}"; i=$((i + 1))
                    [[ "$prefix" =~ ^[0-9.eE+-]+$ ]] && continue
                    if [[ ! -e "$prefix" && ( ! -f "$prefix.bin" || ! -f "$prefix.idx" ) ]]; then
                        echo "$flag $prefix: no $prefix.bin and $prefix.idx (nor a file $prefix)"
                    fi
                done ;;
            --tokenizer-model|--vocab-file|--merge-file|--data-args-path|--per-split-data-args-path|--data-cache-path)
                value="${args[$i]:-}"; i=$((i + 1))
                if [[ "$flag" == --data-cache-path ]]; then
                    [[ -d "$value" || -d "$(dirname "$value")" ]] || echo "$flag $value: neither it nor its parent is a directory"
                elif [[ "$flag" == --tokenizer-model && ! -e "$value" && "$value" != */* ]]; then
                    :  # a Hugging Face hub name, fetched by the tokenizer itself
                elif [[ ! -e "$value" ]]; then
                    echo "$flag $value: does not exist"
                fi ;;
        esac
    done
}
if [[ "$TRAINER" == megatron && $DRY_RUN -eq 0 && $CHECK -eq 0 ]]; then
    problems="$(data_problems)"
    [[ -z "$problems" ]] || die "MEGATRON_DATA_ARGS names missing files: $(echo "$problems" | head -1)$( (( $(echo "$problems" | wc -l) > 1 )) && echo " (and more: launch.sh --check lists them)")"
fi

# ------------------------------------------------------------------ --check
run_check() {
    local failed=0 out
    ok() { echo "launch.sh: check: ok    $*"; }
    bad() { echo "launch.sh: check: FAIL  $*"; failed=1; }
    warn() { echo "launch.sh: check: note  $*"; }
    ok "config $CONFIG_NAME: $NNODES node(s) x $GPUS_PER_NODE = $WORLD ranks, TP=$TP PP=$PP DP=$DP; site ${SITE_FILE:-environment only}; no placeholders"
    # Under SITE_SETUP with $PYTHON, as every node will run it (the login node's modules may differ).
    on_node() { bash -c "set -e; ${SITE_SETUP:+$SITE_SETUP; }$1" 2>&1; }
    if out="$(on_node "$(printf '%q' "$PYTHON") -c 'import megatron_ext, os; print(os.path.dirname(os.path.dirname(megatron_ext.__file__)))'")"; then
        local where="${out##*$'\n'}"
        ok "megatron_ext imports under SITE_SETUP with $PYTHON (from $where)"
        if [[ -n "${MEGATRON_EXT_DIR:-}" && "$(cd "$where" 2>/dev/null && pwd -P)" != "$(cd "$MEGATRON_EXT_DIR" 2>/dev/null && pwd -P)" ]]; then
            warn "that is not MEGATRON_EXT_DIR=$MEGATRON_EXT_DIR; install this checkout on the nodes (pip install -e $ROOT) if you changed it"
        fi
    else
        bad "megatron_ext does not import under SITE_SETUP with PYTHON=$PYTHON: ${out##*$'\n'} (install it in the nodes' environment: pip install -e $ROOT)"
    fi
    if [[ "$TRAINER" == megatron ]]; then
        if [[ -n "${MEGATRON_LM_DIR:-}" ]]; then
            if out="$( ( source "$ROOT/scripts/megatron_pin.sh"; check_pin "$MEGATRON_LM_DIR"; patch_state "$MEGATRON_LM_DIR" ) 2>&1 )"; then
                case "${out##*$'\n'}" in
                    applied) ok "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is at the pin with the megatron_ext patches applied" ;;
                    clean) bad "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is at the pin but not patched: run scripts/apply_patches.sh $MEGATRON_LM_DIR" ;;
                    *) bad "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has changes that are not the megatron_ext patch series (git -C $MEGATRON_LM_DIR status; scripts/check_patches.sh checks the series)" ;;
                esac
            else
                bad "MEGATRON_LM_DIR=$MEGATRON_LM_DIR: ${out##*error: }"
            fi
        fi
        if out="$(on_node "$(printf '%q' "$PYTHON") -c 'import megatron.core'")"; then
            ok "megatron.core imports under SITE_SETUP"
        else
            bad "megatron.core does not import under SITE_SETUP: ${out##*$'\n'} (pip install -r $ROOT/requirements/megatron-lm.txt, or megatron-core==0.19.2)"
        fi
        if [[ "$TRANSFORMER_IMPL" == local ]]; then
            ok "--transformer-impl local: Transformer Engine not needed"
        elif out="$(on_node "$(printf '%q' "$PYTHON") -c 'import transformer_engine'")"; then
            ok "Transformer Engine imports under SITE_SETUP (--transformer-impl transformer_engine)"
        else
            bad "Transformer Engine does not import under SITE_SETUP (${out##*$'\n'}): install it, or set TRANSFORMER_IMPL=local in configs/site.env (megatron-core's own layers)"
        fi
        if [[ "$DATA_SUMMARY" == NOT\ SET* ]]; then
            bad "data: $DATA_SUMMARY"
        else
            local problems
            problems="$(data_problems)"
            if [[ -z "$problems" ]]; then ok "data: $DATA_SUMMARY"; else
                while IFS= read -r line; do bad "data: $line"; done <<< "$problems"
            fi
        fi
    fi
    if [[ -d "$CKPT_DIR" ]]; then
        [[ -w "$CKPT_DIR" ]] && ok "checkpoint directory $CKPT_DIR exists and is writable" || bad "checkpoint directory $CKPT_DIR is not writable"
    else
        local parent="$CKPT_DIR"
        while [[ ! -d "$parent" ]]; do parent="$(dirname "$parent")"; done
        [[ -w "$parent" ]] && ok "checkpoint directory $CKPT_DIR can be created (under $parent)" || bad "checkpoint directory $CKPT_DIR cannot be created: $parent is not writable"
    fi
    warn "node-local level $LOCAL_DIR is created on each node at the start (not checked from here)"
    if [[ $failed -ne 0 ]]; then
        echo "launch.sh: check: FAILED; fix the lines marked FAIL (docs/SLURM.md, \"First run\")" >&2
        return 2
    fi
    echo "launch.sh: check: all ok"
}
if [[ $CHECK -eq 1 ]]; then
    run_check
    exit $?
fi

if [[ $DRY_RUN -eq 1 ]]; then
    RDZV_ID="$RDZV_ID-${SLURM_RESTART_COUNT:-0}-0"  # as the first attempt of the run below
    NODE_SCRIPT="$(node_script "$MASTER_PORT" "$RDZV_ID")"
    echo "# $CONFIG_NAME: $NNODES nodes x $GPUS_PER_NODE ranks = $WORLD ranks, TP=$TP PP=$PP DP=$DP, trainer=$TRAINER"
    echo "# model: $ARCH_SUMMARY"
    echo "# shared level (--save/--load): $CKPT_DIR ; node-local level: $LOCAL_DIR"
    if [[ "$TRAINER" == megatron ]]; then
        echo "# data: $DATA_SUMMARY"
        echo "# transformer: --transformer-impl $TRANSFORMER_IMPL"
    fi
    echo "# site: ${SITE_FILE:-environment only}; rendezvous: c10d at $MASTER_ADDR:$MASTER_PORT id $RDZV_ID"
    # c10d numbers nodes in the sorted order of their host names: node k hosts ranks k*G .. k*G+G-1.
    mapfile -t SORTED < <(printf '%s\n' "${HOSTS[@]}" | LC_ALL=C sort)
    for ((k = 0; k < NNODES; k++)); do
        first=$((k * GPUS_PER_NODE)); last=$((first + GPUS_PER_NODE - 1))
        echo "node $k host ${SORTED[$k]} ranks $first-$last: cd $(printf '%q' "$ROOT") && $NODE_SCRIPT"
    done
    exit 0
fi

# ------------------------------------------------------------------ run
[[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a Slurm job (use --dry-run to see the commands)"
# An unpatched or wrong checkout would fail on every rank ("unrecognized arguments: --use-datastates").
if [[ "$TRAINER" == megatron ]] && git -C "$MEGATRON_LM_DIR" rev-parse --git-dir >/dev/null 2>&1; then
    state="$( ( source "$ROOT/scripts/megatron_pin.sh"; check_pin "$MEGATRON_LM_DIR"; patch_state "$MEGATRON_LM_DIR" ) 2>&1 )" \
        || die "MEGATRON_LM_DIR: ${state##*error: }"
    [[ "${state##*$'\n'}" == applied ]] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR is not patched (${state##*$'\n'}): run scripts/apply_patches.sh $MEGATRON_LM_DIR"
fi
mkdir -p "$CKPT_DIR" || die "cannot create the checkpoint directory $CKPT_DIR"
[[ -w "$CKPT_DIR" ]] || die "checkpoint directory $CKPT_DIR is not writable"
TRACKER="$CKPT_DIR/latest_checkpointed_iteration.txt"
RESTART="${SLURM_RESTART_COUNT:-0}"
committed() { cat "$TRACKER" 2>/dev/null || echo none; }
say "job ${SLURM_JOB_ID} restart $RESTART: $CONFIG_NAME on $NNODES nodes, TP=$TP PP=$PP DP=$DP; latest committed iteration: $(committed)"

STOP=""
on_signal() {
    STOP="$1"
    say "caught SIG$1 at $(date +%T): forwarding SIG$FORWARD_SIGNAL to the training step (grace ${STOP_GRACE_S}s)"
    scancel --signal="$FORWARD_SIGNAL" "$SLURM_JOB_ID" || say "scancel --signal failed"
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# Sleeps $1 seconds; a trapped signal ends the sleep early (the caller then checks $STOP).
pause() { sleep "$1" & wait $! || true; }

# True when something accepts connections at $1:$2 (5 s bound, so a silent host cannot hang us).
listening() { timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null; }

# The rendezvous port must be free before a step starts: torchrun's c10d agent that cannot bind it
# joins whatever store listens there instead (a leftover of an earlier step, another job on the
# node) and the step fails or hangs. Waits up to PORT_WAIT_S for MASTER_PORT, then moves to the
# next port nobody listens on (all nodes get it in their command line).
choose_port() {
    local deadline=$((SECONDS + PORT_WAIT_S)) port
    listening "$MASTER_ADDR" "$MASTER_PORT" || return 0
    say "rendezvous port $MASTER_PORT on $MASTER_ADDR is in use; waiting up to ${PORT_WAIT_S}s for it to be free"
    if [[ "${SLURMD_NODENAME:-}" == "$MASTER_ADDR" ]] && command -v ss >/dev/null; then
        ss -Hltnp "sport = :$MASTER_PORT" 2>/dev/null | sed 's/^/launch.sh:     /' >&2 || true
    fi
    while listening "$MASTER_ADDR" "$MASTER_PORT"; do
        if (( SECONDS >= deadline )); then
            for ((port = MASTER_PORT + 1; port <= MASTER_PORT + 100; port++)); do
                if ! listening "$MASTER_ADDR" "$port"; then
                    say "rendezvous port $MASTER_PORT still in use after ${PORT_WAIT_S}s: using port $port"
                    MASTER_PORT=$port
                    return 0
                fi
            done
            say "no free rendezvous port in $MASTER_PORT..$((MASTER_PORT + 100)) on $MASTER_ADDR"
            return 1
        fi
        pause 2
        [[ -z "$STOP" ]] || return 1
    done
    say "rendezvous port $MASTER_PORT is free again"
}

# Steps of this job still known to Slurm (a retried step must not overlap the one that failed).
running_steps() { squeue -h --steps --jobs "$SLURM_JOB_ID" -o '%i' 2>/dev/null | grep -Ev '\.(batch|extern)$' || true; }
wait_for_steps() {
    local deadline=$((SECONDS + STEP_END_WAIT_S)) left
    left="$(running_steps)"
    [[ -n "$left" ]] || return 0
    say "waiting up to ${STEP_END_WAIT_S}s for the previous step to end: $(echo $left)"
    while [[ -n "$(running_steps)" ]]; do
        if (( SECONDS >= deadline )); then
            say "previous step still listed after ${STEP_END_WAIT_S}s: $(echo $(running_steps)); starting anyway"
            return 0
        fi
        pause 2
    done
}

cd "$ROOT"
# A step that fails before committing any new checkpoint (rendezvous port taken, a node not ready,
# srun unable to start the step) is retried up to STEP_RETRIES times, each with a fresh rendezvous
# id; a step that committed checkpoints and then failed is not (the job ends with its exit code).
RC=0
for ((attempt = 0; ; attempt++)); do
    [[ -z "$STOP" ]] || break
    (( attempt == 0 )) || wait_for_steps
    if ! choose_port; then
        [[ -n "$STOP" ]] && break
        RC=1
        break
    fi
    RDZV="$RDZV_ID-$RESTART-$attempt"
    NODE_SCRIPT="$(node_script "$MASTER_PORT" "$RDZV")"
    BEFORE="$(committed)"
    say "starting the training step (attempt $((attempt + 1)) of $((STEP_RETRIES + 1)), rendezvous $MASTER_ADDR:$MASTER_PORT id $RDZV)"
    say "node command: $NODE_SCRIPT"
    STARTED=$SECONDS
    # shellcheck disable=SC2086
    srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 ${SRUN_EXTRA_ARGS:-} \
        bash -c "$NODE_SCRIPT" &
    SRUN_PID=$!
    STOP_DEADLINE=""
    while kill -0 "$SRUN_PID" 2>/dev/null; do
        if [[ -n "$STOP" && -z "$STOP_DEADLINE" ]]; then STOP_DEADLINE=$((SECONDS + STOP_GRACE_S + 30)); fi
        if [[ -n "$STOP_DEADLINE" && $SECONDS -ge $STOP_DEADLINE ]]; then
            say "training step still running ${STOP_GRACE_S}s after the signal: killing it"
            scancel --signal=KILL "$SLURM_JOB_ID" || true
            STOP_DEADLINE=$((SECONDS + 60))
        fi
        # Returns early (>128) when a trapped signal arrives; the loop then waits again.
        wait "$SRUN_PID" && RC=0 || RC=$?
    done
    say "training step ended with exit code $RC after $((SECONDS - STARTED))s; latest committed iteration: $(committed)"
    [[ $RC -ne 0 && -z "$STOP" ]] || break
    if [[ "$(committed)" != "$BEFORE" ]]; then
        say "the step failed after committing checkpoints: not retrying (a new or requeued run resumes from iteration $(committed))"
        break
    fi
    if (( attempt >= STEP_RETRIES )); then
        say "the step failed $((attempt + 1)) times without committing a checkpoint: giving up"
        break
    fi
    say "the step failed before committing a checkpoint: retry $((attempt + 1)) of $STEP_RETRIES in ${STEP_RETRY_DELAY_S}s"
    pause "$STEP_RETRY_DELAY_S"
done

if [[ -n "$STOP" ]]; then
    if [[ "$(committed)" == "$TRAIN_ITERS" ]]; then
        say "training is complete; not requeueing"
        exit 0
    fi
    say "requeueing job $SLURM_JOB_ID; it resumes from iteration $(committed)"
    scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue $SLURM_JOB_ID failed (was the job submitted with --requeue?)"
    exit 0
fi
exit "$RC"
