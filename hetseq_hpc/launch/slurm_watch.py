"""Waiting for a (het) SLURM job: its state, its ranks' results, the rank to blame.

submitit's state watcher reads ``sacct`` rows ``17+0``, ``17+1``: the leader id of a het job
stays UNKNOWN and a cancelled het job never finishes (and without accounting there is no
``sacct`` at all). :class:`HetSlurmInfoWatcher` asks ``squeue -t all`` instead (jobs stay listed
for MinJobAge) and folds the components' states into the leader's, falling back to ``sacct``
(measured on Slurm 22.05 with submitit 1.5.4 on the project's test cluster,
scripts/test-cluster.sh; submitit issue #1741).

When ranks fail, :func:`wait_for_job` names the rank whose OWN error came first, from each
rank's ``logs/rank<N>.error.json`` and result traceback, as the local launcher does
(:func:`hetseq_hpc.launch.failures.first_failure`): a rank killed or stopped leaves no error of
its own, and its peers' disconnections do not count against them. A job that stopped after a
checkpoint because its requeues were used up is reported as such, with the command that
continues it (:class:`RequeueLimitReached`).
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from hetseq_hpc.env.preemption import REQUEUE
from hetseq_hpc.errors import LaunchError, Preempted
from hetseq_hpc.launch.failures import (
    error_line,
    first_failure,
    is_peer_error,
    pick_failure,
    read_error_file,
    read_stop_record,
)
from hetseq_hpc.launch.sbatch import END_GRACE_S
from hetseq_hpc.launch.slurm_commands import run_slurm, slurm_text
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)

#: Slurm states after which a job will not produce more results
TERMINAL_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
    "REVOKED",
}
#: precedence when folding component states into one (first match wins)
#: seconds the other ranks get to leave their result or error after a rank failed
FAILURE_GRACE_S = 5.0
#: seconds results may take to land on a shared filesystem after the job ended
SETTLE_S = 5.0
#: seconds a job whose survivors finished may take to end by itself before it is cancelled:
#: its lost task is dead (srun returns), or the batch script ends the step of a stopped task
#: the others left out :data:`~hetseq_hpc.launch.sbatch.END_GRACE_S` after the run's summary
#: (a script of an older version would hold the step until the time limit); either way it
#: exits 0: COMPLETED
SELF_END_GRACE_S = END_GRACE_S + 40.0
_FOLD_ORDER = [
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "TIMEOUT",
    "DEADLINE",
    "CANCELLED",
    "PREEMPTED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "COMPLETED",
]


def fold_states(states: List[str]) -> str:
    """One state for a het job from its components' states (a failure anywhere wins; the job
    is COMPLETED only when every component is)."""
    clean = [s.split()[0].upper() for s in states if s]
    if not clean:
        return "UNKNOWN"
    for state in _FOLD_ORDER:
        if state in clean:
            return state
    return clean[0]


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """State of (het) jobs from ``squeue -t all``, with ``sacct`` as fallback."""

    def _make_command(self) -> Optional[List[str]]:
        to_check = {x.split("_")[0] for x in self._registered - self._finished}
        if not to_check:
            return None
        return ["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(sorted(to_check))]

    def read_info(self, string: Any) -> Dict[str, Dict[str, str]]:
        """Parse ``id|STATE`` rows; ``12+1`` rows are folded into job ``12``."""
        if not isinstance(string, str):
            string = slurm_text(string)
        per_job: Dict[str, List[str]] = {}
        for line in string.splitlines():
            if "|" not in line:
                continue
            job, state = line.strip().split("|", 1)
            per_job.setdefault(job.split("+")[0], []).append(state)
        return {
            job: {"State": fold_states(states), "JobID": job} for job, states in per_job.items()
        }

    def update(self) -> None:
        """Refresh every registered job's state (squeue, then sacct for jobs squeue forgot)."""
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        try:
            output = run_slurm(command).stdout
            info = self.read_info(output)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("squeue failed (%s): job states may lag", exc)
            info = {}
        missing = [j for j in command[-1].split(",") if j not in info]
        if missing and shutil.which("sacct"):
            info.update(self._sacct(missing))
        self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _sacct(self, jobs: List[str]) -> Dict[str, Dict[str, str]]:
        try:
            out = run_slurm(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(jobs)])
        except (OSError, subprocess.SubprocessError):
            return {}
        if out.returncode != 0:
            return {}
        return self.read_info(out.stdout)


class HetSlurmJob(SlurmJob):
    """A submitit job whose state comes from :class:`HetSlurmInfoWatcher`."""

    watcher = HetSlurmInfoWatcher(delay_s=30)


def task_outcomes(folder: Path, job_id: str, num_tasks: int) -> Dict[int, Tuple[str, Any]]:
    """Result pickles present so far: ``rank -> ("success", summary) | ("error", traceback)``."""
    out = {}
    for rank in range(num_tasks):
        path = Path(folder) / f"{job_id}_{rank}_result.pkl"
        if path.exists():
            try:
                out[rank] = submitit_utils.pickle_load(path)
            except (EOFError, OSError):
                continue  # being written
    return out


class RequeueLimitReached(Preempted):
    """The job stopped cleanly after the checkpoint of ``step`` (Slurm's time limit or a
    preemption) and was not requeued: ``cluster.max_num_timeout`` requeues were used up. Not a
    failure (the CLI exits 3, like a rank stopped after a checkpoint); the message says how to
    continue."""

    def __init__(self, step: int, max_requeues: int, run_dir: RunDir):
        super().__init__(step, REQUEUE, "the requeue limit")
        self.args = (
            f"stopped after step {step} with a checkpoint: requeue limit (cluster.max_num_timeout="
            f"{max_requeues}) reached; continue with: hetseq-hpc "
            f"{shlex.quote(f'hydra.run.dir={run_dir}')} trainer.resume=auto",
        )


#: the result of a rank the others left out (``RankExcluded``): it ended quietly, exit 0
EXCLUDED_RESULT = "excluded_rank"


def is_excluded(result: Any) -> bool:
    """Whether a rank's result says it was left out by the others (not a summary)."""
    return isinstance(result, dict) and bool(result.get(EXCLUDED_RESULT))


def _summaries(outcomes: Dict[int, Tuple[str, Any]]) -> Dict[int, Any]:
    """rank -> summary of the ranks that returned one (not the ones left out)."""
    return {r: o[1] for r, o in outcomes.items() if o[0] == "success" and not is_excluded(o[1])}


def cancel_job(job_id: str) -> None:
    """``scancel`` the job; never raises (without scancel, nothing can be cancelled)."""
    try:
        run_slurm(["scancel", str(job_id)])
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not scancel job %s (%s): cancel it by hand", job_id, exc)


def _rank_errors(run_dir: RunDir, traces: Dict[int, str], num_tasks: int) -> Dict[int, Dict]:
    """rank -> its own error: ``logs/rank<N>.error.json`` if it wrote one, else one built from
    its result traceback (no time: such ranks sort by rank)."""
    errors: Dict[int, Dict] = {}
    for rank in range(num_tasks):
        err = read_error_file(run_dir.error_file(rank))
        if err is None and rank in traces:
            line = error_line(traces[rank])
            kind, _, message = line.partition(": ")
            err = {"type": kind, "message": message or line, "peer": is_peer_error(line)}
        if err is not None:
            errors[rank] = err
    return errors


def failure_message(
    job_id: str, folder: Path, run_dir: RunDir, num_tasks: int, outcomes: Dict[int, Tuple[str, Any]]
) -> str:
    """The one-line report of a failed job: the rank whose own error came first
    (:func:`~hetseq_hpc.launch.failures.first_failure`; ranks without a result or an error of
    their own count as killed or stopped), its error line and its log file."""
    traces = {r: str(o[1]) for r, o in outcomes.items() if o[0] == "error"}
    errors = _rank_errors(run_dir, traces, num_tasks)
    silent = [r for r in range(num_tasks) if r not in outcomes and r not in errors]
    rank = first_failure({}, errors, silent=silent)
    log_err = folder / f"{job_id}_{rank}_log.err"
    stopped_s = float(errors.get(rank, {}).get("stopped_s") or 0)
    if stopped_s > 0 and is_peer_error(f"{errors[rank].get('type')}: {errors[rank]['message']}"):
        reason = (
            f"it was stopped for {stopped_s:.0f} s (SIGSTOP, Ctrl-Z, a frozen node) and did "
            "not answer; its peers timed out waiting for it"
        )
    elif rank in traces:
        reason = error_line(traces[rank])
    elif rank in errors:
        reason = f"{errors[rank].get('type', 'Error')}: {errors[rank]['message']}"
    else:
        reason = (
            "it ended without an error of its own (killed by a signal: scancel, kill -9, "
            "the kernel's OOM killer; or stopped), and its peers lost it"
        )
    return f"job {job_id}: rank {rank} failed: {reason} (log: {log_err}; {run_dir.rank_log(rank)})"


def _accounted(run_dir: RunDir, num_tasks: int, outcomes: Dict[int, Tuple[str, Any]]) -> bool:
    return all(r in outcomes or run_dir.error_file(r).is_file() for r in range(num_tasks))


def finished_without_lost(
    outcomes: Dict[int, Tuple[str, Any]], num_tasks: int
) -> Optional[Dict[str, Any]]:
    """The summary of a run whose surviving ranks all returned after losing some
    (``lost_ranks`` in their summary, :mod:`hetseq_hpc.train.recovery.elastic`; a rank the others left
    out returns :data:`EXCLUDED_RESULT`, no summary), else None."""
    survivors = _summaries(outcomes)
    if not survivors or any(kind != "success" for kind, _ in outcomes.values()):
        return None
    summary = survivors[min(survivors)]
    lost = set(summary.get("lost_ranks") or []) if isinstance(summary, dict) else set()
    if lost and set(outcomes) | lost == set(range(num_tasks)):
        return summary
    return None


def summary_stamp(run_dir: RunDir) -> int:
    """When the run's ``summary.json`` was last written (``st_mtime_ns``), -1 if absent:
    taken before submitting, it tells a summary this job wrote from an earlier one."""
    try:
        return run_dir.summary.stat().st_mtime_ns
    except OSError:
        return -1


def finished_by_survivors(run_dir: RunDir, before: int) -> Optional[Dict[str, Any]]:
    """The run's ``summary.json`` when this job wrote it (its stamp differs from ``before``,
    :func:`summary_stamp`) after losing ranks (``lost_ranks``), else None.

    The survivors of a task that was stopped (SIGSTOP, a frozen node) rather than killed may
    not return their results: freeing the broken world as they return blocks while the
    stopped task still holds its sockets (seen on the test cluster; :data:`~hetseq_hpc.env.
    rank_guard.FAILED` says why), so they end together with it when the batch script ends
    the step after the run's summary (:func:`~hetseq_hpc.launch.sbatch.survived_lines`; Slurm
    records COMPLETED). The summary is then the run's result."""
    if summary_stamp(run_dir) == before:
        return None
    try:
        summary = json.loads(run_dir.summary.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(summary, dict) and summary.get("lost_ranks"):
        return summary
    return None


def note_lost(job_id: str, summary: Dict[str, Any], run_dir: RunDir) -> None:
    """Log, in one line, the ranks a finished run lost on the way (its ``lost_ranks``)."""
    lost = summary.get("lost_ranks") if isinstance(summary, dict) else None
    if lost:
        log.warning(
            "job %s: rank(s) %s were lost (killed, or stopped or hung and left out by the "
            "others); the others finished the run without them: %s",
            job_id,
            list(lost),
            run_dir.summary,
        )


def wait_for_job(
    job: HetSlurmJob,
    run_dir: RunDir,
    num_tasks: int,
    poll_s: float = 1.0,
    stream: bool = False,
    timeout_s: Optional[float] = None,
    elastic: bool = False,
    summary_before: Optional[int] = None,
) -> Dict[str, Any]:
    """Wait until every rank returned, a rank failed, or Slurm ended the job.

    Args:
        job: the submitted job.
        run_dir: the run directory (rank 0's log is streamed from ``logs/rank0.log``).
        num_tasks: ranks in the job.
        poll_s: seconds between checks.
        stream: copy rank 0's log to stderr while waiting.
        timeout_s: give up after this long (None = wait as long as the job lives).
        elastic: the job recovers from a lost rank in-job (its step survives a task's exit),
            so a rank failing by its own error must cancel it.
        summary_before: :func:`summary_stamp` of the run directory before the job was
            submitted (None: taken now); with ``elastic``, a job that ended COMPLETED without
            its survivors' results but with a ``summary.json`` of its own that names lost
            ranks finished (:func:`finished_by_survivors`).

    Returns:
        rank 0's summary (the lowest surviving rank's after in-job recovery); ranks lost on
        the way are named in one logged line (:func:`note_lost`).

    Raises:
        LaunchError: a rank failed (the rank whose own error came first is named, with its error
            line: :func:`failure_message`; with ``elastic``, a job still running is cancelled,
            unless the ranks ended with ``TooFewRanks``), or the job ended without results (CANCELLED,
            TIMEOUT, ...), or ``timeout_s`` passed.
        RequeueLimitReached: the job stopped after a checkpoint with its requeues used up.
    """
    folder = Path(job.paths.folder)
    log_path = run_dir.rank_log(0)
    before = summary_stamp(run_dir) if summary_before is None else summary_before
    offset = 0
    start = time.monotonic()
    ended_at: Optional[float] = None
    while True:
        if stream and log_path.exists():
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            if chunk:
                sys.stderr.write(chunk)
                sys.stderr.flush()
        outcomes = task_outcomes(folder, job.job_id, num_tasks)
        if any(o[0] == "error" for o in outcomes.values()) or any(
            run_dir.error_file(r).is_file() for r in range(num_tasks)
        ):
            # let the other ranks' results and errors land, then pick the cause
            failed_at = time.monotonic()
            while (
                not _accounted(run_dir, num_tasks, outcomes)
                and time.monotonic() - failed_at < FAILURE_GRACE_S
            ):
                time.sleep(poll_s)
                outcomes = task_outcomes(folder, job.job_id, num_tasks)
            message = failure_message(job.job_id, folder, run_dir, num_tasks, outcomes)
            traces = {r: str(o[1]) for r, o in outcomes.items() if o[0] == "error"}
            too_few = any(
                e.get("type") == "TooFewRanks"
                for e in _rank_errors(run_dir, traces, num_tasks).values()
            )
            if (
                elastic
                and not too_few
                and job.watcher.get_state(job.job_id, mode="force") not in TERMINAL_STATES
            ):
                # in-job recovery would let the others go on without a rank that failed by its
                # own error (a bug, bad data): the job fails instead (TooFewRanks: the survivors
                # checkpoint and end by themselves)
                log.warning(
                    "job %s: a rank failed by its own error: cancelling the job", job.job_id
                )
                cancel_job(job.job_id)
            raise LaunchError(message)
        if len(outcomes) == num_tasks:
            survivors = _summaries(outcomes)
            if not survivors:
                raise LaunchError(
                    f"job {job.job_id}: every rank was left out by the others: see {run_dir.logs}"
                )
            note_lost(job.job_id, survivors[min(survivors)], run_dir)
            return survivors[min(survivors)]
        survived = finished_without_lost(outcomes, num_tasks)
        if survived is not None:  # in-job recovery: the survivors finished without them
            ends_by = time.monotonic() + SELF_END_GRACE_S
            while (
                job.watcher.get_state(job.job_id, mode="force") not in TERMINAL_STATES
                and time.monotonic() < ends_by
            ):
                time.sleep(poll_s)
            if job.watcher.get_state(job.job_id, mode="force") not in TERMINAL_STATES:
                # a stopped rank the others left out would hold the step until the time limit
                cancel_job(job.job_id)
            note_lost(job.job_id, survived, run_dir)
            return survived
        state = job.watcher.get_state(job.job_id, mode="force")
        if state in TERMINAL_STATES:
            # results may still be landing on a shared filesystem: give them a moment
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > SETTLE_S:
                survived = finished_by_survivors(run_dir, before) if elastic else None
                if survived is not None and state == "COMPLETED":
                    note_lost(job.job_id, survived, run_dir)
                    return survived
                stop = read_stop_record(run_dir, job.job_id)
                if stop is not None and stop.get("code") == REQUEUE and not stop.get("requeued"):
                    raise RequeueLimitReached(
                        stop["step"], int(stop.get("max_requeues", 0)), run_dir
                    )
                raise LaunchError(
                    f"job {job.job_id} ended {state} before every rank finished ({len(outcomes)}/"
                    f"{num_tasks} results): see {folder} and {run_dir.logs}"
                )
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise LaunchError(
                f"job {job.job_id} still {state} after {timeout_s:.0f} s: "
                f"scancel {job.job_id} to stop it"
            )
        time.sleep(poll_s)


__all__ = [
    "EXCLUDED_RESULT",
    "FAILURE_GRACE_S",
    "TERMINAL_STATES",
    "HetSlurmInfoWatcher",
    "HetSlurmJob",
    "RequeueLimitReached",
    "cancel_job",
    "failure_message",
    "finished_by_survivors",
    "fold_states",
    "is_excluded",
    "note_lost",
    "pick_failure",
    "summary_stamp",
    "task_outcomes",
    "wait_for_job",
]
