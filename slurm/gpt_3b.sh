#!/bin/bash
# BLOOM-3B (paper configuration) on 1 node(s) of 4x A100-40GB: --use-datastates --save-interval 1, requeued on the time limit.
# Submit from the megatron_ext checkout (or set MEGATRON_EXT_DIR):  scripts/slurm_submit.sh gpt_3b
# Site settings (account, partition, modules, paths): configs/site.env, see configs/site.env.example.
#SBATCH --job-name=gpt_3b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
exec "${MEGATRON_EXT_DIR:-$SLURM_SUBMIT_DIR}/scripts/launch.sh" --config gpt_3b "$@"
