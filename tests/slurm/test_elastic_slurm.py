"""A lost rank of a Slurm het job, survived in-job (``trainer.elastic``, issue 24), for real on
the project's test cluster: the batch script serves the job's store on the batch host, the
step runs with ``--kill-on-bad-exit=0 --no-kill``, and ``kill -9`` of one task's process leaves
the other two to finish every step with the uninterrupted trajectory (a 3-rank local run of the
same job: the trajectory does not depend on where the ranks run). No requeue happens, unless
the lost rank leaves fewer than ``trainer.elastic.min_ranks``: then the survivors checkpoint
and requeue the job, which resumes from that checkpoint, as after a preemption."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest

from hetseq_hpc.env.preemption import REQUEUE
from hetseq_hpc.launch.failures import STOP_RECORD
from tests.helpers.fault_tasks import fault_task
from tests.helpers.runs import (
    REPO,
    SMALL_MODEL,
    cli_env,
    hetseq,
    losses,
    read_rows,
    start_hetseq,
    step_rows,
)
from tests.helpers.slurm import rank_pid, squeue_state, task_pid
from tests.helpers.waits import wait_for

COMMON = [
    *SMALL_MODEL,
    "task.model.max_seq_len=32",
    "task.model.dropout=0.0",
    "trainer.global_batch_size=24",
    "trainer.max_steps=30",
    "optim.schedule_steps=30",
    "trainer.seed=5",
    "trainer.val_every=0",
    "trainer.checkpoint_every=0",
    "trainer.elastic.timeout_s=12",
]  # stale after 6 s: room for a loaded machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory, token_cache) -> Dict[int, float]:
    """step -> loss of an uninterrupted 3-rank local run of the same job."""
    ref = tmp_path_factory.mktemp("ref")
    done = hetseq(*COMMON, "cluster.ranks=3", f"hydra.run.dir={ref}", token_cache=token_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(ref)


def _ended(job: str) -> bool:
    """Whether Slurm's job ``job`` has ended (any final state)."""
    return squeue_state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_kill_9_one_task_of_a_het_job_and_it_finishes_the_same(
    sharding, tmp_path, token_cache, reference
):
    """DDP: the survivors go on from the interrupted step. FSDP: the lost task took its shard,
    so the survivors reload the step-5 checkpoint re-sharded over 2 ranks, in-job."""
    run_dir = tmp_path / "job"
    common = (
        list(COMMON)
        if sharding == "none"
        else [
            *(o for o in COMMON if not o.startswith("trainer.checkpoint_every=")),
            "sharding.mode=fsdp",
            "trainer.checkpoint_every=5",
            "trainer.keep_checkpoints=10",
        ]
    )
    proc = start_hetseq(
        "cluster=testcluster",
        "cluster.wait=true",
        *common,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
    )
    try:
        wait_for(lambda: step_rows(run_dir) >= 10, f"step 10 in {run_dir}", proc=proc)
        os.kill(rank_pid(run_dir / "submitit", 1), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        job = json.loads((run_dir / "job.json").read_text())["job_id"]
        if proc.returncode != 0:  # a finished job ends by itself (its state is checked below)
            subprocess.run(["scancel", str(job)], capture_output=True)
    assert proc.returncode == 0, stderr[-3000:]
    got, want = losses(run_dir), reference
    assert sorted(got) == list(range(1, 31))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= 1e-6, f"largest relative difference {worst:.2e}"
    (event,) = [r for r in read_rows(run_dir) if r.get("event") == "membership"]
    assert [x["rank"] for x in event["lost"]] == [1] and event["world_size"] == 2
    if sharding == "fsdp":
        assert event["reloaded"]["step"] >= 5 and event["reloaded"]["checkpoint"], event
    assert "SLURM_RESTART_COUNT" not in (run_dir / "logs" / "rank0.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["lost_ranks"] == [1]
    # the batch script ends after the results are in
    wait_for(lambda: _ended(str(job)), f"the end of job {job}", 120, poll_s=0.5)
    # srun failed (a task was lost), the run finished: Slurm records COMPLETED (afterok holds)
    assert squeue_state(str(job)) == "COMPLETED"


def _wait_for_step(run_dir: Path, job: str, step: int) -> None:
    """Wait until ``step`` steps are logged while the job is queued or running (300 s at most:
    a guard against hangs, not a speed check)."""

    def logged() -> bool:
        if step_rows(run_dir) >= step:
            return True
        assert squeue_state(job) in ("PENDING", "RUNNING"), squeue_state(job)
        return False

    wait_for(logged, f"step {step} in {run_dir}")


def _submit_by_hand(run_dir: Path, folder: Path, token_cache) -> str:
    """Write the run directory (``cluster.dry_run=true``) and submit ``slurm/hetjob.sbatch``
    for it with ``sbatch`` from ``folder`` (its log: ``folder/hetseq-<job>.out``); the job id."""
    done = hetseq(
        "cluster=testcluster",
        "cluster.dry_run=true",
        *COMMON,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(cli_env(token_cache), RUN_DIR=str(run_dir), PYTHON=sys.executable)
    out = subprocess.run(
        ["sbatch", "--parsable", str(REPO / "slurm" / "hetjob.sbatch")],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


@pytest.mark.slurm
@pytest.mark.slow
def test_the_handwritten_template_survives_a_lost_task_too(tmp_path, token_cache, reference):
    """slurm/hetjob.sbatch submitted by hand serves the job's store as the generated script does
    (ELASTIC=1, the default): ``kill -9`` of task 1 at step 10 and the job completes all 30
    steps on the uninterrupted trajectory."""
    run_dir = tmp_path / "job"
    job = _submit_by_hand(run_dir, tmp_path, token_cache)
    try:
        started = time.monotonic()  # 300 s for step 10, then what is left of 600 s to end
        _wait_for_step(run_dir, job, 10)
        os.kill(task_pid(run_dir, 1), signal.SIGKILL)
        wait_for(
            lambda: _ended(job),
            f"job {job} did not end",
            started + 600 - time.monotonic(),
            poll_s=1,
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    log = (tmp_path / f"hetseq-{job}.out").read_text()
    assert squeue_state(job) == "COMPLETED", log[-3000:]
    got, want = losses(run_dir), reference
    assert sorted(got) == list(range(1, 31))
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in want) <= 1e-6
    (event,) = [r for r in read_rows(run_dir) if r.get("event") == "membership"]
    assert [x["rank"] for x in event["lost"]] == [1] and event["world_size"] == 2
    assert "trainer.elastic: off" not in (run_dir / "logs" / "rank0.log").read_text()


def _poke_while_pending(job: str) -> None:
    """A requeued job waits for its EligibleTime, and the test cluster's backfill only wakes on
    a change (scripts/test-cluster.sh): touch the job while it is PENDING."""
    if squeue_state(job) == "PENDING":
        subprocess.run(["scontrol", "update", f"jobid={job}", "comment=poke"], capture_output=True)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_too_few_left_in_a_het_job_checkpoint_requeue_and_finish_the_same(
    victim, tmp_path, token_cache, reference
):
    """``trainer.elastic.min_ranks=3``: ``kill -9`` of one task after step 10 leaves too few,
    so the survivors' rank 0 (the original rank 1 when rank 0 is the one killed) checkpoints
    the last completed step, writes the membership row that says why it stopped and requeues
    the het job; the requeued job resumes from that checkpoint on 3 fresh ranks and finishes
    all 30 steps (exit 0) with the uninterrupted run's losses."""
    run_dir, err = tmp_path / "job", tmp_path / "cli.err"
    overrides = [
        o for o in COMMON if not o.startswith(("trainer.checkpoint_every=", "task.model."))
    ]
    # the victim kills itself as step 11 starts (tests/helpers/fault_tasks.py): a kill sent
    # from here after step 10 once landed after the last step (30 steps in about a second)
    fault = fault_task("KilledAtStepBert", die_rank=victim, die_step=11, marker=tmp_path / "killed")
    with err.open("w") as sink:  # a file: a pipe could fill up while the test polls
        proc = start_hetseq(
            "cluster=testcluster",
            "cluster.wait=true",
            *overrides,
            *fault,
            "++task.model.max_seq_len=32",
            "++task.model.dropout=0.0",
            "trainer.checkpoint_every=8",
            "trainer.keep_checkpoints=10",
            "trainer.elastic.min_ranks=3",
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=False,
        )
    job = ""
    try:
        wait_for(lambda: step_rows(run_dir) >= 10, f"step 10 in {run_dir}", proc=proc, output=err)
        job = json.loads((run_dir / "job.json").read_text())["job_id"]

        def ended() -> bool:
            if proc.poll() is not None:
                return True
            _poke_while_pending(job)
            return False

        # the requeued job waits for its EligibleTime too
        wait_for(ended, f"the end of job {job}", 600, poll_s=1)
        shown = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True
        ).stdout
    finally:
        if proc.poll() is None:
            proc.kill()
        if job:
            subprocess.run(["scancel", job], capture_output=True)
    assert proc.returncode == 0, err.read_text()[-3000:]
    # the survivors stopped after a checkpoint of their last completed step, and said why
    stop = json.loads((run_dir / STOP_RECORD).read_text())
    assert stop["job_id"] == job and stop["code"] == REQUEUE and stop["requeued"], stop
    assert stop["restarts"] == 0 and stop["step"] >= 10, stop
    step = stop["step"]
    assert (run_dir / "checkpoints" / f"step_{step:08d}.pt").is_file()
    rows = read_rows(run_dir)
    (at,) = [i for i, r in enumerate(rows) if r.get("event") == "membership"]
    event = rows[at]
    assert [x["rank"] for x in event["lost"]] == [victim] and event["world_size"] == 2, event
    assert "fewer than trainer.elastic.min_ranks=3" in event["stopped"], event
    assert [r["step"] for r in rows[:at]] == list(range(1, step + 1))
    # ... and the job was requeued by the survivors' rank 0, and resumed from that checkpoint
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank*.log")}
    leader = f"rank{1 if victim == 0 else 0}.log"
    assert f"checkpointing step {step} and stopping" in logs[leader]
    assert f"requeued job {job} (restart 1 of" in logs[leader]
    assert re.findall(r"Restarts=(\d+)", shown) and set(re.findall(r"Restarts=(\d+)", shown)) == {
        "1"
    }, shown
    assert re.search(rf"resumed from \S*step_{step:08d}\.pt at step {step} ", logs["rank0.log"])
    assert [r["step"] for r in rows[at + 1 :]] == list(range(step + 1, 31))
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 31))
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst <= 1e-6, f"largest relative difference {worst:.2e}"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_stopped_task_left_out_and_cluster_wait_exits_0_naming_it(tmp_path, token_cache):
    """SIGSTOP of task 1 at step 10 with ``cluster.wait=true``: the other two leave it out and
    finish all 30 steps. The stopped task holds the broken world's sockets, so the survivors
    do not return their results before the batch script ends the step after the run's
    summary.json; the job is COMPLETED and the launcher exits 0 with one line naming rank 1
    as lost (it exited 1 with "ended COMPLETED before every rank finished (0/3 results)")."""
    run_dir, err = tmp_path / "job", tmp_path / "cli.out"
    with err.open("w") as sink:  # a file: a pipe could fill up while the test polls
        proc = start_hetseq(
            "cluster=testcluster",
            "cluster.wait=true",
            *COMMON,
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
            stdout=sink,  # the launcher's log lines (Hydra's console) and rank 0's log
            stderr=subprocess.STDOUT,
            text=False,
        )
    stopped, job = 0, ""
    try:
        wait_for(lambda: step_rows(run_dir) >= 10, f"step 10 in {run_dir}", proc=proc, output=err)
        job = json.loads((run_dir / "job.json").read_text())["job_id"]
        stopped = rank_pid(run_dir / "submitit", 1)
        os.kill(stopped, signal.SIGSTOP)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        if job:
            subprocess.run(["scancel", str(job)], capture_output=True)
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    said = err.read_text()
    assert proc.returncode == 0, said[-3000:]
    notes = [ln for ln in said.splitlines() if f"job {job}: rank(s) [1] were lost" in ln]
    assert len(notes) == 1, said[-3000:]
    assert "the others finished the run without them" in notes[0], notes[0]
    assert sorted(losses(run_dir)) == list(range(1, 31))
    assert json.loads((run_dir / "summary.json").read_text())["lost_ranks"] == [1]
    assert squeue_state(str(job)) == "COMPLETED"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("script", ["generated", "handwritten"])
def test_a_stopped_task_does_not_hold_a_finished_job(script, tmp_path, token_cache, reference):
    """SIGSTOP of task 1 at step 10, submitted without ``cluster.wait`` (nobody watches the
    job): the other two leave it out and finish all 30 steps on the uninterrupted trajectory;
    the stopped task would hold srun, and so the job, until its time limit, so the batch script
    ends the step itself ``HETSEQ_END_GRACE_S`` (20) s after the run's summary.json appeared,
    and the job ends COMPLETED (``afterok`` chains go on)."""
    run_dir = tmp_path / "job"
    overrides = ["cluster=testcluster", *COMMON, f"hydra.run.dir={run_dir}"]
    if script == "generated":
        done = hetseq(*overrides, "cluster.wait=false", token_cache=token_cache, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        job = json.loads((run_dir / "job.json").read_text())["job_id"]
    else:
        job = _submit_by_hand(run_dir, tmp_path, token_cache)
    stopped = 0
    try:
        started = time.monotonic()  # 300 s for step 10, then what is left of 600 s to end
        _wait_for_step(run_dir, job, 10)
        stopped = (
            rank_pid(run_dir / "submitit", 1) if script == "generated" else task_pid(run_dir, 1)
        )
        os.kill(stopped, signal.SIGSTOP)
        wait_for(
            lambda: _ended(job), f"the end of job {job}", started + 600 - time.monotonic(), poll_s=1
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    logs = "".join(
        p.read_text(errors="replace")
        for p in [
            *tmp_path.glob(f"hetseq-{job}.out"),
            *(run_dir / "submitit").glob(f"{job}_batch.*"),
        ]
    )
    assert squeue_state(job) == "COMPLETED", logs[-3000:]
    assert (
        "a task was still running 20 s later (stopped or hung, left out of the run): "
        "ending the step" in logs
    ), logs[-3000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 31))
    assert max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference) <= 1e-6
    assert json.loads((run_dir / "summary.json").read_text())["lost_ranks"] == [1]


def _grow_back_job(tmp_path: Path, token_cache, *extra: str, on_step=None, victim: int = 1) -> Dict:
    """Run a testcluster job with ``trainer.elastic.restarts=1`` whose rank ``victim`` kills
    itself as step 11 starts (every rank holds at step 16 until its replacement asked to join); call
    ``on_step(run_dir, job)`` once step 5 is logged. Returns the run directory, the job id and
    the batch script's stderr (the supervisor's log)."""
    run_dir, err = tmp_path / "job", tmp_path / "cli.err"
    overrides = [
        o for o in COMMON if not o.startswith(("trainer.checkpoint_every=", "task.model."))
    ]
    fault = fault_task(
        "KilledThenHeldBert",
        die_rank=victim,
        die_step=11,
        hold_step=16,
        marker=tmp_path / "killed",
    )
    with err.open("w") as sink:  # a file: a pipe could fill up while the test polls
        proc = start_hetseq(
            "cluster=testcluster",
            "cluster.wait=true",
            *overrides,
            *fault,
            "++task.model.max_seq_len=32",
            "++task.model.dropout=0.0",
            "trainer.checkpoint_every=0",
            "trainer.elastic.restarts=1",
            *extra,
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=False,
        )
    job = ""
    try:
        wait_for(lambda: step_rows(run_dir) >= 5, f"step 5 in {run_dir}", proc=proc, output=err)
        job = json.loads((run_dir / "job.json").read_text())["job_id"]
        if on_step is not None:
            on_step(run_dir, job)
        wait_for(lambda: proc.poll() is not None, f"the end of job {job}", 600, poll_s=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        if job and proc.returncode != 0:  # a finished job ends by itself (checked after)
            subprocess.run(["scancel", job], capture_output=True)
    assert proc.returncode == 0, err.read_text()[-3000:]
    wait_for(lambda: _ended(job), f"the end of job {job}", 120, poll_s=0.5)
    batch = next((run_dir / "submitit").glob(f"{job}_batch.err")).read_text()
    return {"run_dir": run_dir, "job": job, "batch": batch}


def _assert_grown_back(
    done: Dict, reference: Dict[int, float], world: int, host: str, victim: int = 1
) -> None:
    """The run of :func:`_grow_back_job` lost rank ``victim`` and grew back to ``world`` ranks
    with a replacement on ``host``: every step once, the uninterrupted trajectory, a join row,
    and the launcher's summary (rank 0's result: the replacement's when rank 0 was lost)."""
    run_dir = done["run_dir"]
    rows = [r for r in read_rows(run_dir) if "loss" in r and r.get("event") is None]
    assert [r["step"] for r in rows] == list(range(1, 31))  # every step exactly once
    got = losses(run_dir)
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst <= 1e-6, f"largest relative difference {worst:.2e}"
    events = [r for r in read_rows(run_dir) if r.get("event") == "membership"]
    lost = next(e for e in events if e.get("lost"))
    joined = next(e for e in events if e.get("joined"))
    assert [x["rank"] for x in lost["lost"]] == [victim] and lost["world_size"] == world - 1
    assert [x["rank"] for x in joined["joined"]] == [victim] and joined["world_size"] == world
    assert joined["joined"][0]["host"] == host, joined
    assert joined["joined"][0]["member"] >= world and sum(joined["split"]) == 24
    assert len(rows[-1]["ranks"]) == world
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world and summary["lost_ranks"] == []
    assert f"on node {host}" in done["batch"], done["batch"][-3000:]
    assert squeue_state(done["job"]) == "COMPLETED"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(("victim", "node"), [(1, "n3"), (0, "n1")])
def test_a_lost_task_is_replaced_by_a_new_step_on_its_node_and_rejoins(
    victim, node, tmp_path, token_cache, reference
):
    """``trainer.elastic.restarts=1`` on Slurm: task ``victim`` of the 3-rank het job dies at
    step 11; the batch script's supervisor starts a new one-task step on its node
    (``srun --het-group=K --overlap``), the replacement asks to join, the survivors admit it
    and send it the training state: the job ends with 3 ranks on the uninterrupted
    trajectory, every step once, COMPLETED. Rank 0's replacement writes the run's summary
    and returns the result the launcher reports."""
    done = _grow_back_job(tmp_path, token_cache, victim=victim)
    _assert_grown_back(done, reference, 3, node, victim)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_lost_task_on_a_drained_node_rejoins_on_a_spare_node(tmp_path, token_cache, reference):
    """``trainer.elastic.spare_nodes=1``: each component reserves one more node than it runs
    on (a100: n1 + n2, v100: n3 + n4; 2 ranks). n3 is drained while the job runs, then its
    task dies at step 11: the replacement starts on the spare n4 and the job grows back to 2
    ranks on the uninterrupted trajectory (a 3-rank run's: the trajectory does not depend on
    the split)."""

    def drain(run_dir: Path, job: str) -> None:
        out = subprocess.run(
            ["scontrol", "update", "nodename=n3", "state=drain", "reason=hetseq-test"],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr

    try:
        done = _grow_back_job(
            tmp_path,
            token_cache,
            "cluster.partitions.v100.nodes=1",
            "trainer.elastic.spare_nodes=1",
            on_step=drain,
        )
    finally:
        subprocess.run(["scontrol", "update", "nodename=n3", "state=resume"], capture_output=True)
    _assert_grown_back(done, reference, 2, "n4")
    assert "a spare: n3 is not usable" in done["batch"]
