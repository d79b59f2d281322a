#!/bin/bash
#SBATCH --job-name=hf-train_llm-train-scheduled__2026-01-01T00_00_00_00_00-c146b8fdcca68801
#SBATCH --partition=gpu-training
#SBATCH --nodes=1
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --gres=gpu:h200:1
#SBATCH --time=60
#SBATCH --signal=B:USR2@90
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail
export HF_CONFIG=/x/y.json
export PYTHONUNBUFFERED=1
source /opt/hybridflow/venv/bin/activate
echo "node=$(hostname)"
exec python /opt/hybridflow/jobs/train.py --config /x/y.json
