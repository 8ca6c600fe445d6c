"""trainer.loggers in-process: metrics.csv and TensorBoard event files next to metrics.jsonl,
read back with tensorboard's own EventAccumulator; a resume cuts every logger back to the
checkpoint. (A real 2-rank run that resumes without a duplicate step:
tests/integration/test_loggers_run.py.)"""

from __future__ import annotations

import logging

import pytest

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.metrics.loggers import RunLoggers
from tests.helpers.loggers import csv_rows, events, scalar_steps
from tests.helpers.runs import read_rows


def _row(step: int, loss: float, ranks: int = 2) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "samples_per_s": 100.0,
        "straggle": 0.1,
        "allocation": [8] * ranks,
        "ranks": [
            {
                "rank": r,
                "device": "cpu",
                "micro_batch": 8,
                "accum_steps": 1,
                "samples": 8,
                "step_time_s": 0.1 * (r + 1),
                "compute_time_s": 0.09,
            }
            for r in range(ranks)
        ],
    }


def test_resume_cuts_every_logger_back_to_the_checkpoint(tmp_path):
    """An attempt logged steps 1-6 but checkpointed at 3; the resumed attempt re-runs 4-6 (on 3
    ranks): each logger then holds steps 1-6 once, 4-6 with the new values."""
    first = RunLoggers(RunDir(tmp_path), ["csv", "tensorboard"])
    for step in range(1, 7):
        first.write(_row(step, 10.0 - step))
    first.close()
    second = RunLoggers(RunDir(tmp_path), ["jsonl", "csv", "tensorboard"], resume_step=3)
    for step in range(4, 7):
        second.write(
            {
                **_row(step, 100.0 + step, ranks=3),
                **(
                    {
                        "val_loss": 5.0,
                        "reallocation": {"from": [8, 8, 8], "to": [12, 6, 6], "at_step": 6},
                    }
                    if step == 5
                    else {}
                ),
            }
        )
    second.close()
    assert [r["step"] for r in read_rows(tmp_path)] == list(range(1, 7))
    rows = csv_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [float(r["loss"]) for r in rows] == [9, 8, 7, 104, 105, 106]
    assert rows[0]["rank2_step_time_s"] == "" and float(
        rows[4]["rank2_step_time_s"]
    ) == pytest.approx(0.3)
    acc = events(tmp_path)
    assert scalar_steps(acc, "train/loss") == list(range(1, 7))
    assert [e.value for e in acc.Scalars("train/loss")] == [9, 8, 7, 104, 105, 106]
    for rank in (0, 1):
        assert scalar_steps(acc, f"rank_step_time_s/rank{rank}") == list(range(1, 7))
    assert scalar_steps(acc, "rank_step_time_s/rank2") == [4, 5, 6]
    assert scalar_steps(acc, "val/loss") == [5]
    assert "reallocation/text_summary" in acc.Tags()["tensors"]


def test_resume_keeps_the_membership_row_of_survivors_that_stopped(tmp_path):
    """Survivors too few to go on (``trainer.elastic.min_ranks``) checkpoint step 3 and write a
    membership row for step 4, the step in progress, which records the stop; the requeued job
    resumes from step 3 and keeps that row (it was dropped as a row after the checkpoint), but
    not an in-job recovery's row of a step it trains again."""
    first = RunLoggers(RunDir(tmp_path), ["jsonl"])
    for step in range(1, 4):
        first.write(_row(step, 10.0 - step))
    stop = {
        "event": "membership",
        "step": 4,
        "lost": [{"rank": 1, "host": "n3"}],
        "world_size": 2,
        "stopped": "losing rank(s) [1] (2 left, fewer than trainer.elastic.min_ranks=3)",
    }
    first.write(stop)
    first.write(
        {
            "event": "membership",
            "step": 5,
            "lost": [{"rank": 2, "host": "n4"}],
            "world_size": 2,
            "split": [12, 12],
        }
    )
    first.close()
    second = RunLoggers(RunDir(tmp_path), ["jsonl"], resume_step=3)
    second.write(_row(4, 6.0, ranks=3))
    second.close()
    rows = read_rows(tmp_path)
    assert [r.get("event", r["step"]) for r in rows] == [1, 2, 3, "membership", 4]
    assert rows[3] == stop


def test_wandb_without_the_package_is_skipped_with_a_warning(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    if __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with caplog.at_level(logging.WARNING):
        loggers = RunLoggers(RunDir(tmp_path), ["jsonl", "wandb"])
    loggers.write(_row(1, 1.0))
    loggers.close()
    assert "wandb package is not installed" in caplog.text
    assert [r["step"] for r in read_rows(tmp_path)] == [1]


@pytest.mark.parametrize("value, match", [("[jsonl,foo]", "foo"), ("[]", None)])
def test_loggers_field_is_validated(value, match):
    if match is None:
        assert compose_run_config([f"trainer.loggers={value}"]).trainer.loggers == []
        return
    with pytest.raises(ConfigError, match=match):
        compose_run_config([f"trainer.loggers={value}"])
