"""``cluster.command``: every rank runs the user's own command (a Lightning, Fabric or
accelerate script using :mod:`hetseq_hpc.integrations`) instead of hetseq_hpc's worker.

The launchers, their checks and the sbatch script do not change: the local launcher starts
the command with the same rank variables it gives the worker; in a Slurm het job each task's
submitit entry runs :class:`CommandJobFunction`, which starts the command with the task's
Slurm variables (read by :class:`hetseq_hpc.integrations.cluster.HetJobEnvironment`) and
``HETSEQ_RUN_DIR``, sends its output to the rank's log, and reports a failure as the worker
does. A script has no in-job recovery (the job's store is not started for it).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hetseq_hpc.env.rank_guard import report_failure
from hetseq_hpc.errors import LaunchError
from hetseq_hpc.rundir.paths import RunDir

#: the variable that tells a command where its run directory is
RUN_DIR_ENV = "HETSEQ_RUN_DIR"


def command_env(run_dir: RunDir, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The command's environment: ``env`` (default this process's) plus :data:`RUN_DIR_ENV`
    and unbuffered Python output."""
    return {
        **(os.environ if env is None else env),
        RUN_DIR_ENV: str(run_dir),
        "PYTHONUNBUFFERED": "1",
    }


def last_line(path: Path) -> str:
    """The last non-empty line of the text file ``path`` ("" when there is none)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line), "")


@dataclass
class CommandJobFunction:
    """What every task of the het job runs (pickled by submitit) when ``cluster.command`` is
    set: the command, its output appended to ``logs/rank<N>.log``. ``run_dir`` is a plain
    string (a pickled job of an earlier version reads the same); the task builds its
    :class:`~hetseq_hpc.rundir.paths.RunDir` once.

    Raises:
        LaunchError: the command exited non-zero (its last output line and exit code, also in
            ``logs/rank<N>.error.json`` for the launcher to name).
    """

    command: List[str]
    run_dir: str

    def __call__(self) -> Dict[str, Any]:
        rank = int(os.environ.get("SLURM_PROCID", "0") or 0)
        paths = RunDir(self.run_dir)
        log_path = paths.rank_log(rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            code = subprocess.call(
                self.command,
                env=command_env(paths),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            error = LaunchError(
                f"cluster.command {self.command[0]!r} exited with code {code} on rank {rank}: "
                f"{last_line(log_path) or 'no output'} (see {log_path})"
            )
            report_failure(error, rank, paths.error_file(rank))
            raise error
        return {"rank": rank, "command": list(self.command), "returncode": code}


__all__ = ["RUN_DIR_ENV", "CommandJobFunction", "command_env", "last_line"]
