"""FSDP gradient accumulation with the parameters kept gathered between micro-batches
(issue 22, ``sharding.between_micro_batches``, :mod:`hetseq_hpc.train.fsdp_accumulation`)
keeps the exact global-batch update: real worker processes, real gloo (FSDP2 on CPU).

``cluster.ranks=1`` (DDP, 32 samples per step, 20 steps, dropout off) is the reference. Two
FSDP runs on 2 ranks at ``[24, 8]`` with ``balance.max_micro_batch=5`` (5 and 2 passes, evened
out to 5 passes on each rank, the small rank padding with zero-weight passes) and activation
checkpointing must log its loss at every step (1e-5 relative):

- ``auto``: the small BERT's whole weights fit beside each rank's shard and micro-batch in its
  memory budget (its share of this machine's RAM), so every unit is all-gathered once per step
  and resharded after the last backward (``keep_unsharded``);
- ``reshard``: gathered again in every forward and backward, as before issue 22.

Both say which in ``summary.json`` (``sharding.between_micro_batches``) and in rank 0's log.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import SMALL_MODEL, assert_ok, assert_same_losses, losses

pytestmark = pytest.mark.slow

STEPS = [
    "trainer.global_batch_size=32",
    "optim.schedule_steps=20",
    "trainer.checkpoint_every=0",
    "trainer.seed=7",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.max_steps=20",
    "task.model.max_seq_len=32",
]
FSDP_ACCUMULATING = [
    "sharding.mode=fsdp",
    "cluster.ranks=2",
    "balance.allocation=[24,8]",
    "balance.max_micro_batch=5",
    "sharding.activation_checkpointing=true",
]


def test_fsdp_accumulation_kept_gathered_or_resharded_logs_the_one_rank_loss(tmp_path, run_cli):
    ref = tmp_path / "ref"
    assert_ok(run_cli(ref, *SMALL_MODEL, *STEPS, "cluster.ranks=1", small=False))
    reference = losses(ref)
    assert sorted(reference) == list(range(1, 21))
    runs = {}
    for setting, expected in (("auto", "keep_unsharded"), ("reshard", "reshard")):
        run = tmp_path / setting
        assert_ok(
            run_cli(
                run,
                *SMALL_MODEL,
                *STEPS,
                *FSDP_ACCUMULATING,
                f"sharding.between_micro_batches={setting}",
                small=False,
            )
        )
        summary = json.loads((run / "summary.json").read_text())
        assert summary["sharding"]["mode"] == "fsdp"
        assert summary["sharding"]["between_micro_batches"] == expected
        assert summary["exact"] is True
        log = (run / "logs" / "rank0.log").read_text()
        if setting == "auto":
            assert (
                "sharding.between_micro_batches=auto -> keep_unsharded, 5 passes per step" in log
            ), log[-3000:]
        runs[setting] = losses(run)
        assert_same_losses(reference, runs[setting], range(1, 21))
    # the same weights are gathered either way: the same computation
    assert_same_losses(runs["reshard"], runs["auto"], range(1, 21))
