"""In-job recovery under Slurm, in-process: a rank the others left out (``RankExcluded``) ends
quietly (exit 0, no error file, a log line) and the job is not reported failed; a rank that
fails by its own error still fails the job, which the client cancels (its step survives a
task's exit, so the others would go on); ``TooFewRanks`` is left to end by itself."""

from __future__ import annotations

import json
import logging

import pytest
from submitit.core import utils as submitit_utils

from hetseq_hpc.errors import LaunchError, RankExcluded
from hetseq_hpc.launch import slurm_watch
from hetseq_hpc.launch.slurm_watch import EXCLUDED_RESULT, is_excluded, wait_for_job
from hetseq_hpc.rundir.paths import RunDir
from tests.unit.test_slurm_faults import OWN, _Job, _job_function, _rank_left


def test_an_excluded_slurm_rank_ends_quietly(tmp_path, monkeypatch, caplog):
    import hetseq_hpc.worker as worker

    def left_out(run, run_dir):
        raise RankExcluded("rank 1 was lost to the others (no heartbeat for 3 s)")

    monkeypatch.setattr(worker, "run_worker", left_out)
    monkeypatch.setenv("SLURM_PROCID", "1")
    with caplog.at_level(logging.WARNING):
        result = _job_function(tmp_path)()  # returns: submitit records success, exit 0
    assert is_excluded(result) and result["rank"] == 1
    assert not (tmp_path / "logs" / "rank1.error.json").exists()
    assert any("was lost to the others" in r.getMessage() for r in caplog.records)


def _result(job_dir, rank, result):
    submitit_utils.cloudpickle_dump(
        ("success", result), job_dir / "submitit" / f"77_{rank}_result.pkl"
    )


@pytest.mark.parametrize("excluded", [0, 2])
def test_a_job_with_an_excluded_rank_returns_the_survivors_summary(job_dir, monkeypatch, excluded):
    cancels = []
    monkeypatch.setattr(slurm_watch, "cancel_job", cancels.append)
    survivors = [r for r in range(3) if r != excluded]
    for rank in survivors:
        _result(job_dir, rank, {"rank": rank, "lost_ranks": [excluded]})
    _result(job_dir, excluded, {EXCLUDED_RESULT: True, "rank": excluded})
    summary = wait_for_job(
        _Job(job_dir / "submitit", "COMPLETED"), RunDir(job_dir), 3, elastic=True
    )
    assert summary == {"rank": survivors[0], "lost_ranks": [excluded]} and cancels == []


def test_own_error_of_a_rank_cancels_an_elastic_job(job_dir, monkeypatch):
    cancels = []
    monkeypatch.setattr(slurm_watch, "cancel_job", cancels.append)
    _rank_left(job_dir, 1, OWN, 100.0, peer=False)
    with pytest.raises(LaunchError, match=r"rank 1 failed: .*DataError"):
        wait_for_job(_Job(job_dir / "submitit", "RUNNING"), RunDir(job_dir), 3, elastic=True)
    assert cancels == ["77"]


def test_too_few_ranks_is_left_to_end_by_itself(job_dir, monkeypatch):
    cancels = []
    monkeypatch.setattr(slurm_watch, "cancel_job", cancels.append)
    line = "hetseq_hpc.errors.TooFewRanks: only 1 rank(s) left after losing rank(s) [1, 2]"
    _rank_left(job_dir, 0, line, 100.0, peer=False)
    with pytest.raises(LaunchError, match="TooFewRanks"):
        wait_for_job(_Job(job_dir / "submitit", "RUNNING"), RunDir(job_dir), 3, elastic=True)
    assert cancels == []
    err = json.loads((job_dir / "logs" / "rank0.error.json").read_text())
    assert err["type"] == "TooFewRanks"


def test_the_current_rank_0_requeues_after_an_elastic_stop():
    """The job's original rank 0 may be the one lost: after too few survivors, the new world's
    rank 0 (``leader``) requeues and records the stop, whatever its SLURM_PROCID."""
    from hetseq_hpc.env.preemption import REQUEUE
    from hetseq_hpc.errors import Preempted

    plain = Preempted(9, REQUEUE, "USR2")
    assert plain.leads(0) and not plain.leads(2)
    assert Preempted(9, REQUEUE, "too few ranks", leader=True).leads(2)
    assert not Preempted(9, REQUEUE, "too few ranks", leader=False).leads(0)


def test_survivors_that_left_no_results_finished_by_their_summary(job_dir, caplog):
    """A stopped task left out: its survivors end with it when the batch script ends the step
    after the run's summary.json (no result pickles; Slurm records COMPLETED). The summary this
    job wrote is the result, and one line names the lost rank (it was '0/3 results', exit 1)."""
    before = slurm_watch.summary_stamp(RunDir(job_dir))  # taken before submitting: no summary yet
    (job_dir / "summary.json").write_text(json.dumps({"final_step": 30, "lost_ranks": [1]}))
    with caplog.at_level(logging.WARNING):
        summary = wait_for_job(
            _Job(job_dir / "submitit", "COMPLETED"),
            RunDir(job_dir),
            3,
            elastic=True,
            summary_before=before,
        )
    assert summary == {"final_step": 30, "lost_ranks": [1]}
    notes = [r.getMessage() for r in caplog.records if "were lost" in r.getMessage()]
    assert notes == [
        "job 77: rank(s) [1] were lost (killed, or stopped or hung and left out by the others); "
        f"the others finished the run without them: {job_dir / 'summary.json'}"
    ]


@pytest.mark.parametrize(
    "state, elastic, earlier",
    [
        ("COMPLETED", True, True),  # the summary was there before the job: not this job's
        ("CANCELLED", True, False),  # the job did not complete
        ("COMPLETED", False, False),  # no in-job recovery
    ],
)
def test_an_earlier_summary_or_an_ended_job_is_not_a_finished_run(job_dir, state, elastic, earlier):
    """Otherwise the error with the results counted, as before."""
    (job_dir / "summary.json").write_text(json.dumps({"final_step": 30, "lost_ranks": [1]}))
    before = slurm_watch.summary_stamp(RunDir(job_dir)) if earlier else -1
    with pytest.raises(LaunchError, match=rf"ended {state} before every rank finished \(0/3"):
        wait_for_job(
            _Job(job_dir / "submitit", state),
            RunDir(job_dir),
            3,
            elastic=elastic,
            summary_before=before,
        )


def test_survivors_results_after_a_lost_rank_name_it(job_dir, monkeypatch, caplog):
    """kill -9 of a task: the survivors return their summaries; the same one line names it."""
    monkeypatch.setattr(slurm_watch, "cancel_job", lambda job: None)
    for rank in (0, 2):
        _result(job_dir, rank, {"rank": rank, "lost_ranks": [1]})
    with caplog.at_level(logging.WARNING):
        wait_for_job(_Job(job_dir / "submitit", "COMPLETED"), RunDir(job_dir), 3, elastic=True)
    assert any("job 77: rank(s) [1] were lost" in r.getMessage() for r in caplog.records)
