"""Faults around a local run, in-process: an optional logger (csv, tensorboard) that breaks
mid-run gives ONE warning naming its path and the fix and is dropped while ``metrics.jsonl``
goes on; a missing logger package and ``comm.grad_combine=adasum`` on a world size that is
not a power of two are configuration errors; a directory at a checkpoint's name is named with
the fix and never taken for a checkpoint. (Real runs and refused command lines:
tests/integration/test_run_faults.py.)
"""

from __future__ import annotations

import importlib.util
import logging
import shutil

import pytest

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config import validate as config_validate
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from hetseq_hpc.train.metrics.loggers import CSV_NAME, TB_DIR, RunLoggers
from tests.helpers.loggers import logger_warnings
from tests.helpers.runs import read_rows


def _row(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step,
        "lr": 1e-3,
        "samples_per_s": 10.0,
        "ranks": [
            {
                "rank": 0,
                "device": "cpu",
                "micro_batch": 4,
                "accum_steps": 1,
                "samples": 4,
                "step_time_s": 0.1,
                "compute_time_s": 0.1,
            }
        ],
    }


def _dir_becomes_a_file(loggers: RunLoggers, path) -> None:
    """Replace the TensorBoard folder by a file. Its writer's queue is flushed first, so no
    event is on its way into the folder while the tree is removed."""
    for sink in loggers.sinks:
        if getattr(sink, "name", "") == "tensorboard":
            sink.writer.flush()
    shutil.rmtree(path)
    path.write_text("x\n")


def test_loggers_that_break_mid_run_are_dropped_with_one_warning(tmp_path, caplog):
    """After step 1 ``metrics.csv`` becomes a directory and ``tb`` a file: the next write of
    each fails, each gives ONE warning and is dropped (also at close: no second word, no
    thread traceback), metrics.jsonl keeps every row."""
    loggers = RunLoggers(RunDir(tmp_path), ["jsonl", "csv", "tensorboard"])
    loggers.write(_row(1))
    (tmp_path / CSV_NAME).unlink()
    (tmp_path / CSV_NAME).mkdir()
    _dir_becomes_a_file(loggers, tmp_path / TB_DIR)
    with caplog.at_level(logging.WARNING):
        for step in range(2, 6):
            loggers.write(_row(step))
        loggers.close()
    assert [r["step"] for r in read_rows(tmp_path)] == [1, 2, 3, 4, 5]
    for path in (tmp_path / CSV_NAME, tmp_path / TB_DIR):
        assert len(logger_warnings(caplog.text, path)) == 1, caplog.text
    assert "Traceback" not in caplog.text


def test_missing_logger_package_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    missing = ("wandb", "tensorboard")
    monkeypatch.setattr(
        config_validate.importlib.util,
        "find_spec",
        lambda name, *a: None if name in missing else real(name, *a),
    )
    for loggers, name in (("[jsonl,csv,wandb]", "wandb"), ("[tensorboard]", "tensorboard")):
        with pytest.raises(
            ConfigError,
            match=f"has {name} but the {name} package is not installed here: pip install {name}",
        ):
            compose_run_config([f"trainer.loggers={loggers}"])
    assert compose_run_config(["trainer.loggers=[jsonl,csv]"]).trainer.loggers == ["jsonl", "csv"]


@pytest.mark.parametrize(
    "overrides, world",
    [
        (["cluster=testcluster"], 3),  # a100: 1 node x 1 GPU + v100: 2 nodes x 1 GPU
        (["cluster.ranks=6"], 6),
    ],
)
def test_adasum_world_size_is_checked_in_validation(overrides, world):
    with pytest.raises(ConfigError, match=f"this run plans {world}:"):
        compose_run_config([*overrides, "comm.grad_combine=adasum"])
    for ok in (["cluster.ranks=1"], ["cluster.ranks=4"]):
        assert compose_run_config([*ok, "comm.grad_combine=adasum"]).comm.grad_combine == "adasum"


# ------------------------------------------------------------------ checkpoint path in the way
def test_directory_at_a_checkpoint_name_is_named_with_the_fix(tmp_path):
    blocker = CheckpointManager(RunDir(tmp_path)).path(4)
    blocker.mkdir(parents=True)
    (blocker / "something").write_text("x\n")
    with pytest.raises(Exception) as info:
        CheckpointManager(RunDir(tmp_path), keep=2).write(
            {"model": {}, "optimizer": {}, "scheduler": {}}, 4
        )
    message = str(info.value)
    assert f"{str(blocker)!r} is a directory" in message and "remove or rename it" in message
    assert "free disk space" not in message
    assert CheckpointManager(RunDir(tmp_path)).list() == [], (
        "a directory is never taken for a checkpoint"
    )
