"""Submitting the job's script with ``sbatch``: bounded, and never leaving a job behind that
nobody knows of.

submitit runs ``sbatch`` without a time limit and decodes its answer as strict UTF-8: a hung
``sbatch`` (slurmctld overloaded, a site wrapper waiting on something) hung ``run`` forever,
and an answer with other bytes or without a job id ended it with a traceback.
:func:`submit_script` waits ``cluster.submit_timeout_s`` at most (then kills sbatch and every
process it started, :func:`~hetseq_hpc.launch.slurm_commands.run_sbatch`) and reads any bytes.

A killed sbatch may still have reached slurmctld (it answered late), and an answer without a
job id may come from one that did: so, whenever the answer is not a job id, the queue is asked
for jobs whose batch script is this submission's (its file name is unique: squeue's ``%o``) and
they are cancelled. An admin may then see, in ``sacct``, a job of ``cluster.job_name`` cancelled
by its user seconds after it was submitted; nothing runs. When squeue cannot answer either, the
one-line error says which job name to look for. A job that slurmctld creates only after that
look (sbatch killed while its request was still being handled) is not found; it finds no job
function (submitit moves it in place only after an answered submission) and fails within a
minute, unless ``render`` left one for a submission by hand in the same folder.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

from hetseq_hpc.errors import LaunchError
from hetseq_hpc.launch.failures import error_line
from hetseq_hpc.launch.slurm_commands import run_sbatch, run_slurm

#: a job id in sbatch's answer ("Submitted batch job 12"; submitit's pattern, so a site
#: wrapper that adds words still works)
_JOB_ID = re.compile(r"job (\d+)")


def job_id_of(answer: str) -> Optional[str]:
    """The job id in what ``sbatch`` printed on stdout, or None."""
    match = _JOB_ID.search(answer)
    return match.group(1) if match else None


def jobs_of_script(script: Path, timeout_s: float) -> Optional[List[str]]:
    """Ids (het leaders) of the queued or running jobs whose batch script is ``script``, or
    None when ``squeue`` cannot answer within ``timeout_s``."""
    try:
        out = run_slurm(["squeue", "-h", "-o", "%i|%o"], timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    ids = []
    for line in out.stdout.splitlines():
        job, _, command = line.strip().partition("|")
        if command.strip() and Path(command.strip()).name == script.name:
            ids.append(job.split("+")[0])
    return sorted(set(ids), key=int)


def _cancel_leftovers(script: Path, printed: str, timeout_s: float, job_name: str) -> str:
    """Cancel the jobs this submission may have created (an id sbatch printed, the jobs of
    ``script`` in the queue); words for the error line saying what is left."""
    found = jobs_of_script(script, timeout_s)
    ids = sorted(set(found or []) | ({job_id_of(printed)} - {None}), key=int)
    cancelled = []
    for job in ids:
        try:
            done = run_slurm(["scancel", job], timeout_s)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            cancelled.append(job)
    left = [job for job in ids if job not in cancelled]
    if left:
        return f"job {', '.join(left)}, which it had submitted, is left: scancel {' '.join(left)}"
    if cancelled:
        return f"job {', '.join(cancelled)}, which it had submitted, was cancelled: nothing is left"
    if found is None:
        return (
            f"squeue did not answer either, so it may have reached Slurm: look for a job named "
            f"{job_name!r} (squeue --me -n {job_name}) and scancel it"
        )
    return "nothing was submitted (squeue lists no job of it)"


def submit_script(script: Path, timeout_s: float, job_name: str) -> str:
    """``sbatch script``, waited for ``timeout_s`` at most: the job id.

    Args:
        script: the batch script (its file name unique to this submission).
        timeout_s: ``cluster.submit_timeout_s``.
        job_name: ``cluster.job_name``, for the words when a job may be left.

    Returns:
        the job id sbatch printed.

    Raises:
        LaunchError: one line, when sbatch cannot run, refuses the job, does not answer in
            ``timeout_s`` (it is killed) or answers without a job id; in the last two cases
            any job of ``script`` found in the queue is cancelled first, and the line says so.
    """
    try:
        out = run_sbatch(["sbatch", str(script)], timeout_s)
    except OSError as exc:
        raise LaunchError(f"sbatch could not run ({exc}): nothing was submitted") from None
    except subprocess.TimeoutExpired as exc:
        left = _cancel_leftovers(script, str(exc.output or ""), timeout_s, job_name)
        raise LaunchError(
            f"sbatch did not answer within {timeout_s:g} s (cluster.submit_timeout_s) and was "
            f"stopped; {left}; check that slurmctld answers (scontrol ping) and submit again"
        ) from None
    if out.returncode != 0:
        raise LaunchError(
            f"sbatch refused the job ({error_line(out.stderr or out.stdout)}): fix the value "
            "sbatch names (partition limits, account, paths), or inspect it with "
            "cluster.dry_run=true"
        )
    job_id = job_id_of(out.stdout)
    if job_id is None:
        said = " ".join(f"{out.stdout} {out.stderr}".split())[:200] or "nothing"
        left = _cancel_leftovers(script, "", timeout_s, job_name)
        raise LaunchError(
            f"sbatch ({shutil.which('sbatch')}) answered {said!r}, which holds no job id "
            f"('Submitted batch job N'); {left}; check that command"
        )
    return job_id


__all__ = ["job_id_of", "jobs_of_script", "submit_script"]
