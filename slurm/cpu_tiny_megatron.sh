#!/bin/bash
# CPU test of the launcher (tests/slurm): Megatron-LM's own pretrain_gpt.py (patched checkout in
# MEGATRON_LM_DIR) through the CPU harness, 2 gloo ranks on one node.
#SBATCH --job-name=cpu_tiny_megatron
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:10:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
exec "${MEGATRON_EXT_DIR:-$SLURM_SUBMIT_DIR}/scripts/launch.sh" --config cpu_tiny_megatron "$@"
