"""The online re-balancer on synthetic timing sequences: it converges, it does not oscillate,
and identical inputs give identical decisions (what lets every rank decide alone)."""

from __future__ import annotations

import random

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.balance.curves import CostCurve, min_max_split, predicted_step_s
from hetseq_hpc.balance.rebalance import Rebalancer
from hetseq_hpc.distributed.rendezvous import StepStats

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
        table = [
            StepStats(
                loss_sum=0.0,
                count=b,
                samples=b,
                step_time_s=0.0,
                data_time_s=0.0,
                compute_time_s=b * t * (1 + rng.uniform(-noise, noise)),
            )
            for b, t in zip(alloc.samples, truth)
        ]
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


def _table(samples, accum, truth, tail, rng, noise):
    return [
        StepStats(
            loss_sum=0.0,
            count=b,
            samples=b,
            step_time_s=0.0,
            data_time_s=0.0,
            compute_time_s=c.compute_s(b, k) * (1 + rng.uniform(-noise, noise)),
            tail_time_s=t,
        )
        for b, k, c, t in zip(samples, accum, truth, tail)
    ]


def test_step_change_is_corrected_in_one_move():
    """Cost curves with per-micro-batch overheads and per-step costs (synthetic StepStats):
    the slow rank gets twice as fast at step 40; the first decision after it moves as far as
    the evidence supports and a follow-up decision on more steps completes it (issue 27: a
    move is sized by the measurements' uncertainty), within two intervals of the change, to
    the new optimum; nothing moves afterwards."""
    caps = [32, 32]
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    faster = [truth[0], CostCurve(0.075, 0.015, 0.05)]
    rng = random.Random(5)
    reb = Rebalancer(caps=caps, threshold=0.1, curves=truth)
    alloc = allocate([1.0, 1.0], 128, caps, curves=truth)
    assert alloc.samples == min_max_split(truth, 128, caps)
    history = []
    for step in range(1, 101):
        now = truth if step < 40 else faster
        history.append(alloc.samples)
        reb.record(
            _table(
                alloc.samples,
                [s.accum_steps for s in alloc.shares],
                now,
                [c.step_fixed_s for c in now],
                rng,
                0.03,
            )
        )
        if reb.due(step, EVERY, alloc):  # the loop's schedule (Trainer.maybe_rebalance)
            new = reb.observe(step, alloc)
            if new is not None:
                alloc = new
    moves = _switches(history)
    assert 1 <= len(moves) <= 2, (moves, reb.decisions)
    assert 40 < moves[0] <= 40 + EVERY + 1 and moves[-1] <= 40 + 2 * EVERY + 1, moves
    target = min_max_split(faster, 128, caps)
    got = predicted_step_s(faster, history[-1], caps)
    assert got <= predicted_step_s(faster, target, caps) * 1.03, (history[-1], target)
    assert alloc.source == "rebalanced" and len(alloc.curves) == 2


def test_prior_curves_leave_a_good_split_alone():
    caps = [32, 32]
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    rng = random.Random(9)
    reb = Rebalancer(caps=caps, threshold=0.1, curves=truth)
    alloc = allocate([1.0, 1.0], 128, caps, curves=truth)
    for step in range(1, 61):
        reb.record(
            _table(
                alloc.samples,
                [s.accum_steps for s in alloc.shares],
                truth,
                [c.step_fixed_s for c in truth],
                rng,
                0.05,
            )
        )
        if step % EVERY == 0:
            assert reb.observe(step, alloc) is None


def test_a_short_burst_at_the_end_of_a_window_is_not_a_speed_change():
    """Two slow steps (a neighbour's burst) at the end of a 10-step window: the window's
    median decides and the good split stays; three in a row are a change and it moves."""
    caps = [32, 32]
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    alloc = allocate([1.0, 1.0], 128, caps, curves=truth)
    accum = [s.accum_steps for s in alloc.shares]

    def window(slow_steps):
        reb = Rebalancer(caps=caps, threshold=0.1, curves=truth)
        rng = random.Random(11)
        for step in range(1, 11):
            now = [truth[0].scaled(1.5), truth[1]] if step > 10 - slow_steps else truth
            reb.record(
                _table(alloc.samples, accum, now, [c.step_fixed_s for c in truth], rng, 0.02)
            )
        return reb.observe(10, alloc)

    assert window(2) is None
    moved = window(3)
    assert moved is not None and moved.samples[0] < alloc.samples[0]


def _run_with_urgent_checks(truth_at, steps, every, noise, seed):
    """Drive a re-balancer as the Trainer does: a decision every ``every`` steps or as soon as
    :meth:`Rebalancer.speed_changed` says so. Returns (allocation per step, decision steps)."""
    caps = [32, 32]
    prior = truth_at(1)
    rng = random.Random(seed)
    reb = Rebalancer(caps=caps, threshold=0.1, curves=prior)
    alloc = allocate([1.0, 1.0], 128, caps, curves=prior)
    history, decided = [], []
    for step in range(1, steps + 1):
        now = truth_at(step)
        history.append(alloc.samples)
        reb.record(
            _table(
                alloc.samples,
                [s.accum_steps for s in alloc.shares],
                now,
                [c.step_fixed_s for c in now],
                rng,
                noise,
            )
        )
        if step % every == 0 or reb.speed_changed(alloc):
            decided.append(step)
            new = reb.observe(step, alloc)
            if new is not None:
                alloc = new
    return history, decided


def test_a_speed_change_is_acted_on_before_the_next_interval():
    """The slow rank gets twice as fast at step 12 of 10-step intervals: the decision comes
    three steps later (not at step 20), moves once to the new optimum, and stays."""
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    faster = [truth[0], CostCurve(0.075, 0.015, 0.05)]
    history, decided = _run_with_urgent_checks(
        lambda s: truth if s < 12 else faster, 60, every=10, noise=0.03, seed=2
    )
    moves = _switches(history)
    assert moves == [15], (moves, decided)
    target = min_max_split(faster, 128, [32, 32])
    assert (
        predicted_step_s(faster, history[-1], [32, 32])
        <= predicted_step_s(faster, target, [32, 32]) * 1.03
    ), (history[-1], target)


def test_noise_inside_twice_the_threshold_never_forces_an_early_decision():
    """+-12 % step-to-step noise (the refits' own error adds a few %): decisions only at the
    intervals."""
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    for seed in range(10):
        _, decided = _run_with_urgent_checks(lambda s: truth, 200, every=10, noise=0.12, seed=seed)
        assert all(s % 10 == 0 for s in decided), (seed, decided)


def test_an_interval_right_after_an_early_decision_waits_for_three_steps():
    """A decision two steps after the previous one would rest on two steps, one of them an
    outlier (seen on the VM: one 291 ms step among ~190 ms ones moved a good 25/7 split to
    27/5): the window keeps filling, and three steps' median leaves the split alone."""
    caps = [32, 32]
    truth = [CostCurve(0.02, 0.01, 0.03), CostCurve(0.15, 0.03, 0.09)]
    alloc = allocate([1.0, 1.0], 128, caps, curves=truth)
    accum = [s.accum_steps for s in alloc.shares]
    tail = [c.step_fixed_s for c in truth]
    rng = random.Random(3)
    reb = Rebalancer(caps=caps, threshold=0.1, curves=truth)
    for _ in range(8):
        reb.record(_table(alloc.samples, accum, truth, tail, rng, 0.02))
    assert reb.observe(8, alloc) is None  # an early decision, nothing to change
    reb.record(_table(alloc.samples, accum, truth, tail, rng, 0.02))
    outlier = [truth[0], truth[1].scaled(1.5)]
    reb.record(_table(alloc.samples, accum, outlier, tail, rng, 0.0))
    assert reb.observe(10, alloc) is None, "two steps decided"
    assert reb.observe(11, alloc, _table(alloc.samples, accum, truth, tail, rng, 0.02)) is None
    assert reb.decisions == [], reb.decisions
