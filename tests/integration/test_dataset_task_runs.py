"""``task=dataset`` mistakes end to end (real ranks): a MEAN ``loss_fn`` on two ranks is named
as the user wrote it and blamed on rank 0 without a second rank in brackets; a global batch
larger than the dataset is one line before calibration. Builds:
tests/helpers/odd_datasets.py; the same checks in-process: tests/unit/test_dataset_task_sizes.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TARGET = "task.target=tests.helpers.odd_datasets"


def _last(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_a_mean_loss_fn_on_two_ranks_names_the_loss_fn_and_rank_0(tmp_path, run_cli):
    proc = run_cli(
        tmp_path,
        "task=dataset",
        f"{TARGET}:build_mean",
        "cluster.ranks=2",
        "trainer.global_batch_size=16",
        "trainer.max_steps=2",
        small=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last(proc)
    assert last.startswith(
        "hetseq-hpc: error: rank 0 failed (TaskContractError: loss_fn "
        "tests.helpers.odd_datasets.mean_loss (from task.target="
    ), last
    assert "MEAN" in last and "(rank 0)" not in last and "found on rank" not in last, last


def test_a_global_batch_larger_than_the_dataset_is_refused_before_calibration(tmp_path, run_cli):
    proc = run_cli(
        tmp_path,
        "task=dataset",
        f"{TARGET}:build",
        "+task.args.n=4",
        "cluster.ranks=1",
        "trainer.global_batch_size=8",
        "trainer.max_steps=2",
        small=False,
    )
    assert proc.returncode != 0
    assert "trainer.global_batch_size=8 exceeds the 4 training samples: lower it" in _last(proc)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "calibration:" not in log and not (tmp_path / "allocation.json").exists(), log
