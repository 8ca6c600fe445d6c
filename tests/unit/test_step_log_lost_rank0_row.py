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


def _owed(step: int):
    """A step's record (validated) and its row, as the Trainer keeps them on every rank."""
    rec = SimpleNamespace(step=step, loss=4.5, extra={"val_loss": 4.75})
    return rec, {"step": step, "loss": 4.5, "run_id": "run-1", **rec.extra}


def _recovered(log: StepLog, step: int, phase: int, rank: int = 0, back: int = 1) -> None:
    """What the Trainer passes after a recovery agreed on ``step`` and ``phase``: the records
    and rows of the last ``back`` steps up to ``step``, owed when the survivors were past them."""
    owed = [_owed(s) for s in range(step - back + 1, step + 1)]
    log.recovered({"event": "membership", "step": step}, rank, step, phase >= LOGGED, owed)


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


def test_both_rows_a_rank0_reading_one_step_late_owed_are_written_in_order(tmp_path):
    """A step's loss is read during the next step, so rank 0 writes row 11 only after step 12
    trained everywhere: killed then, it owed rows 11 and 12 (found by
    tests/slurm/test_elastic_slurm.py, victim 0, in CI: row 11 was missing)."""
    _rows_before(tmp_path, 10)
    log = _log(tmp_path, 12)
    _recovered(log, 12, LOGGED, back=2)
    _recovered(log, 12, LOGGED, back=2)  # a second recovery: neither repeated
    log.close()
    assert _steps(tmp_path) == list(range(1, 13))


def test_the_step_before_is_written_even_when_its_own_row_is_redone(tmp_path):
    """Survivors before step 12's row redo it; row 11, owed one step late, is written now."""
    _rows_before(tmp_path, 10)
    log = _log(tmp_path, 12)
    _recovered(log, 12, EVALUATED, back=2)
    log.close()
    assert _steps(tmp_path) == list(range(1, 12)) and log.check_logged == 12


def test_before_the_row_phase_the_row_is_left_to_the_redo(tmp_path):
    """Survivors that had not all passed the row redo it (``StepLog.log``, which checks the
    file)."""
    _rows_before(tmp_path, 10)
    log = _log(tmp_path, 11)
    _recovered(log, 11, EVALUATED)
    log.close()
    assert _steps(tmp_path) == list(range(1, 11)) and log.check_logged == 11


def test_a_survivor_trainer_hands_the_new_rank0_the_last_two_rows(tmp_path, token_cache):
    """The Trainer side, in-process on one CPU rank: a rank that did not write (not rank 0)
    trains three steps read one step late, becomes rank 0 in a recovery, and writes rows 2
    and 3 with the losses its steps read (row 1 was the lost rank 0's)."""
    from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
    from tests.helpers.trainers import one_rank_trainer

    with single_process_rendezvous() as rdv:
        trainer = one_rank_trainer(
            tmp_path, rdv, token_cache, "trainer.max_steps=6", "trainer.log_every=1"
        )
        assert trainer.can_defer()
        trainer.step_log = StepLog(trainer.run, trainer.run_dir, 0, 1, {})  # rank 1's
        trainer.deferring = True
        for _ in range(3):
            trainer.advance()
        trainer.settle_pending(gather=False)  # as fit() does before a recovery
        trainer._recovered({"event": "membership", "step": 3})
        trainer.step_log.close()
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [2, 3]
    assert [r["loss"] for r in rows] == [rec.loss for rec in trainer.history[1:]]


def test_a_join_right_after_an_fsdp_reload_keeps_the_loss_row(tmp_path):
    """A rank lost at step 12 under FSDP: the survivors reload step 5 and redo step 6, whose
    completion writes the loss's membership row (``step`` 12: the step in progress when the
    rank was lost); a replacement admitted right after step 6 opens loggers there -- rank 0
    reopens its own, or the replacement takes rank 0's place and opens new ones -- and
    neither may drop that row (CI run 23: the replacement of a lost rank 0 dropped it)."""
    _rows_before(tmp_path, 5)
    log = _log(tmp_path, 5)
    lost = {"event": "membership", "step": 12, "lost": [{"rank": 1}], "lost_monotonic": 0.0}
    log.recovered(lost, 0, 5, True, [])
    log.writer.write({"step": 6, "loss": 5.0, "run_id": "run-1"})
    log.flush_events("run-1")
    joined = {"event": "membership", "step": 6, "joined": [{"rank": 1}], "lost_monotonic": 0.0}
    log.recovered(joined, 0, 6, True, [])  # rank 0 stays rank 0
    log.flush_events("run-1")
    log.close()
    # a replacement in rank 0's place opens its own loggers at step 6
    StepLog(RUN, RunDir(tmp_path), 6, 0, {}, joined=True).close()
    rows = [r for r in read_metrics(tmp_path) if r.get("event") == "membership"]
    assert [(r["step"], bool(r.get("joined"))) for r in rows] == [(12, False), (6, True)], rows
    assert _steps(tmp_path) == list(range(1, 7))
