#!/bin/bash
# LLaMA2-70B at 180 GPUs (TP4 x PP5 x DP9) on 45 node(s) of 4x A100-40GB: --use-datastates --save-interval 1, requeued on the time limit.
# Submit from the megatron_ext checkout (or set MEGATRON_EXT_DIR):  scripts/slurm_submit.sh gpt_70b_180gpu
# Site settings (account, partition, modules, paths): configs/site.env, see configs/site.env.example.
#SBATCH --job-name=gpt_70b_180gpu
#SBATCH --nodes=45
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
exec "${MEGATRON_EXT_DIR:-$SLURM_SUBMIT_DIR}/scripts/launch.sh" --config gpt_70b_180gpu "$@"
