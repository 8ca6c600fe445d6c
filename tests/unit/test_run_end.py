"""The end of a run with in-job recovery (hetseq_hpc/train/recovery/run_end.py), in-process parts."""

from __future__ import annotations

import json

import pytest

from hetseq_hpc.env.rank_guard import FAILED
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.recovery.run_end import after_training, write_summary_if_missing


def test_summary_is_written_only_when_rank_0_did_not(tmp_path):
    summary = {"final_step": 30, "final_loss": 4.5, "by": "survivor"}
    assert write_summary_if_missing(RunDir(tmp_path), summary)  # none there: rank 0 was lost
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "by": "rank 0"}))
    assert not write_summary_if_missing(RunDir(tmp_path), summary)  # rank 0's is kept
    assert json.loads((tmp_path / "summary.json").read_text())["by"] == "rank 0"
    (tmp_path / "summary.json").write_text(json.dumps({"final_step": 12, "final_loss": 6.0}))
    assert write_summary_if_missing(RunDir(tmp_path), summary)  # an earlier run's: replaced
    (tmp_path / "summary.json").write_text("{cut off")
    assert write_summary_if_missing(RunDir(tmp_path), summary)


def test_only_a_peer_failure_with_in_job_recovery_is_absorbed(monkeypatch):
    def lost():
        raise RuntimeError("[gloo] Connection closed by peer")

    before = len(FAILED)
    assert after_training(object(), lost, "the final barrier", "lost") == "lost"
    assert len(FAILED) == before + 1  # kept: the rank ends without the teardown
    del FAILED[before:]
    with pytest.raises(RuntimeError):
        after_training(None, lost, "the final barrier", "lost")  # no recovery: as before

    def bad():
        raise ConfigError("a bug or bad input is never absorbed")

    with pytest.raises(ConfigError):
        after_training(object(), bad, "the final barrier", "lost")
    assert after_training(object(), lambda: 7, "x", None) == 7


@pytest.mark.parametrize(("leader", "kept"), [(True, True), (False, True), (None, False)])
def test_a_stop_after_a_lost_rank_ends_without_the_teardown(monkeypatch, tmp_path, leader, kept):
    """A survivor stopped because too few ranks were left (``leader`` set: an elastic world)
    still holds the broken world's DDP reducer and gloo group: it ends without the
    interpreter's teardown (kept in FAILED), which could abort it (SIGABRT, seen once in CI,
    after its checkpoint) and make the launcher name it lost too. A scheduler's stop
    (``leader`` None) tears down as before."""
    import hetseq_hpc.worker as worker
    from hetseq_hpc.env.preemption import REQUEUE
    from hetseq_hpc.errors import Preempted

    def stopped(run, run_dir):
        raise Preempted(11, REQUEUE, "losing rank(s) [1]", leader=leader)

    monkeypatch.setattr(worker, "watch_launcher", lambda: None)
    monkeypatch.setattr(worker, "load_run_config", lambda path: object())
    monkeypatch.setattr(worker, "run_worker", stopped)
    monkeypatch.setattr(worker, "handle_preempted", lambda exc, run: None)
    before = len(FAILED)
    try:
        assert worker.main(["--config", str(tmp_path / "config.yaml")]) == 3
        assert (len(FAILED) == before + 1) == kept
    finally:
        del FAILED[before:]
