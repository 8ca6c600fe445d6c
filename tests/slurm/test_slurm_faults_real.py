"""SLURM faults named right, for real on the project's test cluster (scripts/test-cluster.sh): a
rank is sent SIGKILL or SIGSTOP, or the job gets Slurm's USR2 with ``cluster.max_num_timeout=0``.
(The same replayed from recorded files: tests/unit/test_slurm_faults.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.launch.failures import (
    STOP_RECORD,
)
from tests.helpers.runs import SMALL_MODEL, start_hetseq, wait_rows
from tests.helpers.slurm import rank_pid


# ------------------------------------------------------------------ against the real cluster
def _start(run_dir: Path, token_cache: Path, *overrides: str) -> subprocess.Popen:
    return start_hetseq(
        "cluster=testcluster",
        *SMALL_MODEL,
        "cluster.wait=true",
        "trainer.max_steps=100000",
        "optim.schedule_steps=100000",
        "trainer.val_every=0",
        *overrides,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
    )


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, words",
    [
        (signal.SIGKILL, "it ended without an error of its own"),
        (signal.SIGSTOP, "it was stopped for"),
    ],
)
def test_killed_or_stopped_rank_1_is_named(tmp_path, token_cache, signum, words):
    """Without in-job recovery (``trainer.elastic.enabled=false``; with it:
    tests/slurm/test_elastic_slurm.py), 3 ranks (a100 + 2 x v100); rank 1 gets SIGKILL or
    SIGSTOP mid-run: the one-line error
    names rank 1 (it named rank 0, the first peer to complain), within the collective timeout
    and Slurm's clean-up (a bound against hangs, not a speed check)."""
    proc = _start(
        tmp_path, token_cache, "cluster.collective_timeout_s=20", "trainer.elastic.enabled=false"
    )
    try:
        wait_rows(tmp_path, 2, proc)
        os.kill(rank_pid(tmp_path / "submitit", 1), signum)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        job = json.loads((tmp_path / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", str(job)], capture_output=True)
    assert proc.returncode == 1, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"hetseq-hpc: error: job {job}: rank 1 failed: {words}"), line


@pytest.mark.slurm
@pytest.mark.slow
def test_exhausted_requeues_end_with_the_command_that_continues(tmp_path, token_cache):
    """Slurm's USR2 (time limit near) with ``cluster.max_num_timeout=0``: the ranks checkpoint
    and stop, nobody requeues; the CLI says so and how to continue, exit 3 (was: "ended
    FAILED before every rank finished (0/3 results)", exit 1)."""
    proc = _start(tmp_path, token_cache, "cluster.max_num_timeout=0")
    try:
        wait_rows(tmp_path, 2, proc)
        job = json.loads((tmp_path / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", "--signal=USR2", str(job)], check=True)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    stop = json.loads((tmp_path / STOP_RECORD).read_text())
    assert line == (
        f"hetseq-hpc: stopped after step {stop['step']} with a checkpoint: requeue "
        "limit (cluster.max_num_timeout=0) reached; continue with: hetseq-hpc "
        f"hydra.run.dir={tmp_path} trainer.resume=auto"
    )
    assert (tmp_path / "checkpoints" / f"step_{stop['step']:08d}.pt").is_file()
