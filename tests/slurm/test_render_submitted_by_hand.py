"""`hetseq-hpc render`, then the rendered job.sbatch submitted by hand to the real Slurm test
cluster, completes."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import SMALL_MODEL, cli_env, hetseq, read_rows
from tests.helpers.slurm import sbatch_and_wait, squeue_state


@pytest.mark.slurm
@pytest.mark.slow
def test_rendered_job_script_submitted_by_hand_completes(tmp_path, token_cache):
    """`hetseq-hpc render` then `sbatch <run dir>/job.sbatch` by hand, from another folder:
    the job runs all 3 ranks to the end (its log folder exists, its job function is there)."""
    run_dir = tmp_path / "run"
    proc = hetseq(
        "render",
        "cluster=testcluster",
        "task=bert",
        *SMALL_MODEL,
        "trainer.max_steps=4",
        "trainer.val_every=0",
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"sbatch {run_dir / 'job.sbatch'}" in proc.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job_id = sbatch_and_wait([str(run_dir / "job.sbatch")], elsewhere, cli_env(token_cache), 300)
    batch_log = run_dir / "submitit" / f"{job_id}_batch.err"
    assert squeue_state(job_id) == "COMPLETED", batch_log.read_text()[-2000:]
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 3
    assert not list(elsewhere.iterdir())  # nothing lands where sbatch was called
