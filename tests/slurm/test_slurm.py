"""cluster=testcluster: ONE heterogeneous SLURM job over two partitions, against a real Slurm.

The cluster is the project's own (scripts/test-cluster.sh: slurmctld + 4 emulated slurmd,
partitions a100 = n[1-2] and v100 = n[3-4] with fake GPU GRES); scripts/run-tests.sh starts
and stops it. Tests skip only when it could not be started, with the reason the script gave
(tests/slurm/conftest.py). The nodes have no CUDA (the GPUs are fake device files), so ranks run on CPU with gloo: the
GPU side is the only thing faked here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hetseq_hpc.launch.slurm import job_from_run_dir, wait_for_job
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.fault_tasks import fail_on_rank
from tests.helpers.runs import (
    REPO,
    SMALL_MODEL,
    assert_ok,
    cli_env,
    hetseq,
    hetseq_cmd,
    losses,
    read_rows,
    snapshot,
    start_hetseq,
    wait_rows,
)
from tests.helpers.slurm import sbatch_and_wait, slurm_cli, squeue_state
from tests.helpers.waits import wait_for

EXACT = ["task.model.dropout=0.0", "trainer.val_every=0", "trainer.seed=3"]


# ------------------------------------------------------------------ against the real cluster
@pytest.mark.slurm
@pytest.mark.slow
def test_het_job_across_partitions(tmp_path, token_cache):
    """3 ranks over a100 (1 node) + v100 (2 nodes): finishes, loss falls, every rank's
    partition/GRES recorded, and the master is rank 0's node by NAME."""
    proc = slurm_cli(
        tmp_path,
        token_cache,
        "cluster.wait=true",
        "trainer.max_steps=16",
        "optim.warmup_steps=2",
        "optim.lr=3e-3",
        "trainer.val_every=8",
    )
    assert_ok(proc)
    assert re.search(r"submitted het job \d+: 3 ranks over a100, v100", proc.stdout)
    alloc = json.loads((tmp_path / "allocation.json").read_text())
    ranks = alloc["ranks"]
    assert [r["partition"] for r in ranks] == ["a100", "v100", "v100"]
    assert [r["gres"] for r in ranks] == ["a100", "v100", "v100"]
    assert [r["het_group"] for r in ranks] == [0, 1, 1]
    assert [r["node"] for r in ranks] == ["n1", "n3", "n4"]
    assert {r["world"]["master_addr"] for r in ranks} == {ranks[0]["node"]} == {"n1"}
    assert all(r["world"]["source"] == "slurm" and r["world"]["world_size"] == 3 for r in ranks)
    rows = read_rows(tmp_path)
    assert [r["partition"] for r in rows[-1]["ranks"]] == ["a100", "v100", "v100"]
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.2
    job_id = json.loads((tmp_path / "job.json").read_text())["job_id"]
    results = sorted(p.name for p in (tmp_path / "submitit").glob(f"{job_id}_*_result.pkl"))
    assert results == [f"{job_id}_{r}_result.pkl" for r in range(3)], "every rank returns"
    assert "gloo" in (tmp_path / "logs" / "rank0.log").read_text()


@pytest.mark.slurm
@pytest.mark.slow
def test_rerunning_a_finished_run_submits_nothing_and_rewrites_nothing(tmp_path, token_cache):
    """Issue 40: the same command again on a finished het job's run directory says it is
    complete in one line, exit 0, before anything is submitted; every file stays byte for byte
    (it submitted a job that rewrote summary.json with no loss)."""
    first = ["cluster.wait=true", "trainer.max_steps=2", "trainer.val_every=0"]
    assert_ok(slurm_cli(tmp_path, token_cache, *first))
    before = snapshot(tmp_path)
    assert {"summary.json", "metrics.jsonl", "checkpoints/step_00000002.pt"} <= set(before)
    again = slurm_cli(tmp_path, token_cache, *first)
    assert_ok(again)
    assert again.stderr == "" and "submitted" not in again.stdout, again.stdout + again.stderr
    line = again.stdout.strip()
    assert "\n" not in line and line.startswith(f"hetseq-hpc: {tmp_path} is complete: 2 steps")
    assert f"summary {tmp_path / 'summary.json'}" in line and "trainer.max_steps=<more" in line
    assert snapshot(tmp_path) == before


@pytest.mark.slurm
@pytest.mark.slow
def test_handwritten_template_runs(tmp_path, token_cache):
    """slurm/hetjob.sbatch, submitted by hand with sbatch, runs the same worker to the end."""
    run_dir = tmp_path / "run"
    assert_ok(slurm_cli(run_dir, token_cache, "cluster.dry_run=true", "trainer.max_steps=6"))
    env = cli_env(token_cache)
    env.update(RUN_DIR=str(run_dir), PYTHON=sys.executable)
    job_id = sbatch_and_wait([str(REPO / "slurm" / "hetjob.sbatch")], tmp_path, env, 300)
    assert squeue_state(job_id) == "COMPLETED", (tmp_path / f"hetseq-{job_id}.out").read_text()
    assert [r["step"] for r in read_rows(run_dir)] == list(range(1, 7))
    ranks = json.loads((run_dir / "allocation.json").read_text())["ranks"]
    assert [r["partition"] for r in ranks] == ["a100", "v100", "v100"]


@pytest.mark.slurm
@pytest.mark.slow
def test_sweep_submits_one_job_per_point(tmp_path, token_cache):
    proc = slurm_cli(
        tmp_path, token_cache, "optim.lr=1e-3,3e-3", "trainer.max_steps=4", multirun=True
    )
    assert_ok(proc)
    ids = re.findall(r"submitted het job (\d+)", proc.stdout)
    assert len(ids) == 2 and len(set(ids)) == 2, proc.stdout
    for point, lr in ((0, 1e-3), (1, 3e-3)):
        job, ranks = job_from_run_dir(RunDir(tmp_path / str(point)))
        summary = wait_for_job(job, RunDir(tmp_path / str(point)), ranks, timeout_s=300)
        assert summary["final_step"] == 4
        cfg = (tmp_path / str(point) / "hetseq_config.yaml").read_text()
        assert f"lr: {lr}" in cfg


@pytest.mark.slurm
@pytest.mark.slow
def test_requeue_checkpoints_and_resumes_exactly(tmp_path, token_cache):
    """USR2 (what Slurm sends signal_delay_s before the time limit) mid-run: the ranks
    checkpoint after the same step, rank 0 requeues the het job through its leader id, the job
    re-probes, re-agrees an allocation and resumes. The losses of the whole interrupted run equal
    an uninterrupted 1-rank local run step for step (exact global-batch semantics)."""
    run_dir = tmp_path / "het"
    steps = 30
    assert_ok(slurm_cli(run_dir, token_cache, *EXACT, f"trainer.max_steps={steps}"))
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    wait_rows(run_dir, 6)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)

    def requeued_job_done() -> bool:
        state = squeue_state(job_id)
        if state == "COMPLETED" and len(read_rows(run_dir)) == steps:
            return True
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT"), state
        if state == "PENDING":  # the test cluster's backfill only wakes on a change: poke it
            subprocess.run(
                ["scontrol", "update", f"jobid={job_id}", "comment=poke"], capture_output=True
            )
        return False

    wait_for(requeued_job_done, f"requeued job {job_id} done", poll_s=1)
    # scancel signals each het component's step in turn: a rank that caught USR2 first stops
    # every rank after that step (the agreed stop code), and rank 0 may requeue the job before
    # its own step's signal arrives (CI run 44, steps of ~50 ms): SOME rank caught it
    logs = {p.name: p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log"))}
    assert any("caught SIGUSR2" in text for text in logs.values()), list(logs)
    log0 = logs["rank0.log"]
    assert "on SIGUSR2 (time limit near, or preemption)" in log0, log0[-3000:]
    assert f"requeued job {job_id}" in log0, log0[-3000:]
    resumed_at = int(re.search(r"resumed from .*step_(\d+)\.pt", log0).group(1))
    assert 6 <= resumed_at < steps
    het = losses(run_dir)
    assert sorted(het) == list(range(1, steps + 1))
    ref_dir = tmp_path / "ref"
    ref = hetseq(
        *SMALL_MODEL,
        *EXACT,
        "cluster.ranks=1",
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={ref_dir}",
        token_cache=token_cache,
    )
    assert_ok(ref)
    want = losses(ref_dir)
    for step in range(1, steps + 1):
        assert abs(het[step] - want[step]) <= 1e-5 * abs(want[step]), (step, het[step], want[step])


@pytest.mark.slurm
@pytest.mark.slow
def test_cancelled_job_is_an_error_within_seconds(tmp_path, token_cache):
    proc = start_hetseq(
        "cluster=testcluster",
        *SMALL_MODEL,
        "cluster.wait=true",
        "trainer.max_steps=100000",
        "trainer.val_every=0",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
    )
    try:
        wait_rows(tmp_path, 2)
        job_id = json.loads((tmp_path / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", job_id], check=True)
        _, stderr = proc.communicate(timeout=120)  # a hang fails here (a guard, not a speed check)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    line = stderr.strip().splitlines()[-1]
    assert f"job {job_id} ended CANCELLED" in line, line


@pytest.mark.slurm
@pytest.mark.slow
def test_failing_rank_is_named_with_its_reason(tmp_path, token_cache):
    """Rank 2 fails on its own (the test task of fail_on_rank(2) raises in its load())."""
    proc = hetseq(
        "cluster=testcluster",
        *fail_on_rank(2),
        "cluster.wait=true",
        "trainer.max_steps=5",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
        timeout=300,
    )
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "rank 2 failed" in line and "injected failure on rank 2" in line, line


@pytest.mark.slurm
@pytest.mark.parametrize(
    "override, named",
    [
        (
            "cluster.partitions.a100.partition=h100",
            "cluster.partitions.a100.partition='h100' does not exist",
        ),
        ("cluster.partitions.a100.gpu_type=t4", "cluster.partitions.a100.gpu_type='t4'"),
        ("cluster.partitions.v100.nodes=3", "cluster.partitions.v100.nodes=3"),
        (
            "cluster.partitions.a100.cpus_per_rank=8",
            "cluster.partitions.a100.cpus_per_rank=8 needs 8 CPUs",
        ),
    ],
)
def test_presubmission_checks_submit_nothing(tmp_path, token_cache, override, named):
    """sinfo says the partition is missing, lacks the GRES type or the nodes: one line, exit 2,
    and no job reaches the queue."""
    before = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    proc = slurm_cli(tmp_path, token_cache, override)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("hetseq-hpc: error:") and named in line, line
    after = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    # only jobs that were not there before count: earlier tests' finished jobs leave squeue
    # MinJobAge (300 s) after they end, possibly during this test
    assert set(after) - set(before) == set(), "a job reached the queue"
    assert not (tmp_path / "job.json").exists()


@pytest.mark.slurm
@pytest.mark.slow
def test_run_dir_with_spaces_and_quotes_completes(tmp_path, token_cache):
    """A run directory (hence submitit folder) with a space and both quote characters: the
    #SBATCH --output/--error paths and the srun line are quoted, and the job runs to the end."""
    run_dir = tmp_path / 'my run\'s "dir"'
    quoted = str(run_dir).replace("\\", "\\\\").replace("'", "\\'")  # Hydra's grammar
    proc = hetseq(
        "cluster=testcluster",
        *SMALL_MODEL,
        "cluster.wait=true",
        "trainer.max_steps=3",
        "trainer.val_every=0",
        f"hydra.run.dir='{quoted}'",
        token_cache=token_cache,
    )
    assert_ok(proc)
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    assert (run_dir / "submitit" / f"{job_id}_batch.out").exists()


@pytest.mark.slurm
def test_worker_in_batch_script_without_srun_refuses_at_once(tmp_path, token_cache):
    """Started by the batch script itself (no srun): SLURM_JOB_ID is set, SLURM_STEP_ID is not,
    SLURM_NTASKS=3 -- the worker refuses in one line instead of waiting forever as rank 0."""
    run_dir = tmp_path / "run"
    assert_ok(slurm_cli(run_dir, token_cache, "cluster.dry_run=true", "trainer.max_steps=2"))
    out_file = tmp_path / "batch.out"
    wrap = " ".join(
        hetseq_cmd(
            "--config",
            str(run_dir / "hetseq_config.yaml"),
            "--run-dir",
            str(run_dir),
            module="hetseq_hpc.worker",
        )
    )
    job_id = sbatch_and_wait(
        [
            "--partition=v100",
            "--nodes=1",
            "--ntasks-per-node=1",
            "--ntasks=1",
            f"--output={out_file}",
            "--wrap",
            wrap,
        ],
        tmp_path,
        cli_env(token_cache),
        120,
    )
    assert squeue_state(job_id) == "FAILED"
    text = out_file.read_text()
    assert "SLURM_STEP_ID" in text and "launch it with srun" in text, text[-2000:]


@pytest.mark.slurm
def test_timeout_above_partition_max_time_submits_nothing(tmp_path, token_cache):
    """v100's MaxTime is 1 day (scripts/test-cluster.sh): 2000 minutes are refused before
    anything is submitted, by what the real sinfo reports."""
    limit = subprocess.run(
        ["sinfo", "-h", "-p", "v100", "-o", "%l"], capture_output=True, text=True
    ).stdout.split()
    if not limit or limit[0] in ("infinite", "UNLIMITED"):
        pytest.skip(
            "this test cluster's v100 has no MaxTime: it was started by an older "
            "scripts/test-cluster.sh; restart it"
        )
    before = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    proc = slurm_cli(tmp_path, token_cache, "cluster.timeout_min=2000")
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "cluster.timeout_min=2000 exceeds partition 'v100'" in line, line
    after = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    # only jobs that were not there before count: earlier tests' finished jobs leave squeue
    # MinJobAge (300 s) after they end, possibly during this test
    assert set(after) - set(before) == set(), "a job reached the queue"
    assert not (tmp_path / "job.json").exists()
