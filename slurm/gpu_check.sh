#!/bin/bash
# GPU node check on one node: scripts/gpu_check.sh (pytest tests/gpu + bench engine --device cuda).
# Submit with scripts/slurm_submit.sh gpu_check (account/partition from configs/site.env).
#SBATCH --job-name=gpu_check
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
cd "${MEGATRON_EXT_DIR:-$SLURM_SUBMIT_DIR}" || exit 2
exec scripts/gpu_check.sh "$@"
