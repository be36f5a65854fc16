#!/bin/bash
# GPU node check on one node: scripts/gpu_check.sh (tests/gpu, bench engine --device cuda --check,
# Megatron-LM over NCCL; about 6 minutes). From the checkout, on a login node:
#   sbatch slurm/gpu_check.sh                      compute nodes with network (fetch_megatron.sh, pip)
#   scripts/gpu_check.sh --prepare .gpu-check && sbatch slurm/gpu_check.sh --from .gpu-check   without
# or scripts/slurm_submit.sh gpu_check [ARGS] (account/partition from configs/site.env). Results:
# runs/gpu-check-HOST-DATE/summary.txt (one PASS/FAIL/SKIP line per part) and logs.tar.gz.
#SBATCH --job-name=gpu_check
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=8
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
cd "${MEGATRON_EXT_DIR:-$SLURM_SUBMIT_DIR}" || exit 2
exec scripts/gpu_check.sh "$@"
