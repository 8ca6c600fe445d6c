"""A NaN loss on one rank of a real 2-rank run through the CLI (issue 40): the model of the
fault task (tests/helpers/fault_tasks.py, NanLossBert) returns NaN in micro-batch 2 of step 3
on rank 1 only. The run ends with one line (no traceback) naming the step, the rank and the
micro-batch, advising on the learning rate (two updates were applied), with the exit code of
errors.py, and a verified checkpoint of step 2 although ``trainer.checkpoint_every=0``.
(The advice at step 1 and the resume with a lower ``optim.lr``: tests/unit/test_nonfinite_loss.py.)
"""

from __future__ import annotations

import pytest

from hetseq_hpc.errors import NonFiniteLoss, exit_code
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.fault_tasks import fault_task
from tests.helpers.runs import read_rows

pytestmark = pytest.mark.slow


def test_a_nan_on_one_rank_ends_the_run_in_one_line_and_keeps_the_good_steps(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        run_dir,
        *fault_task("NanLossBert", nan_rank=1, nan_step=3, nan_micro=2),
        "++task.model.max_seq_len=32",
        "cluster.ranks=2",
        "trainer.global_batch_size=8",
        "balance.allocation=[4,4]",
        "balance.max_micro_batch=2",
        "trainer.max_steps=6",
        "optim.lr=0.001",
        "trainer.checkpoint_every=0",
        "trainer.val_every=0",
        "trainer.plot=false",
        small=False,
    )
    assert proc.returncode == exit_code(NonFiniteLoss("", 3)), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error: rank "), last
    assert "the loss is not finite at step 3: rank 1 (micro-batch 2, loss nan)" in last, last
    assert "rank 0 (" not in last.split("step 3:", 1)[1], last  # rank 0's loss was finite
    assert "after 2 update(s) the training diverged: lower optim.lr (now 0.001)" in last, last
    assert "checkpoint of step 2 written: after the fix, continue from it with" in last, last
    assert "trainer.resume=auto" in last, last
    (path,) = CheckpointManager(RunDir(run_dir)).list()
    assert load_checkpoint(path)["step"] == 2
    assert [r["step"] for r in read_rows(run_dir) if "loss" in r] == [1, 2]
