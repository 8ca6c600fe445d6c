"""FSDP in-job recovery: the survivors' micro-batch caps follow their larger shards (issue 24).

A lost FSDP rank leaves its shard of the state to the survivors (``1 / world`` grows), so the
start-up caps, computed for the smaller shard, would overrun the budget. The split after a loss
uses caps recomputed from the same calibration (budget, activation bytes per sample) with the new
state; they only ever go down.
"""

from __future__ import annotations

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.memory import micro_batch_cap, model_state_bytes
from hetseq_hpc.train.recovery.sharded import reports_for_world
from tests.helpers.reports import rank_report

MIB = 2**20


def _report(rank: int, budget: float, per_sample: float, static: float, limit=None) -> RankReport:
    cap = micro_batch_cap(budget, static, per_sample, limit)
    return rank_report(
        rank,
        3,
        memory_budget_bytes=budget,
        activation_bytes_per_sample=per_sample,
        static_bytes=static,
        max_micro_batch=cap,
    )


def test_caps_shrink_by_what_the_larger_shard_takes():
    param = 300 * MIB  # sharded state 4 x 300 MiB / world, plus what FSDP holds gathered

    def state(world):
        return model_state_bytes(param, "fsdp", world, block_bytes=20 * MIB, root_bytes=30 * MIB)

    budget, per_sample = 1200 * MIB, 10 * MIB
    before = [_report(r, budget, per_sample, state(3)) for r in range(3)]
    after = reports_for_world(before[:2], state(2), None)
    for old, new in zip(before, after):
        assert new.calibration.static_bytes == state(2) > old.calibration.static_bytes
        expected = int((budget - state(2)) // per_sample)
        assert new.calibration.max_micro_batch == expected < old.calibration.max_micro_batch
        assert old.calibration.static_bytes == state(3)  # the start-up report is unchanged


def test_caps_never_grow_and_keep_the_configured_limit():
    small = _report(0, 1000 * MIB, 10 * MIB, 500 * MIB, limit=8)
    (same,) = reports_for_world([small], 100 * MIB, 8)  # less state (offload): not raised
    assert same.calibration.max_micro_batch == 8
    (tight,) = reports_for_world([_report(0, 1000 * MIB, 10 * MIB, 500 * MIB)], 995 * MIB)
    assert tight.calibration.max_micro_batch == 0  # the split refuses: checkpoint + requeue
