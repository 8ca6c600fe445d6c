"""Ask Slurm when a het job would start, without submitting it (``sbatch --test-only``), and
pick the mix of partitions ``cluster.choose`` names.

``sbatch --test-only`` validates the script and returns an estimate of when the job would be
scheduled; nothing is submitted (https://slurm.schedmd.com/sbatch.html#OPT_test-only). It
prints, on stderr, one line per job; for a het job one line for the whole job (measured on Slurm
22.05.8, the project's test cluster, ``SLURM_TIME_FORMAT=standard``)::

    sbatch: Job 5 to start at 2026-11-25T04:48:32 using 3 processors on n[1,3-4]
    sbatch: Job 7 to start at 2026-11-25T04:48:32 using 1 processors on nodes n1 in partition a100

:func:`parse_test_only` takes the latest start of every such line (a het job starts when its
last component does). No such line, or a time that is not a date, is "no estimate" (said in the
row, never guessed); a non-zero exit is a refusal (the job cannot run as asked, e.g. "Requested
node configuration is not available").

The script asked about is the one the launcher would submit for the mix
(:func:`hetseq_hpc.launch.sbatch.render_sbatch`); the ranking and the table are the planner's
(:mod:`hetseq_hpc.plan.when`, :mod:`hetseq_hpc.plan.when_table`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from hetseq_hpc.errors import ConfigError, LaunchError
from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm_checks import partition_inventory, partition_problems, require_slurm
from hetseq_hpc.launch.slurm_commands import run_sbatch
from hetseq_hpc.plan.when import StartEstimate, WhenTable, check_when_cluster, rank_mixes
from hetseq_hpc.plan.when_table import clock, render_when, when_json
from hetseq_hpc.rundir.paths import RunDir

#: seconds one ``sbatch --test-only`` may take (it asks slurmctld, which may be busy)
TEST_ONLY_TIMEOUT_S = 60
#: Slurm's time format for its output (``SLURM_TIME_FORMAT=standard``: ISO 8601, local time)
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"
_START = re.compile(
    r"Job (\d+) to start at (\S+) using (\d+) processors? on (?:nodes )?(\S+)"
    r"(?: in partition (\S+))?"
)
#: where ``cluster.choose`` records the table it chose from, in the run directory
WHEN_FILE = RunDir.WHEN_NAME


def parse_test_only(output: str, returncode: int = 0) -> StartEstimate:
    """Slurm's expected start from the output (stdout + stderr) of ``sbatch --test-only``.

    Args:
        output: what sbatch printed (stderr carries the ``to start at`` lines).
        returncode: sbatch's exit status; non-zero is a refusal.

    Returns:
        a :class:`~hetseq_hpc.plan.when.StartEstimate`: the latest start of the lines
        (epoch seconds, read as local time), the processors and nodes named in ``detail``;
        ``start_epoch=None`` with the reason when there is no start time; ``refused=True``
        with sbatch's error line when it exited non-zero.
    """
    text = output.strip()
    if returncode != 0:
        errors = [
            line.split("error:", 1)[1].strip() for line in text.splitlines() if "error:" in line
        ]
        why = errors[-1] if errors else (text.splitlines()[-1].strip() if text else "")
        return StartEstimate(None, why or f"sbatch exited {returncode}", refused=True)
    starts = []
    for match in _START.finditer(text):
        try:
            epoch = time.mktime(time.strptime(match.group(2), SLURM_TIME))
        except ValueError:
            return StartEstimate(None, f"Slurm's start time {match.group(2)!r} is not a date")
        where = f"on {match.group(4)}" + (f" in {match.group(5)}" if match.group(5) else "")
        starts.append((epoch, f"{where} ({match.group(3)} CPUs)"))
    if not starts:
        first = text.splitlines()[0] if text else "nothing"
        return StartEstimate(None, f"sbatch --test-only printed no start time: {first[:160]}")
    epoch = max(e for e, _ in starts)
    return StartEstimate(epoch, "; ".join(w for _, w in starts))


def test_only_start(
    cluster, python: Optional[str] = None, folder: Optional[str] = None
) -> StartEstimate:
    """``sbatch --test-only`` on the het-job script the launcher would submit for ``cluster``
    (a validated SLURM cluster config): Slurm's expected start. Submits nothing.

    The script's ``#SBATCH --time`` (every het component) is ``cluster.timeout_min``: the
    planner passes the mix's cluster with it set to the predicted run time plus a margin,
    capped by the configured limit (:func:`hetseq_hpc.plan.when.asked_time_min`), so that
    backfill estimates the start of a job of that length.

    Raises:
        ConfigError: a value is unsafe for the script (:func:`render_sbatch`).
        LaunchError: sbatch cannot be run or does not answer in
            :data:`TEST_ONLY_TIMEOUT_S` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="hetseq-when-") as tmp:
        where = folder or cluster.folder or os.path.join(tmp, "submitit")
        script = Path(tmp) / "job.sbatch"
        script.write_text(
            render_sbatch(cluster, str(Path(where).expanduser()), python or sys.executable)
        )
        env = dict(os.environ, SLURM_TIME_FORMAT="standard")
        try:
            proc = run_sbatch(
                ["sbatch", "--test-only", str(script)], TEST_ONLY_TIMEOUT_S, cwd=tmp, env=env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(
                f"sbatch --test-only failed ({type(exc).__name__}: {exc}): check "
                "that slurmctld answers (scontrol ping)"
            ) from None
    return parse_test_only(f"{proc.stdout}\n{proc.stderr}", proc.returncode)


def plan_when(run, strict: bool = False) -> Tuple[WhenTable, Dict[str, object]]:
    """Rank the candidate mixes of ``run`` by expected finish, asking Slurm for each start
    (:func:`hetseq_hpc.plan.when.rank_mixes` with :func:`test_only_start`).

    Args:
        run: the validated SLURM RunConfig.
        strict: refuse a configured partition that cannot run (``cluster.choose``, which
            submits: a typo must not change what is submitted). Otherwise (``plan --when``,
            which submits nothing) such a partition is left out of every mix and the table's
            note says which and why, as long as one partition can run.

    Returns:
        ``(table, label -> restricted RunConfig)``.

    Raises:
        LaunchError: Slurm's commands are missing or do not answer (``sinfo`` is asked once
            first: an unreachable controller is one line, not a refusal per mix).
        ConfigError: the cluster is not a SLURM cluster, or a configured partition does not
            exist or cannot hold what it asks for (:func:`partition_problems`, as ``run`` checks;
            not strict: only when no partition can run).
    """
    check_when_cluster(run)
    require_slurm()
    problems = partition_problems(run.cluster, partition_inventory())
    if problems and (strict or len(problems) == len(run.cluster.partitions)):
        raise ConfigError(next(iter(problems.values())))  # the first, as check_partitions
    return rank_mixes(run, test_only_start, left_out=problems)


def choose_mix(run, run_dir: RunDir):
    """``cluster.choose=finish_first|cheapest``: plan the mixes, print the table, record it in
    ``<run dir>/when.json`` (with the pick) and return ``run`` restricted to the pick (its
    ``cluster.choose`` set to none, so a resume keeps the mix). Submits nothing.

    Raises:
        ConfigError: no mix can run, or finish_first without any start estimate.
        LaunchError: Slurm's commands are missing or do not answer.
    """
    choose = run.cluster.choose
    table, runs = plan_when(run, strict=True)
    print(render_when(table, run))
    row = table.pick(choose)
    if row.label not in runs:  # pragma: no cover - pick() returns rows that can run
        raise ConfigError(
            f"cluster.choose={choose} picked {row.label}, which cannot run: set cluster.choose=none"
        )
    record = json.loads(when_json(table, run))
    record.update(choose=choose, chosen=row.label)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    from hetseq_hpc.files.atomic import atomic_write_text

    atomic_write_text(run_dir.when, json.dumps(record, indent=2))
    finish = clock(row.finish_epoch) if row.finish_epoch is not None else "unknown"
    print(
        f"cluster.choose={choose}: submitting {row.label} ({row.ranks} ranks, expected finish "
        f"{finish}, {row.gpu_hours:.3g} GPU-h); saved with cluster.choose=none so a resume "
        "keeps this mix"
    )
    sys.stdout.flush()
    return runs[row.label]


__all__ = ["WHEN_FILE", "choose_mix", "parse_test_only", "plan_when", "test_only_start"]
