"""Exact global-batch semantics for every new task: image, translation and the example custom
tasks, char_lm and HetSeq's own BERT (BERT: tests/integration/test_training.py). Real worker
processes, real gloo, real data.

For each task, with dropout off and one seed, ``cluster.ranks=1`` (32 samples per step) is the
reference for 20 steps, and ``cluster.ranks=2 balance.allocation=[24,8]
balance.max_micro_batch=5`` runs steps 1-10, stops and is resumed for steps 11-20: every step
must log the reference loss within 1e-5 relative. Why that tolerance:
docs/design/exact-gradients.md, "How the exactness tests compare runs".
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import assert_same_losses, losses, read_rows, run_ok
from tests.helpers.tasks import METRIC, SUMMARY_NAME, task_overrides

pytestmark = pytest.mark.slow

STEPS = [
    "trainer.global_batch_size=32",
    "optim.schedule_steps=20",
    "trainer.checkpoint_every=10",
    "trainer.seed=7",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
]
UNEVEN = ["cluster.ranks=2", "balance.allocation=[24,8]", "balance.max_micro_batch=5"]


@pytest.mark.parametrize("name", ["image", "translation", "custom", "hetseq_bert"])
def test_uneven_ranks_and_resume_repeat_one_rank(name, tmp_path, token_cache, task_data_files):
    """1 rank x 32 == 2 ranks x [24, 8] at every one of 20 steps, across a stop at step 10 and
    a resume; the task's own metric and units reach metrics.jsonl and summary.json."""
    task = task_overrides(name, task_data_files)
    ref, uneven = tmp_path / "ref", tmp_path / "uneven"
    run_ok(ref, token_cache, *task, *STEPS, "cluster.ranks=1", "trainer.max_steps=20")
    run_ok(uneven, token_cache, *task, *STEPS, *UNEVEN, "trainer.max_steps=10")
    assert max(losses(uneven)) == 10
    run_ok(
        uneven, token_cache, *task, *STEPS, *UNEVEN, "trainer.max_steps=20", "trainer.resume=auto"
    )
    shares = json.loads((uneven / "allocation.json").read_text())["allocation"]["shares"]
    assert [s["samples"] for s in shares] == [24, 8]
    assert [s["accum_steps"] for s in shares] == [5, 2]
    resumed = losses(uneven)
    assert sorted(resumed) == list(range(1, 21))
    assert_same_losses(losses(ref), resumed, range(1, 21))
    assert "resumed from" in (uneven / "logs" / "rank0.log").read_text()
    rows = read_rows(ref)
    assert METRIC[name] in rows[-1] and rows[-1]["units_per_s"] > 0
    summary = json.loads((ref / "summary.json").read_text())
    assert METRIC[name] in summary["validation"]
    assert summary["task"]["name"] == SUMMARY_NAME[name] and summary["task"]["data"]
    assert summary["exact"] is True
