"""Typed errors, and the one table from error type to exit code (:data:`EXIT_CODES`).

Every message is one line that names the offending value and ends with the fix.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple, Type


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


class RankExcluded(LaunchError):
    """This rank was lost to the others (no heartbeat) and they re-formed the job without it
    (``trainer.elastic``): not a failure of the run; the rank ends (exit code 4)."""


class RankFenced(HetseqError):
    """This rank may not write into the run directory: the others re-formed the world without
    it (a newer generation in the job's store does not list it; exit code 4, as
    :class:`RankExcluded`), or the job's store cannot confirm that they have not
    (:class:`StoreLost`). Neither an ``OSError`` nor a ``RuntimeError``: no writer's error
    handling turns it into a failed write to retry or report in a file."""


class StoreLost(RankFenced):
    """The job's store (on the master's node: the local launcher, or the batch host on Slurm)
    could not be reached for ``cluster.collective_timeout_s`` to confirm this rank is current:
    the rank stops without writing and the last checkpoint stays as it is (exit code 1)."""


class TooFewRanks(LaunchError):
    """Fewer ranks than ``trainer.elastic.min_ranks`` survived a lost rank: the run ends as
    without recovery (a requeue resumes it from the last checkpoint)."""


class StorageError(HetseqError, RuntimeError):
    """The run directory cannot be written: its filesystem is full (or over quota) or
    read-only. The message names the mount point, the run directory and how to go on."""


class DataError(HetseqError, RuntimeError):
    """Training data cannot be found or read."""


class TaskContractError(HetseqError, RuntimeError):
    """A task breaks the task contract (docs/tasks.md): a loss that is not a 0-dim sum, ..."""


class NonFiniteLoss(HetseqError):
    """The loss of a training step was NaN or inf on some rank: the step's update was not
    applied (the model is still that of the step before; :mod:`hetseq_hpc.train.nonfinite`).

    Attributes:
        step: the optimizer step whose loss was not finite.
    """

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class Preempted(HetseqError):
    """Training stopped at a step boundary after a scheduler signal; a checkpoint was written.

    Attributes:
        step: the last completed (and checkpointed) optimizer step.
        code: :data:`hetseq_hpc.env.preemption.TERMINATE` or :data:`~hetseq_hpc.env.preemption.REQUEUE`.
        leader: whether THIS rank requeues the job and records the stop: None = the job's
            original rank 0 (``SLURM_PROCID`` 0); an elastic world that lost ranks names its
            current rank 0 (the original one may be the rank that was lost).
    """

    def __init__(self, step: int, code: int, reason: str, leader: Optional[bool] = None):
        super().__init__(
            f"stopped after step {step} on {reason}; checkpoint written, resume with "
            "trainer.resume=auto"
        )
        self.step = step
        self.code = code
        self.leader = leader

    def leads(self, procid: int) -> bool:
        """Whether the rank with original rank ``procid`` requeues the job and records the stop."""
        return procid == 0 if self.leader is None else bool(self.leader)

    @property
    def after_lost_rank(self) -> bool:
        """Whether the stop follows a lost rank (an elastic world fell below its minimum): the
        rank still holds the broken world's DDP reducer and gloo group, so it must end without
        the interpreter's teardown (:data:`hetseq_hpc.env.rank_guard.FAILED`)."""
        return self.leader is not None


# ---------------------------------------------------------------------------- exit codes
# One table from error type to exit code, and the one-line error every command prints:
# ConfigError (bad input) 2; Preempted (stopped after a checkpoint, not a failure) 3 and said
# without 'error:'; RankExcluded (the job went on without this rank) 4; any other
# HetseqError 1; Ctrl-C 130.
PROG = "hetseq-hpc"
#: (error type, exit code), most specific first; the first ``isinstance`` match decides
EXIT_CODES: Tuple[Tuple[Type[BaseException], int], ...] = (
    (ConfigError, 2),
    (Preempted, 3),
    (RankExcluded, 4),
    (StoreLost, 1),
    (RankFenced, 4),
    (HetseqError, 1),
)
#: exit code after Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130


def exit_code(exc: BaseException) -> int:
    """The exit code of ``exc`` by :data:`EXIT_CODES` (1 for anything not listed)."""
    return next((code for kind, code in EXIT_CODES if isinstance(exc, kind)), 1)


def report_error(exc: BaseException, prog: str = PROG) -> int:
    """Print ``exc`` as the command's one stderr line and return its exit code. A stop after
    a checkpoint (:class:`Preempted`) is said without ``error:``: it is not a failure."""
    code = exit_code(exc)
    text = str(exc) or type(exc).__name__
    print(f"{prog}: {text}" if code == 3 else f"{prog}: error: {text}", file=sys.stderr)
    return code
