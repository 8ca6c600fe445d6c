"""A row rank 0 owed when it was lost: rank 0 writes a step's row without a collective, so the
other ranks may already be in the checkpoint (or the next step) when it dies before writing it.
The new rank 0 writes that row after the recovery, once. Found by
tests/integration/test_elastic.py (victim 0), which kills rank 0 at a moment that sometimes
falls in this window; here the window is set up directly, without processes."""

from __future__ import annotations

from types import SimpleNamespace

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.metrics import read_metrics
from hetseq_hpc.train.metrics.step_log import StepLog
from hetseq_hpc.train.records import EVALUATED, LOGGED

RUN = compose_run_config(["task=bert", "trainer.max_steps=30", "trainer.log_every=1"])


def _log(run_dir, step: int, rank: int = 0) -> StepLog:
    """Rank ``rank``'s step log of a run continuing after ``step``."""
    return StepLog(RUN, RunDir(run_dir), step, rank, {})


def _recovered(log: StepLog, step: int, phase: int, rank: int = 0) -> None:
    """What the Trainer passes after a recovery agreed on ``step`` and ``phase``: the step's
    record (validated) and its row, owed when the survivors were past the row."""
    rec = SimpleNamespace(step=step, loss=4.5, extra={"val_loss": 4.75})
    row = {"step": step, "loss": 4.5, "run_id": "run-1", **rec.extra}
    log.recovered({"event": "membership", "step": step}, rank, step, phase >= LOGGED, (rec, row))


def _rows_before(run_dir, last: int) -> None:
    """Steps 1..last written by the rank 0 that is then lost."""
    earlier = _log(run_dir, last)
    for step in range(1, last + 1):
        earlier.writer.write({"step": step, "loss": 5.0, "run_id": "run-1"})
    earlier.close()


def _steps(run_dir):
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def test_the_new_rank0_writes_the_row_the_lost_one_owed_once(tmp_path):
    _rows_before(tmp_path, 10)
    log = _log(tmp_path, 11)  # the survivors were past step 11's row
    _recovered(log, 11, LOGGED)
    _recovered(log, 11, LOGGED)  # a second recovery: not repeated
    log.close()
    assert _steps(tmp_path) == list(range(1, 12))
    (row,) = [r for r in read_metrics(tmp_path) if r.get("step") == 11]
    assert row["val_loss"] == 4.75 and row["run_id"] == "run-1"


def test_a_row_already_written_is_not_repeated_and_other_ranks_write_nothing(tmp_path):
    _rows_before(tmp_path, 11)
    log = _log(tmp_path, 11)
    _recovered(log, 11, LOGGED)
    log.close()
    other = _log(tmp_path, 11, rank=1)
    _recovered(other, 11, LOGGED, rank=1)
    other.close()
    assert _steps(tmp_path) == list(range(1, 12))


def test_before_the_row_phase_the_row_is_left_to_the_redo(tmp_path):
    """Survivors that had not all passed the row redo it (``StepLog.log``, which checks the
    file)."""
    _rows_before(tmp_path, 10)
    log = _log(tmp_path, 11)
    _recovered(log, 11, EVALUATED)
    log.close()
    assert _steps(tmp_path) == list(range(1, 11)) and log.check_logged == 11
