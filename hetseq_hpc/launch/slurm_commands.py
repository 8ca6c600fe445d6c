"""Running Slurm's client commands (sinfo, squeue, sacct, scancel, sbatch): bounded, and read
whatever bytes they print.

A Slurm answer is not always UTF-8: an admin's partition name, node reason or job-submit
plugin message can hold any bytes (``scontrol create partitionname=$'bad\\xff'`` is accepted,
and ``sinfo`` prints it back raw). Both runners decode with replacement characters, so such a
byte is shown as ``\ufffd`` instead of ending the launcher with a traceback.

Queries (:func:`run_slurm`) are killed when they do not answer in time. ``sbatch``
(:func:`run_sbatch`) runs in its own process group, and the whole group is killed: a site's
``sbatch`` is often a shell wrapper around the real one, and killing only the wrapper would
leave the real one running, free to submit later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Dict, List, Optional, Union

#: seconds a query (sinfo, squeue, sacct, scancel) may take; slurmctld may be busy
QUERY_TIMEOUT_S = 60.0
#: seconds to collect what a killed sbatch printed (its pipes may be held by a process that
#: left its group)
_DRAIN_S = 5.0


def slurm_text(data: Union[bytes, str, None]) -> str:
    """What a Slurm command printed, as text: UTF-8, any other byte as ``\\ufffd``."""
    if isinstance(data, str):
        return data
    return (data or b"").decode("utf-8", errors="replace")


def run_slurm(
    argv: List[str],
    timeout_s: float = QUERY_TIMEOUT_S,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Run one Slurm query and return what it printed, decoded by :func:`slurm_text`.

    Args:
        argv: the command and its arguments (``["sinfo", "-h", ...]``).
        timeout_s: seconds it may take; then it is killed.
        cwd, env: as for :func:`subprocess.run`.

    Returns:
        a ``CompletedProcess`` with ``stdout`` and ``stderr`` as text.

    Raises:
        OSError: the command cannot be started.
        subprocess.TimeoutExpired: it did not end within ``timeout_s``.
    """
    done = subprocess.run(argv, capture_output=True, timeout=timeout_s, cwd=cwd, env=env)
    return subprocess.CompletedProcess(
        argv, done.returncode, slurm_text(done.stdout), slurm_text(done.stderr)
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (it leads its own: ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def run_sbatch(
    argv: List[str],
    timeout_s: float,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Run ``sbatch`` (or ``sbatch --test-only``) in its own process group and return what it
    printed, decoded by :func:`slurm_text`.

    Args:
        argv: ``["sbatch", ...]``.
        timeout_s: seconds it may take; then its whole process group is killed.
        cwd, env: as for :class:`subprocess.Popen`.

    Returns:
        a ``CompletedProcess`` with ``stdout`` and ``stderr`` as text.

    Raises:
        OSError: the command cannot be started.
        subprocess.TimeoutExpired: it did not end within ``timeout_s`` (it was killed, with
            every process it started in its group; ``output``/``stderr`` hold what it printed
            before, decoded).
    """
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,  # a timeout ends the command and whatever it started
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:  # the group is dead: its pipes close (unless something left the group)
            out, err = proc.communicate(timeout=_DRAIN_S)
        except subprocess.TimeoutExpired as late:
            out, err = late.output, late.stderr
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        raise subprocess.TimeoutExpired(
            argv, timeout_s, output=slurm_text(out), stderr=slurm_text(err)
        ) from None
    except BaseException:  # Ctrl-C while waiting: the command must not outlive the launcher
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, slurm_text(out), slurm_text(err))


__all__ = ["QUERY_TIMEOUT_S", "run_sbatch", "run_slurm", "slurm_text"]
