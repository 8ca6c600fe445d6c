"""The online re-balancer on synthetic timing sequences: it converges, it does not oscillate,
and identical inputs give identical decisions (what lets every rank decide alone)."""

from __future__ import annotations

import random

from hetseq_hpc.allocation import allocate
from hetseq_hpc.distributed import StepStats
from hetseq_hpc.train.rebalance import Rebalancer

B = 32
EVERY = 5


def simulate(per_sample_s, steps, noise=0.05, start=(16, 16), change=None, seed=0):
    """Feed a re-balancer ``steps`` steps of synthetic compute times
    ``b_i * per_sample_s[i] * (1 +- noise)``; ``change=(step, new per_sample_s)``.
    Returns (allocation per step, rebalancer)."""
    rng = random.Random(seed)
    n = len(per_sample_s)
    reb = Rebalancer(caps=[64] * n, threshold=0.1)
    alloc = allocate([1.0] * n, B, [64] * n, forced=list(start))
    history = []
    truth = list(per_sample_s)
    for step in range(1, steps + 1):
        if change and step == change[0]:
            truth = list(change[1])
        history.append(alloc.samples)
        table = [StepStats(loss_sum=0.0, count=b, samples=b, step_time_s=0.0, data_time_s=0.0,
                           compute_time_s=b * t * (1 + rng.uniform(-noise, noise)))
                 for b, t in zip(alloc.samples, truth)]
        reb.record(table)
        if step % EVERY == 0:
            new = reb.observe(step, alloc)
            if new is not None:
                alloc = new
    return history, reb


def _switches(history):
    return [i + 1 for i in range(1, len(history)) if history[i] != history[i - 1]]


def test_converges_to_the_throughput_split():
    history, _ = simulate([0.01, 0.01 / 0.35], 100)
    assert history[-1] in ([24, 8], [23, 9]), history[-1]
    assert _switches(history)[0] <= 3 * EVERY + 1, "first move within three windows"


def test_does_not_oscillate_under_noise():
    history, _ = simulate([0.01, 0.01 / 0.35], 400, noise=0.05)
    late = [s for s in _switches(history) if s > 50]
    assert late == [], f"moves after convergence: {late}"
    assert len(_switches(history)) <= 2


def test_balanced_ranks_are_left_alone():
    history, reb = simulate([0.01, 0.01], 200, noise=0.05, start=(16, 16))
    assert _switches(history) == [] and reb.decisions == []


def test_follows_a_speed_change():
    history, _ = simulate([0.01, 0.01 / 0.35], 300, change=(120, [0.01, 0.01 / 0.7]))
    assert history[119] in ([24, 8], [23, 9])
    assert history[-1] in ([19, 13], [18, 14], [20, 12]), history[-1]
    moved_after = [s for s in _switches(history) if s > 120]
    assert moved_after and moved_after[0] <= 120 + 4 * EVERY


def test_three_ranks_and_determinism():
    a, _ = simulate([0.01, 0.02, 0.04], 200, start=(11, 11, 10), seed=3)
    b, _ = simulate([0.01, 0.02, 0.04], 200, start=(11, 11, 10), seed=3)
    assert a == b
    assert a[-1] in ([18, 9, 5], [19, 9, 4], [18, 10, 4], [19, 8, 5]), a[-1]
