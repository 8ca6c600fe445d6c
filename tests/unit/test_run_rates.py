"""The rates summary.json reports: the steady state after the warm-up, and MFU against the
ranks' datasheet peaks (synthetic step records; no run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.train.metrics.rows import run_summary
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.worker import steady_mfu


def _rec(step: int, wall: float) -> SimpleNamespace:
    return SimpleNamespace(
        step=step, loss=1.0, wall_s=wall, per_rank=[StepStats(1.0, 4, 8, wall, wall, 0.0)]
    )


def test_the_steady_rate_leaves_the_warm_up_out_and_mfu_needs_a_known_peak():
    history = [_rec(1, 4.0), _rec(2, 1.0), _rec(3, 1.0), *(_rec(s, 0.5) for s in range(4, 9))]
    meta = RankMeta(rank=0, device="cpu", node="n")
    out = run_summary(history, [meta], 8, 8, None, [8])
    assert out["steady_samples_per_s"] == pytest.approx(16.0)  # 8 samples / 0.5 s
    assert out["samples_per_s"] == pytest.approx(8 * 8 / 8.5)  # every step, warm-up included
    assert out["steady_after_steps"] == 3
    summary = {**out, "task": {"flops_per_sample": 1e12}}
    assert steady_mfu(summary, [meta]) is None  # a CPU has no datasheet peak
    h100 = RankMeta(rank=0, device="NVIDIA H100 80GB HBM3", node="n", precision="bf16")
    assert steady_mfu(summary, [h100]) == pytest.approx(16.0 * 1e12 / 989.42976e12, rel=1e-3)
