"""trainer.loggers in a real run: metrics.csv and TensorBoard event files next to metrics.jsonl,
read back with tensorboard's own EventAccumulator; a resume adds no step twice to any of them."""

from __future__ import annotations

import pytest

from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import checksum_path
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from tests.helpers.loggers import LOGGERS, csv_rows, events, scalar_steps
from tests.helpers.runs import read_rows


@pytest.mark.slow
def test_training_run_logs_to_tensorboard_and_csv_and_resumes_without_duplicates(tmp_path, run_cli):
    """2 ranks, 5 steps, checkpoints at 2 and 4; the step-5 checkpoint is then removed (as if
    the run died after logging step 5), and `hetseq-hpc hydra.run.dir=...` alone continues it
    from its saved configuration to step 6: every step once in jsonl, CSV and TensorBoard."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        run_dir,
        "cluster.ranks=2",
        "trainer.max_steps=5",
        "trainer.val_every=0",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=3",
        LOGGERS,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = events(run_dir)
    assert scalar_steps(acc, "train/loss") == [1, 2, 3, 4, 5]
    for rank in (0, 1):
        assert scalar_steps(acc, f"rank_step_time_s/rank{rank}") == [1, 2, 3, 4, 5]
        assert scalar_steps(acc, f"rank_compute_time_s/rank{rank}") == [1, 2, 3, 4, 5]
    last = CheckpointManager(RunDir(run_dir)).list()[-1]
    assert last.name == "step_00000005.pt"
    last.unlink()
    checksum_path(last).unlink()
    proc = run_cli(run_dir, "trainer.max_steps=6", small=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in csv_rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    acc = events(run_dir)
    assert scalar_steps(acc, "train/loss") == [1, 2, 3, 4, 5, 6]
    assert scalar_steps(acc, "rank_step_time_s/rank1") == [1, 2, 3, 4, 5, 6]
