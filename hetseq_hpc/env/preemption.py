"""Stop requests from the scheduler, turned into a checkpoint at a step boundary.

Slurm signals a job ``--signal=USR2@<signal_delay_s>`` before its time limit (and a
preempting scheduler may do the same); ``scontrol requeue`` and ``scancel`` send SIGTERM and,
``KillWait`` seconds later, SIGKILL (https://slurm.schedmd.com/sbatch.html#OPT_signal,
https://slurm.schedmd.com/scancel.html). The handlers here only record the request; the
training loop shares it with every rank in its per-step exchange, so all ranks stop after the
SAME step, rank 0 writes the checkpoint, and then :class:`~hetseq_hpc.errors.Preempted` is
raised. On USR2 rank 0 requeues the het job through its leader id (Slurm requeues het jobs
only through the leader); on SIGTERM whoever sent it decides.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Mapping, Optional

from hetseq_hpc.errors import LaunchError

log = logging.getLogger(__name__)

NONE, TERMINATE, REQUEUE = 0, 1, 2
REASONS = {
    TERMINATE: "SIGTERM (cancel, requeue or node shutdown) or a lost launcher (SIGHUP)",
    REQUEUE: "SIGUSR2 (time limit near, or preemption)",
}


class StopRequest:
    """Records the strongest stop request received (``NONE`` < ``TERMINATE`` < ``REQUEUE``).

    A second SIGTERM restores the default handler and re-sends itself, so a process that is
    stuck (e.g. waiting for a dead peer) can still be stopped.
    """

    def __init__(self) -> None:
        self.code = NONE
        self._terms = 0
        self._parent = os.getppid()
        #: ``time.monotonic()`` when a SIGHUP came after this process's parent died (the
        #: local launcher, killed: its parent-death signal), else None; a SIGHUP of a launcher
        #: *thread* that ended leaves the parent in place and this None
        self.parent_gone_at: Optional[float] = None

    def _on_usr2(self, signum, frame) -> None:
        log.warning("caught SIGUSR2: will checkpoint after this step and requeue")
        self.code = max(self.code, REQUEUE)

    def _on_term(self, signum, frame) -> None:
        self._terms += 1
        if self._terms > 1:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.warning("caught SIGTERM: will checkpoint after this step and stop")
        self.code = max(self.code, TERMINATE)

    def _on_hup(self, signum, frame) -> None:
        if self.parent_gone_at is None and os.getppid() != self._parent:
            self.parent_gone_at = time.monotonic()
        if self.code < TERMINATE:  # the first of possibly several (one per launcher thread)
            log.warning(
                "caught SIGHUP (the launcher is gone): will checkpoint after this step and stop"
            )
        self.code = max(self.code, TERMINATE)

    def install(self) -> StopRequest:
        """Install the handlers (main thread only); returns self. SIGHUP is the local
        launcher's parent-death signal (:func:`hetseq_hpc.launch.local._die_with_parent`):
        like a first SIGTERM, however often it comes."""
        signal.signal(signal.SIGUSR2, self._on_usr2)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        return self


def requeue_job(env: Optional[Mapping[str, str]] = None, max_requeues: int = 3) -> bool:
    """``scontrol requeue <SLURM_JOB_ID>`` unless the job already restarted ``max_requeues``
    times (``SLURM_RESTART_COUNT``). Returns True if requeued.

    Raises:
        LaunchError: scontrol is missing or refuses.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        log.warning("not inside a SLURM job: nothing to requeue")
        return False
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts >= max_requeues:
        log.warning(
            "job %s restarted %d times already (cluster.max_num_timeout=%d): not requeued",
            job_id,
            restarts,
            max_requeues,
        )
        return False
    try:
        out = subprocess.run(
            ["scontrol", "requeue", job_id],
            capture_output=True,
            encoding="utf-8",
            errors="replace",  # an admin's text in Slurm's answer may be any bytes
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(
            f"scontrol requeue {job_id} could not run ({exc}): requeue by hand"
        ) from None
    if out.returncode < 0:
        # the requeue itself signals every process of the job, scontrol included (seen on Slurm
        # 22.05: killed by SIGTERM, no output): the request went through
        log.warning(
            "scontrol requeue %s was stopped by signal %d along with the job: the "
            "requeue was accepted",
            job_id,
            -out.returncode,
        )
    elif out.returncode != 0:
        raise LaunchError(f"scontrol requeue {job_id} failed: {out.stderr.strip()}")
    log.warning("requeued job %s (restart %d of at most %d)", job_id, restarts + 1, max_requeues)
    return True
