"""A row rank 0 owed when it was lost: rank 0 writes a step's row without a collective, so the
other ranks may already be in the checkpoint (or the next step) when it dies before writing it.
The new rank 0 writes that row after the recovery, once. Found by
tests/integration/test_elastic.py (victim 0), which kills rank 0 at a moment that sometimes
falls in this window; here the window is set up directly, without processes."""

from __future__ import annotations

from types import SimpleNamespace

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.train.metrics import read_metrics
from hetseq_hpc.train.phases import StepPhases
from hetseq_hpc.train.records import EVALUATED, LOGGED


def _trainer(run_dir, step: int, phase: int, rank: int = 0):
    run = compose_run_config(["task=bert", "trainer.max_steps=30", "trainer.log_every=1"])
    rec = SimpleNamespace(step=step, loss=4.5, extra={"val_loss": 4.75})
    return SimpleNamespace(
        run=run,
        cfg=run.trainer,
        run_dir=run_dir,
        step=step,
        phase=phase,
        rank=rank,
        history=[rec],
        last_row={"step": step, "loss": 4.5},
        run_id="run-1",
        resume_note={},
        elastic=None,
        last_val={},
    )


def _rows_before(run_dir, last: int) -> None:
    """Steps 1..last written by the rank 0 that is then lost."""
    earlier = StepPhases(_trainer(run_dir, last, LOGGED))
    for step in range(1, last + 1):
        earlier.writer.write({"step": step, "loss": 5.0, "run_id": "run-1"})
    earlier.close()


def _steps(run_dir):
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def test_the_new_rank0_writes_the_row_the_lost_one_owed_once(tmp_path):
    _rows_before(tmp_path, 10)
    trainer = _trainer(tmp_path, 11, LOGGED)  # the survivors were past step 11's row
    phases = StepPhases(trainer)
    phases.recovered({"event": "membership", "step": 11})
    phases.recovered({"event": "membership", "step": 11})  # a second recovery: not repeated
    phases.close()
    assert _steps(tmp_path) == list(range(1, 12))
    (row,) = [r for r in read_metrics(tmp_path) if r.get("step") == 11]
    assert row["val_loss"] == 4.75 and row["run_id"] == "run-1"


def test_a_row_already_written_is_not_repeated_and_other_ranks_write_nothing(tmp_path):
    _rows_before(tmp_path, 11)
    phases = StepPhases(_trainer(tmp_path, 11, LOGGED))
    phases.recovered({"event": "membership", "step": 11})
    phases.close()
    other = StepPhases(_trainer(tmp_path, 11, LOGGED, rank=1))
    other.recovered({"event": "membership", "step": 11})
    other.close()
    assert _steps(tmp_path) == list(range(1, 12))


def test_before_the_row_phase_the_row_is_left_to_the_redo(tmp_path):
    """Survivors that had not all passed the row redo it (``_log``, which checks the file)."""
    _rows_before(tmp_path, 10)
    phases = StepPhases(_trainer(tmp_path, 11, EVALUATED))
    phases.recovered({"event": "membership", "step": 11})
    phases.close()
    assert _steps(tmp_path) == list(range(1, 11)) and phases.check_logged == 11
