"""Issue 40: a finished run is recognised from its files, as the ranks would choose the
checkpoint (its run, its checksum), and said in one line; rewinding it in place is refused.
(The same with the real CLI: tests/integration/test_finished_run.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from hetseq_hpc.cli.preflight import refuse_rewinding_a_finished_run
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.history import write_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.finished import completed_run, finished_run
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from tests.helpers.checkpoints import plant_corrupt


def _state(step: int, run_id: str) -> dict:
    return {
        "model": {"w": torch.full((8,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "step": step,
        "run_id": run_id,
    }


def _finished_dir(tmp_path, final_step: int = 4, run_id: str = "r1"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_run_id(RunDir(tmp_path), run_id)
    for step in (final_step - 1, final_step):
        CheckpointManager(RunDir(tmp_path), keep=5).write(_state(step, run_id), step)
    rows = [{"step": s, "loss": 8.0 - s, "run_id": run_id} for s in range(1, final_step + 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"final_step": final_step, "final_loss": 3.25}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_a_finished_run_is_named_with_its_steps_loss_summary_and_the_way_on(tmp_path):
    run_dir = _finished_dir(tmp_path)
    for max_steps in (4, 2):  # the same steps, or fewer
        found = finished_run("auto", max_steps, RunDir(run_dir))
        assert found is not None and found.step == 4 and found.in_run_dir
        line = found.line()
        assert "\n" not in line
        assert line.startswith(f"{run_dir} is complete: 4 steps (trainer.max_steps={max_steps})")
        assert "final loss 3.2500" in line and f"summary {run_dir / 'summary.json'}" in line
        assert line.endswith(f"hydra.run.dir={run_dir} trainer.max_steps=<more than 4>")
    assert finished_run("auto", 5, RunDir(run_dir)) is None  # steps left: trained on
    assert finished_run("never", 4, RunDir(run_dir)) is None  # starting over is not resuming


def test_without_a_summary_of_that_step_the_loss_comes_from_the_metrics(tmp_path):
    run_dir = _finished_dir(tmp_path)
    # what an older version's re-run left: the last step, but no loss
    (run_dir / "summary.json").write_text(json.dumps({"final_step": 4, "final_loss": None}))
    found = finished_run("auto", 4, RunDir(run_dir))
    assert found.final_loss == 4.0 and found.summary == run_dir / "summary.json"
    (run_dir / "summary.json").unlink()  # ended after its last checkpoint, before the summary
    line = finished_run("auto", 4, RunDir(run_dir)).line()
    assert "final loss 4.0000" in line and "no summary.json of that step" in line


def test_only_the_checkpoint_the_ranks_would_resume_counts(tmp_path):
    run_dir = _finished_dir(tmp_path)
    plant_corrupt(run_dir, 4, 9)  # a corrupt later step: skipped, as the ranks skip it
    assert finished_run("auto", 9, RunDir(run_dir)) is None
    assert finished_run("auto", 4, RunDir(run_dir)).step == 4
    CheckpointManager(RunDir(run_dir), keep=5).write(
        _state(12, "another"), 12
    )  # another run's: never resumed
    assert finished_run("auto", 10, RunDir(run_dir)) is None


def test_a_resume_file_at_max_steps_has_nothing_to_train(tmp_path):
    source = _finished_dir(tmp_path / "a")
    path = source / "checkpoints" / "step_00000004.pt"
    found = finished_run(str(path), 4, RunDir(tmp_path / "b"))
    assert found is not None and not found.in_run_dir
    assert found.line().startswith(f"nothing to train: trainer.resume={path} is at step 4")
    assert finished_run(str(path), 5, RunDir(tmp_path / "b")) is None


def test_rewinding_a_complete_run_in_place_is_refused(tmp_path):
    """trainer.resume=<an older checkpoint> of a complete run would drop its rows after that
    step and overwrite its summary and checkpoints; of a run stopped early it is a resume."""
    run_dir = _finished_dir(tmp_path / "run")
    assert completed_run(RunDir(run_dir)).step == 4
    older = run_dir / "checkpoints" / "step_00000003.pt"
    rewind = compose_run_config([f"trainer.resume={older}", "trainer.max_steps=4"])
    with pytest.raises(CheckpointError) as err:
        refuse_rewinding_a_finished_run(rewind, RunDir(run_dir))
    line = str(err.value)
    assert "\n" not in line and "would train again from step 3" in line
    assert "complete at step 4" in line and f"cp -r {run_dir} <new dir>" in line
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    for fine in (f"trainer.resume={newest}", "trainer.resume=auto", "trainer.resume=never"):
        refuse_rewinding_a_finished_run(compose_run_config([fine]), RunDir(run_dir))
    (run_dir / "summary.json").unlink()  # stopped after its last checkpoint: not complete
    assert completed_run(RunDir(run_dir)) is None
    refuse_rewinding_a_finished_run(rewind, RunDir(run_dir))
