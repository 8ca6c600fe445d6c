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
    summary = wait_for_job(_Job(job_dir / "submitit", "COMPLETED"), job_dir, 3, elastic=True)
    assert summary == {"rank": survivors[0], "lost_ranks": [excluded]} and cancels == []


def test_own_error_of_a_rank_cancels_an_elastic_job(job_dir, monkeypatch):
    cancels = []
    monkeypatch.setattr(slurm_watch, "cancel_job", cancels.append)
    _rank_left(job_dir, 1, OWN, 100.0, peer=False)
    with pytest.raises(LaunchError, match=r"rank 1 failed: .*DataError"):
        wait_for_job(_Job(job_dir / "submitit", "RUNNING"), job_dir, 3, elastic=True)
    assert cancels == ["77"]


def test_too_few_ranks_is_left_to_end_by_itself(job_dir, monkeypatch):
    cancels = []
    monkeypatch.setattr(slurm_watch, "cancel_job", cancels.append)
    line = "hetseq_hpc.errors.TooFewRanks: only 1 rank(s) left after losing rank(s) [1, 2]"
    _rank_left(job_dir, 0, line, 100.0, peer=False)
    with pytest.raises(LaunchError, match="TooFewRanks"):
        wait_for_job(_Job(job_dir / "submitit", "RUNNING"), job_dir, 3, elastic=True)
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
