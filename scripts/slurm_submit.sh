#!/usr/bin/env bash
# Submit a template with the site's sbatch settings: scripts/slurm_submit.sh gpt_70b [sbatch options]
# Sources configs/site.env (or $SITE_ENV) so SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_QOS reach
# sbatch, and submits from the checkout so the job finds scripts/launch.sh.
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
exec sbatch "$@" "$TEMPLATE"
