#!/bin/bash
#SBATCH --job-name=hf-train_llm-train-scheduled__2026-01-01T00_00_00_00_00-c146b8fdcca68801
#SBATCH --partition=gpu-training
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --gres=gpu:h200:2
#SBATCH --time=60
#SBATCH --signal=USR2@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
umask 0002
export HF_CONFIG=/x/y.json
export PYTHONUNBUFFERED=1
source /opt/hybridflow/venv/bin/activate
echo "node=$(hostname)"
exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --ntasks=4 --cpus-per-task=4 --gpus-per-task=1 --gpu-bind=single:1 -- python /opt/hybridflow/jobs/train.py --config /x/y.json
