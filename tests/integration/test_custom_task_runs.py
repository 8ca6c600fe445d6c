"""task=custom in real runs: a model with BatchNorm is refused before training, and accepted
with trainer.allow_inexact_batchnorm=true (recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runs import hetseq, read_rows


def _cli(tmp_path: Path, user_task_dir: Path, *overrides: str):
    return hetseq(
        "task=custom",
        "task.target=my_tasks.Regression",
        f"task.path={user_task_dir}",
        "cluster.ranks=1",
        "trainer.max_steps=3",
        "trainer.global_batch_size=16",
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        token_cache=tmp_path / "cache",
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.slow
def test_batchnorm_is_refused_in_one_line_before_training(tmp_path, user_task_dir):
    proc = _cli(tmp_path, user_task_dir, "+task.args.batchnorm=true")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "BatchNorm1d" in ln]
    assert lines and "'body.1' is BatchNorm1d" in lines[0]
    assert "trainer.allow_inexact_batchnorm=true" in lines[0] and "GroupNorm" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "no step may run"


@pytest.mark.slow
def test_batchnorm_opt_out_trains_and_records_inexactness(tmp_path, user_task_dir):
    proc = _cli(
        tmp_path, user_task_dir, "+task.args.batchnorm=true", "trainer.allow_inexact_batchnorm=true"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exact"] is False
    assert summary["inexact"]["batchnorm_layers"] == [["body.1", "BatchNorm1d"]]
    assert "NOT exact" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert [r["step"] for r in read_rows(tmp_path / "run")] == [1, 2, 3]
