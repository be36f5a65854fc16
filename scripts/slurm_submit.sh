#!/usr/bin/env bash
# Submit a template with the site's sbatch settings: scripts/slurm_submit.sh gpt_70b [sbatch options]
# Sources configs/site.env (or $SITE_ENV) so SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_QOS reach
# sbatch, runs `scripts/launch.sh --config <model> --check` first (the preflight: patched checkout at
# the pin, imports under SITE_SETUP, Transformer Engine or TRANSFORMER_IMPL=local, data, no
# placeholders) and submits only if it passes (SUBMIT_CHECK=0 skips it), from the checkout so the
# job finds scripts/launch.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 MODEL [sbatch options]   (MODEL: $(cd "$ROOT/slurm" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' '))" >&2; exit 2; }
MODEL="${1%.sh}"; shift
TEMPLATE="$ROOT/slurm/$MODEL.sh"
[[ -f "$TEMPLATE" ]] || { echo "slurm_submit.sh: error: no template $TEMPLATE" >&2; exit 2; }
SITE="${SITE_ENV:-$ROOT/configs/site.env}"
if [[ -f "$SITE" ]]; then
    set -a; source "$SITE"; set +a
    export SITE_ENV="$SITE"
fi
export MEGATRON_EXT_DIR="${MEGATRON_EXT_DIR:-$ROOT}"
[[ "${SBATCH_ACCOUNT:-}" != *"<"* && "${SBATCH_PARTITION:-}" != *"<"* ]] || { echo "slurm_submit.sh: error: $SITE still has <placeholders>" >&2; exit 2; }
cd "$ROOT"
CONFIG="$(sed -n 's/.*scripts\/launch\.sh"\{0,1\} --config \([A-Za-z0-9_.-]*\).*/\1/p' "$TEMPLATE" | head -1)"
if [[ -n "$CONFIG" && "${SUBMIT_CHECK:-1}" != 0 ]]; then
    NODES_ASKED="$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$TEMPLATE" | head -1)"
    for arg in "$@"; do [[ "$arg" =~ ^(--nodes=|-N)([0-9]+)$ ]] && NODES_ASKED="${BASH_REMATCH[2]}"; done
    env -u SLURM_JOB_NODELIST "$ROOT/scripts/launch.sh" --config "$CONFIG" --check ${NODES_ASKED:+--nodes "$NODES_ASKED"} \
        || { echo "slurm_submit.sh: error: the preflight failed (above); nothing was submitted (SUBMIT_CHECK=0 skips it)" >&2; exit 2; }
fi
exec sbatch "$@" "$TEMPLATE"
