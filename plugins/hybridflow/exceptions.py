"""The package's narrow exceptions. Each message says what was wrong and what to do about it."""


class HybridflowError(Exception):
    """Base class of every error the package raises on purpose."""


class ConfigError(HybridflowError, ValueError):
    """A configuration file or profile is invalid; the message names the file, the key and the fix."""


class TritonError(HybridflowError):
    """A call to the Triton server failed; the message carries the server's own error text."""


class InvalidJobSpecError(HybridflowError, ValueError):
    """A Slurm job spec field is invalid; the message names the field and the fix."""


class SlurmOutputParseError(HybridflowError):
    """A Slurm command printed something the parser does not understand; the message quotes the text."""


class SlurmConnectionError(HybridflowError):
    """The Slurm login node could not be reached or failed host key verification."""


class HealthCheckError(HybridflowError):
    """A component of the estate does not answer as it should."""


class SlurmSubmitError(HybridflowError):
    """sbatch refused a job; the message carries Slurm's reason."""


class SlurmJobFailed(HybridflowError):
    """A Slurm job ended in a state other than COMPLETED; the message names the job, state, exit code, log tail
    and runbook."""


class SlurmConnectionLost(SlurmConnectionError):
    """The SSH connection dropped or timed out; worth reconnecting within a budget."""


class DataQualityError(HybridflowError):
    """A partition failed the data quality gate; the message names each failed check, its column, the observed
    and expected values, and the runbook. ``results`` holds every check result of the gate."""

    def __init__(self, message: str, results: tuple = ()) -> None:
        super().__init__(message)
        self.results = tuple(results)


class GateFailed(HybridflowError):
    """A gate refused to let the pipeline go on; the message names the figures and the runbook."""


class ModelRolledBack(GateFailed):
    """A new model version failed its deploy (load, smoke test or latency gate) and was rolled back; the message
    names the figures and the runbook, ``report`` holds them."""

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = dict(report or {})


class WorkloadSpecError(HybridflowError, ValueError):
    """A workload spec the routing rules refuse; the message names the field, what was found and what is
    accepted."""


class JobActionRefused(HybridflowError):
    """An on-call action on a Slurm job may not be done as asked; the message says why and what to do instead."""


class JobActionFailed(HybridflowError):
    """Slurm did not do what an on-call action asked; the message names the job, the state seen and the
    runbook."""


class MlflowUnavailable(HybridflowError):
    """The MLflow tracking server did not answer or refused a call; the message names the server, the call and
    the fix."""
