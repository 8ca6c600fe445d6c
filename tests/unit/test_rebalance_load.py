"""Issue 43: the re-balancer tells a real change from a loaded host (synthetic timings fed to the
real Rebalancer on the loop's own schedule, ``Rebalancer.due``; no wall clock).

Load model (what ``--load 6`` beside two ranks on a 2-core VM looks like): every step both ranks
are slowed by a common factor that drifts between 2x and 5x (the busy loops' share of the
cores), each rank's step has its own heavy lognormal jitter (sigma 0.3-0.4) and, now and then,
a stall (a step that waited a scheduler slice). Seeds are fixed: the decisions are a pure
function of the tables."""

from __future__ import annotations

import math
import random
from typing import Callable, List, Sequence, Tuple

import pytest

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.balance.curves import CostCurve
from hetseq_hpc.balance.rebalance import Rebalancer
from tests.helpers.steps import timed_step

#: per-rank compute seconds of one step: (step, rank, samples, micro-batches, rng) -> seconds
Timing = Callable[[int, int, int, int, random.Random], float]


def loaded(sigma: float, seed: int) -> Callable[[int, random.Random], Tuple[float, float]]:
    """A host under load: ``(common factor, stall probability)`` per step (the factor drifts
    slowly between 2 and 5; ``sigma`` is used by the caller for each rank's own jitter)."""
    state = {"log": math.log(3.0)}
    rng = random.Random(seed + 101)

    def at(step: int, _: random.Random) -> Tuple[float, float]:
        state["log"] = min(math.log(5.0), max(math.log(2.0), state["log"] + rng.gauss(0, 0.1)))
        return math.exp(state["log"]), 0.05

    return at


def drive(
    timing: Timing,
    curves: Sequence[CostCurve],
    total: int,
    caps: Sequence[int],
    steps: int,
    every: int,
    seed: int,
    start: Sequence[int] | None = None,
) -> Tuple[List[List[int]], List[Tuple[int, List[int]]]]:
    """Run ``steps`` steps; returns (the split of every step, the moves as (step, split))."""
    rng = random.Random(seed)
    alloc = allocate(
        [c.samples_per_s(cap) for c, cap in zip(curves, caps)],
        total,
        list(caps),
        forced=list(start) if start is not None else None,
        curves=list(curves),
    )
    reb = Rebalancer(caps=list(caps), threshold=0.1, curves=list(curves))
    splits, moves = [], []
    for step in range(1, steps + 1):
        splits.append(list(alloc.samples))
        table = []
        for r, share in enumerate(alloc.shares):
            t = timing(step, r, share.samples, share.accum_steps, rng)
            table.append(timed_step(share.samples, t, 0.001 * rng.lognormvariate(0, 0.3)))
        reb.record(table)
        if reb.due(step, every, alloc):
            new = reb.observe(step, alloc)
            if new is not None:
                moves.append((step, list(new.samples)))
                alloc = new
    return splits, moves


A, C = 0.004, 0.006  # seconds per micro-batch and per sample of a free rank


def noisy_ranks(sigma: float, seed: int, slow: Callable[[int, int], float]) -> Timing:
    """Two ranks on a loaded host: ``slow(step, rank)`` is a rank's own slowdown."""
    host = loaded(sigma, seed)

    def timing(step: int, rank: int, samples: int, accum: int, rng: random.Random) -> float:
        common, stall = host(step, rng) if rank == 0 else (timing.common, timing.stall)
        timing.common, timing.stall = common, stall
        t = (accum * A + C * samples) * common * slow(step, rank) * rng.lognormvariate(0, sigma)
        return t * (3.0 if rng.random() < stall else 1.0)

    timing.common, timing.stall = 3.0, 0.05
    return timing


@pytest.mark.parametrize("seed", range(4))
def test_identical_ranks_on_a_loaded_host_keep_their_split(seed):
    """Sigma 0.35 per step and rank, the common drift and stalls: at most 5 moves per 1000
    steps, never more than 0.10 of the batch from even (a guard: the code before issue 43
    passed it too in simulation)."""
    curves = [CostCurve(A, C, 0.001)] * 2
    splits, moves = drive(
        noisy_ranks(0.35, seed, lambda s, r: 1.0), curves, 32, [32, 32], 1000, 10, seed
    )
    worst = max(abs(b[0] / 32 - 0.5) for b in splits)
    assert len(moves) <= 5, f"{len(moves)} re-allocations in 1000 loaded steps: {moves}"
    assert worst <= 0.10, f"a share moved {worst:.3f} of the global batch from even: {moves}"


def test_a_2x_change_on_a_heavily_loaded_host_is_acted_on_within_10_steps():
    """Rank 1 becomes twice as slow at step 300 (sigma 0.2 per step and rank, a common load
    factor drifting over 2-5x, 5 % stalls of 3x): over 20 seeds, the first move after the
    change gives rank 0 more within 10 steps in at least 18 (before issue 43: 16 -- the
    errors of short windows and an inflated noise estimate held the move back), and no run
    swings past even the other way."""
    curves = [CostCurve(A, C, 0.001)] * 2
    fast, late = 0, []
    for seed in range(20):
        splits, moves = drive(
            noisy_ranks(0.2, seed, lambda s, r: 2.0 if r == 1 and s > 300 else 1.0),
            curves,
            32,
            [32, 32],
            400,
            10,
            seed,
        )
        before = splits[300]
        after = [(step, b) for step, b in moves if step > 300]
        if after and after[0][0] <= 310 and after[0][1][1] < before[1]:
            fast += 1
        else:
            late.append((seed, moves))
        assert all(b[1] <= 16 for b in splits[320:]), f"seed {seed} swung back: {moves}"
    assert fast >= 18, f"acted on within 10 steps in {fast} of 20: {late}"


def throttled(seed: int, at: int) -> Timing:
    """Rank 1 is throttled to 0.05 CPU by a cgroup quota (5 ms per 100 ms period) from step
    ``at``, on a loaded host. A step of a few samples needs less CPU than one period's quota:
    most of the time it runs at full speed (it looks FAST), otherwise it waits for the next
    period (a fixed, noisy cost); a step of many samples runs 20x slower."""
    host = loaded(0.3, seed)

    def timing(step: int, rank: int, samples: int, accum: int, rng: random.Random) -> float:
        if rank == 0:
            timing.common = host(step, rng)[0]
        cpu = (accum * 0.001 + 0.0002 * samples) * timing.common * rng.lognormvariate(0, 0.3)
        if rank == 0 or step < at:
            return cpu
        if cpu < 0.005 and rng.random() < 0.95:  # fits the period's quota
            return cpu + rng.uniform(0, 0.003)
        return cpu * 20 + rng.uniform(0, 0.1)

    timing.common = 3.0
    return timing


def test_a_quota_throttled_rank_is_never_handed_the_batch_on_a_fixed_cost():
    """The Lightning run's swing, [32, 32] -> [42, 22] -> [63, 1] -> [1, 63]: at a few samples
    the throttled rank's time is no measure of its time at many (its quota covers a small
    step), and a curve scaled or fitted there must not make it look fast: the throttled rank
    never gets more than it had before the throttle, on any of 20 seeds."""
    curves = [CostCurve(0.001, 0.0002, 0.001)] * 2
    for seed in range(20):
        splits, moves = drive(throttled(seed, 3), curves, 64, [64, 64], 200, 4, seed, [32, 32])
        assert moves and moves[0][1][1] < 32, (seed, moves)
        assert all(b[1] <= 32 for b in splits[4:]), f"seed {seed}: {moves}"
