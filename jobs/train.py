"""DeepSpeed training of the customer propensity model on one run's feature partitions.

Usage: python jobs/train.py --config <run config JSON>

Runs on the Slurm GPU partition (NCCL) or on CPU (gloo, one process) with only torch, deepspeed, pyarrow and
numpy; it never imports Airflow. A run config, as the operator writes it (relative paths are read from the
config file's directory; keys starting with "_" are comments)::

    {
      "run_id": "nightly_training__2026-01-02",         optional, echoed into every output
      "labels": {"dag_id": "nightly_training"},         optional free-form metadata, echoed into metrics.json
      "features_root": "/var/lib/hybridflow/storage/features",    local path or s3://bucket/prefix
      "ds": ["2026-01-01", "2026-01-02"],               or "ds_range": {"start": "...", "end": "..."}
      "run_dir": "/var/lib/hybridflow/storage/runs/nightly_training__2026-01-02",
      "model": {"preset": "small"},                     or {"hidden_sizes": [64, 32], "dropout": 0.1}
      "model_presets_path": "...",                      optional; default include/config/model_presets.json
      "epochs": 3,                                      and/or "max_steps": 500 (whichever ends first)
      "batch_size": 256,                                rows per process per micro-batch
      "gradient_accumulation_steps": 1,                 optional: micro-batches per optimizer step; global
                                                        batch = batch_size x this x ranks (nodes x gpus_per_node)
      "learning_rate": 0.001,
      "checkpoint_every_steps": 100,
      "keep_last_checkpoints": 3,                       optional; default keeps every checkpoint
      "seed": 42,
      "zero_stage": 1,                                  0-3; replaces the DeepSpeed config's stage
      "deepspeed_config": "/opt/hybridflow/include/deepspeed/zero1.json",
      "holdout_fraction": 0.2,                          optional
      "log_every_steps": 10,                            optional: loss curve resolution
      "progress_every_s": 5,                            optional: progress.json at most this often
      "gpu_sample_every_s": 5,                          optional: nvidia-smi sampling period
      "heartbeat_every_s": 5,                           optional: each rank's heartbeat file (the stall watch)
      "torch_threads": 4,                               optional; default SLURM_CPUS_PER_TASK, else torch's
      "collective_timeout_s": 300,                      optional: a collective (or the rendezvous) waiting
                                                        longer for a dead or stuck rank fails the job (the
                                                        operator sets it above its stall watch)
      "allreduce_sample_every_steps": 25,               optional: all-reduce share sampling period (steps)
      "precision": "auto"                               optional: auto (bf16 autocast over float32 weights on a
                                                        GPU with bf16, float32 elsewhere), fp32, or bf16 (autocast
                                                        on any device); a DeepSpeed config with bf16/fp16 enabled
                                                        computes in its own half precision instead
      "tracking": {"uri": "http://mlflow:5000",         optional (the operator writes it): rank 0 logs step
                   "run_id": "<32 hex>",                figures live to this MLflow run; credentials_file (JSON
                   "credentials_file": "...",           username/password, 0600) beside the config; a server
                   "flush_every_s": 5}                  that does not answer is said once and training goes on
    }

Outputs under run_dir: progress.json, checkpoints/step_<n>/ (each with MANIFEST.json, written by rank 0 last,
after every rank saved its shards), metrics.json (the loop's own rows/s, median step and GPU utilization between
its first and last timed step as samples_per_s and loop, the rest of the time per phase in time_split_s, the
all-reduce share of a step and where each rank ran),
gpu_metrics.rank<r>.jsonl (each rank's own GPUs), step_metrics.jsonl (rank 0's step figures: loss, rows/s,
all-reduce share, holdout figures; what MLflow gets) and export/ (model.pt, signature.json, smoke.json).
signature.json's "precision" says whether scoring may use bf16 (the export's check of bf16 against float32 on the
smoke set and a holdout sample).

On a GPU the loop never waits for the device between steps: the data and each epoch's row order live on the
device, the loss is read every log_every_steps, stop requests are agreed over a CPU (gloo) group, DeepSpeed's
throughput timer (which synchronizes twice a step) is off, torch's AdamW is fused, and at ZeRO stage 0, 1 and 2 the
job clips gradients on the device before each optimizer step, where DeepSpeed would read the norm on the host (see
hybridtrain.config.settings_for_device; tests/unit/jobs/hybridtrain/test_train_host_syncs.py counts the waits).
One node: ZeRO stage 0 (zero0.json).

Signals: SIGUSR2 finishes the step, checkpoints, and requeues the Slurm job (``scontrol requeue
$SLURM_JOB_ID``); SIGTERM finishes the step, checkpoints and stops. A restart resumes from the newest complete
checkpoint and ends at the same step as an uninterrupted run. A checkpoint resumes only with the number of ranks
that wrote it; another number fails before the first step (exit 2) and says so.

Exit codes (hybridtrain.errors.ExitCode): 0 finished, or requeued itself after SIGUSR2; 1 unexpected error,
or a collective that failed (a rank dead or stuck past collective_timeout_s); 2 invalid run config, DeepSpeed
config, presets or feature data, or a checkpoint of another run or world size (retrying does not help); 75
stopped by SIGUSR2 without SLURM_JOB_ID (checkpoint saved; run again to resume); 76 checkpoint saved but
``scontrol requeue`` failed; 143 stopped by SIGTERM (checkpoint saved).

Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT when a launcher sets them, else derived
from SLURM_* inside an srun step, else one process on 127.0.0.1 with a free port. One GPU per rank: cuda:0 when
Slurm binds one GPU per task (CUDA_VISIBLE_DEVICES holds one id), cuda:LOCAL_RANK when a rank sees several.
Log lines name rank and node (``rank1@gpu-node-02``, SLURMD_NODENAME else the short host name); ranks other
than 0 log warnings and errors only. TORCH_EXTENSIONS_DIR
defaults to run_dir/torch_extensions. HYBRIDTRAIN_ENABLE_SHM_COMM=1 lets DeepSpeed JIT-build its CPU
shared-memory all-reduce (needs g++ and ninja).
"""

import sys
import time

from hybridtrain.preemption import StopRequest

if __name__ == "__main__":
    started = time.monotonic()
    # Before torch's imports (seconds): a SIGUSR2 or SIGTERM that early would otherwise kill the process.
    stop = StopRequest()
    stop.install()
    from hybridtrain.runner import main

    sys.exit(main(started=started, stop=stop))
