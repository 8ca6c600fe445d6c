"""Submitting through submitit's real executor code (hetseq_hpc.launch.slurm.HetSlurmExecutor)
with ``sbatch`` replaced by a recording script at the command boundary, so the private override
points that tests/unit/test_submitit_contract.py pins by name are checked by use.
"""

from __future__ import annotations

import os
import stat
import sys

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.launch.slurm import HetseqJobFunction, HetSlurmExecutor, HetSlurmJob


def test_submission_through_the_real_executor(tmp_path, monkeypatch):
    """submit() with a recording ``sbatch`` on PATH: the script submitted is ours (het
    components), the job is a HetSlurmJob over every rank, and the folder holds submitit's
    layout (submission file, submitted pickle)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        f"#!/bin/sh\ncp \"$1\" {tmp_path / 'submitted.sh'}\necho 'Submitted batch job 4242'\n"
    )
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = compose_run_config(["cluster=testcluster"])
    folder = tmp_path / "submitit"
    executor = HetSlurmExecutor(folder, run.cluster, python=sys.executable)
    job = executor.submit(HetseqJobFunction(str(tmp_path / "cfg.yaml"), str(tmp_path)))
    assert isinstance(job, HetSlurmJob) and job.job_id == "4242"
    assert job.num_tasks == run.cluster.world_size == 3
    script = (tmp_path / "submitted.sh").read_text()
    assert "#SBATCH hetjob" in script and "--het-group=0-1" in script
    assert (folder / "4242_submitted.pkl").is_file()
    assert (folder / "4242_submission.sh").exists()
