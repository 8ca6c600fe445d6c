"""A lost rank of a Slurm het job, survived in-job (``trainer.elastic``, issue 24), for real on
the project's test cluster: the batch script serves the job's store on the batch host, the
step runs with ``--kill-on-bad-exit=0 --no-kill``, and ``kill -9`` of one task's process leaves
the other two to finish every step with the uninterrupted trajectory (a 3-rank local run of the
same job: the trajectory does not depend on where the ranks run). No requeue happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMALL_MODEL, cli_env, losses, read_rows
from tests.slurm.test_slurm_faults_real import _rank_pid

COMMON = [*SMALL_MODEL, "task.model.max_seq_len=32", "task.model.dropout=0.0",
          "trainer.global_batch_size=24", "trainer.max_steps=30", "optim.schedule_steps=30",
          "trainer.seed=5", "trainer.val_every=0", "trainer.checkpoint_every=0",
          "trainer.elastic.timeout_s=12"]  # stale after 6 s: room for a loaded machine


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in ln for ln in path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slurm
@pytest.mark.slow
def test_kill_9_one_task_of_a_het_job_and_it_finishes_the_same(tmp_path, token_cache):
    ref = tmp_path / "ref"
    done = subprocess.run([sys.executable, "-m", "hetseq_hpc", *COMMON, "cluster.ranks=3",
                           f"hydra.run.dir={ref}"], cwd=REPO, env=cli_env(token_cache),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, "-m", "hetseq_hpc", "cluster=testcluster",
                             "cluster.wait=true", *COMMON, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=cli_env(token_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a guard against hangs, not a speed check
        while _steps(run_dir) < 10:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(_rank_pid(run_dir / "submitit", 1), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        job = json.loads((run_dir / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", str(job)], capture_output=True)
    assert proc.returncode == 0, stderr[-3000:]
    got, want = losses(run_dir), losses(ref)
    assert sorted(got) == list(range(1, 31))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= 1e-6, f"largest relative difference {worst:.2e}"
    (event,) = [r for r in read_rows(run_dir) if r.get("event") == "membership"]
    assert [x["rank"] for x in event["lost"]] == [1] and event["world_size"] == 2
    assert "SLURM_RESTART_COUNT" not in (run_dir / "logs" / "rank0.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["lost_ranks"] == [1]
