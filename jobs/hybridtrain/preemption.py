"""Stop requests by signal, and Slurm requeue.

Slurm sends ``--signal=B:USR2@<secs>`` to the batch shell, which ``exec``s python, so the signal reaches this
process. The handler only records the request; the training loop finishes the step in flight, checkpoints and
then stops. SIGTERM (``scancel``, a time limit without ``--signal``, a preemption) is handled the same way but
never requeues: Slurm or the user decided the job's fate. With several processes, the loop agrees on the
request every step (a max all-reduce of :attr:`StopRequest.code`), so a signal that reached one rank stops
all, and SIGUSR2 wins over SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
from types import FrameType

from hybridtrain.errors import RequeueError

__all__ = ["StopRequest", "requeue_command", "requeue_job"]

_TIMEOUT_S = 60


class StopRequest:
    """Records SIGTERM and SIGUSR2 as they arrive; install once in the main thread."""

    _CODES = {signal.SIGTERM: 1, signal.SIGUSR2: 2}

    def __init__(self) -> None:
        self.code = 0

    def install(self) -> None:
        for signum in self._CODES:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.code = max(self.code, self._CODES[signal.Signals(signum)])

    @property
    def requested(self) -> bool:
        return self.code > 0

    @classmethod
    def signal_for(cls, code: int) -> signal.Signals:
        return next(signum for signum, value in cls._CODES.items() if value == code)


def requeue_command(job_id: str) -> list[str]:
    return ["scontrol", "requeue", job_id]


def requeue_job(job_id: str) -> None:
    """Ask Slurm to requeue this job; Slurm then ends this process and starts the batch script again.

    :raises RequeueError: scontrol is missing, times out or exits non-zero; the message quotes its output.
    """
    command = requeue_command(job_id)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RequeueError(f"`{' '.join(command)}` could not run: {error}") from None
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        raise RequeueError(f"`{' '.join(command)}` exited {done.returncode}: {output or 'no output'}")
