"""The training job's progress file, as one line an on-call engineer can read."""

from __future__ import annotations

from collections.abc import Mapping


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def describe_progress(progress: Mapping) -> str:
    """``step 120/400 (30%) loss 0.4123 2,310 rows/s ETA 1m52s restarts 1 ckpt@100``; missing keys are left out.
    (rows/s: training rows per second over all ranks, the job's ``samples_per_s``.)"""
    parts = []
    step, total = progress.get("step"), progress.get("total_steps")
    if step is not None:
        parts.append(f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}")
    if progress.get("loss") is not None:
        parts.append(f"loss {float(progress['loss']):.4f}")
    if progress.get("samples_per_s") is not None:
        parts.append(f"{float(progress['samples_per_s']):,.0f} rows/s")
    if progress.get("eta_s") is not None:
        parts.append(f"ETA {_duration(float(progress['eta_s']))}")
    if progress.get("restarts"):
        parts.append(f"restarts {progress['restarts']}")
    if progress.get("last_checkpoint_step") is not None:
        parts.append(f"ckpt@{progress['last_checkpoint_step']}")
    return " ".join(parts) or "no progress reported yet"
