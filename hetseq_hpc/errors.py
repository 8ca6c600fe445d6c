"""Typed errors. Every message is one line that names the offending value and ends with the fix."""


class HetseqError(Exception):
    """Base class of every error hetseq_hpc raises on purpose (bad input, a dead rank, ...)."""


class ConfigError(HetseqError, ValueError):
    """A configuration value is invalid. Raised before any process or job is started."""


class WorldError(HetseqError, RuntimeError):
    """The environment does not describe a consistent place in a job (rank, world size, master)."""


class AllocationError(HetseqError, RuntimeError):
    """No valid batch allocation exists, or ranks disagree on the allocation."""


class CheckpointError(HetseqError, RuntimeError):
    """A checkpoint cannot be read or does not fit the run."""


class LaunchError(HetseqError, RuntimeError):
    """Starting, or keeping alive, the worker processes or the SLURM job failed."""


class DataError(HetseqError, RuntimeError):
    """Training data cannot be found or read."""


class TaskContractError(HetseqError, RuntimeError):
    """A task breaks the task contract (docs/tasks.md): a loss that is not a 0-dim sum, ..."""


class Preempted(HetseqError):
    """Training stopped at a step boundary after a scheduler signal; a checkpoint was written.

    Attributes:
        step: the last completed (and checkpointed) optimizer step.
        code: :data:`hetseq_hpc.preemption.TERMINATE` or :data:`~hetseq_hpc.preemption.REQUEUE`.
    """

    def __init__(self, step: int, code: int, reason: str):
        super().__init__(f"stopped after step {step} on {reason}; checkpoint written, resume with "
                         "trainer.resume=auto")
        self.step = step
        self.code = code
