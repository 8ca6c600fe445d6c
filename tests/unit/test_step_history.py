"""A run's step records in bounded memory (:class:`~hetseq_hpc.train.records.StepHistory`):
the summary of a long run is the one computed from every record, while only the last records
are held (synthetic records; no run)."""

from __future__ import annotations

import random

import pytest

from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.train.metrics.rows import run_summary
from hetseq_hpc.train.records import RankMeta, StepHistory, StepRecord


def _rec(step: int, rng: random.Random) -> StepRecord:
    per_rank = [
        StepStats(
            loss_sum=1.0,
            count=4,
            samples=s,
            step_time_s=0.1,
            data_time_s=0.0,
            compute_time_s=rng.uniform(0.05, 0.2),
        )
        for s in (5, 3)
    ]
    return StepRecord(
        step=step,
        epoch=0,
        loss=10.0 / step,
        lr=1e-3,
        grad_norm=1.0,
        per_rank=per_rank,
        wall_s=rng.uniform(0.1, 0.3),
    )


def test_a_long_run_holds_a_bounded_tail_and_sums_like_every_record():
    rng = random.Random(0)
    records = [_rec(s, rng) for s in range(1, 2501)]
    history = StepHistory(keep=100)
    for rec in records:
        history.append(rec)
        assert len(history) <= 200
    assert history[-1] is records[-1] and history.folded.count + len(history) == 2500
    metas = [RankMeta(rank=r, device="cpu", node="n") for r in range(2)]
    bounded = run_summary(history, metas, 8, 2500, None, [5, 3])
    whole = run_summary(records, metas, 8, 2500, None, [5, 3])
    assert bounded["steps_run"] == whole["steps_run"] == 2500
    assert bounded["first_loss"] == whole["first_loss"] == 10.0
    assert bounded["final_loss"] == whole["final_loss"]
    for key in ("samples_per_s", "steady_samples_per_s"):
        assert bounded[key] == pytest.approx(whole[key], rel=1e-12)
    for a, b in zip(bounded["ranks"], whole["ranks"]):
        assert a["samples"] == b["samples"]
        assert a["samples_per_compute_s"] == pytest.approx(b["samples_per_compute_s"], rel=1e-12)


def test_undo_and_reload_drop_the_held_records_past_a_step():
    rng = random.Random(1)
    history = StepHistory(keep=4)
    for s in range(1, 8):
        history.append(_rec(s, rng))
    assert history.pop().step == 7
    history.truncate(4)  # the reload of step 4's checkpoint: steps 5 and 6 are redone
    assert [r.step for r in history] == [1, 2, 3, 4] and history.folded.count == 0
