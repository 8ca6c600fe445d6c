"""The allocation at thousands of ranks (issue 45): the O(n log n) min-max split and the
heap-based largest-remainder rounding give exactly the split of the algorithms they replaced
(kept below, verbatim, as the reference) on random worlds of 1-64 ranks and on two worlds of
1,024, and the split of identical ranks (the common case at scale, quadratic before) takes a
linear number of step-time evaluations."""

from __future__ import annotations

import math
import random
from typing import List, Sequence

import pytest

from hetseq_hpc.balance.allocation import allocate, proportional_counts
from hetseq_hpc.balance.curves import CostCurve, min_max_split
from hetseq_hpc.errors import AllocationError


# ------------------------------------------------------------------ the former algorithms
def _former_count(curves, caps, budget_s) -> List[int]:
    return [max(1, curve.max_samples(budget_s, cap)) for curve, cap in zip(curves, caps)]


def former_min_max_split(curves: Sequence[CostCurve], total: int, caps: Sequence[int]) -> List[int]:
    """``min_max_split`` before issue 45 (bisection over every rank, then one sample at a time
    to the rank whose next sample ends earliest, found by a scan of all ranks)."""
    n = len(curves)
    lo = 0.0
    hi = max(curve.step_s(total, cap) for curve, cap in zip(curves, caps))
    if sum(_former_count(curves, caps, lo)) < total:
        for _ in range(200):
            mid = lo + (hi - lo) / 2
            if mid <= lo or mid >= hi:
                break
            if sum(_former_count(curves, caps, mid)) < total:
                lo = mid
            else:
                hi = mid
    counts = _former_count(curves, caps, lo)
    if sum(counts) > total:
        counts = [1] * n
    while sum(counts) < total:
        best = min(range(n), key=lambda i: (curves[i].step_s(counts[i] + 1, caps[i]), i))
        counts[best] += 1
    return counts


def former_proportional_counts(weights: Sequence[float], total: int, minimum: int = 1) -> List[int]:
    """``proportional_counts`` before issue 45 (checks left out: the inputs here are valid)."""
    n = len(weights)
    wsum = float(sum(weights))
    quota = [total * w / wsum for w in weights]
    counts = [max(minimum, math.floor(q)) for q in quota]
    left = total - sum(counts)
    order = sorted(range(n), key=lambda i: (-(quota[i] - counts[i]), i))
    for i in order[: max(left, 0)]:
        counts[i] += 1
    while left < 0:
        above = [i for i in range(n) if counts[i] > minimum]
        i = min(above, key=lambda j: (quota[j] - counts[j], -j))
        counts[i] -= 1
        left += 1
    return counts


# ------------------------------------------------------------------ random worlds
def _curve(rng: random.Random, kind: str) -> CostCurve:
    if kind == "identical":
        return CostCurve(0.01, 0.005, 0.02)
    if kind == "few speeds":  # exact ties between ranks of the same device
        return CostCurve(0.0, rng.choice([1e-3, 2e-3, 5e-3]), 0.0)
    if kind == "extreme":  # a per-sample time lost next to a large fixed cost
        return CostCurve(
            rng.choice([0.0, 0.01, 0.1]), rng.choice([1e-12, 1e-3]), rng.choice([0.0, 1.0, 100.0])
        )
    return CostCurve(
        rng.choice([0.0, rng.uniform(0, 0.05)]),
        10 ** rng.uniform(-5, -1),
        rng.choice([0.0, rng.uniform(0, 0.1)]),
    )


def random_world(rng: random.Random, n: int):
    """(curves, global batch, caps) of ``n`` ranks, one of four kinds of world."""
    kind = rng.choice(["identical", "few speeds", "extreme", "mixed", "mixed"])
    curves = [_curve(rng, kind) for _ in range(n)]
    caps = [rng.choice([1, 2, 8, rng.randint(1, 64), 1 << 20]) for _ in range(n)]
    total = rng.randint(n, n * rng.choice([1, 2, 4, 32, 128, 1000]))
    return curves, total, caps


def test_the_split_is_the_former_one_on_random_worlds():
    rng = random.Random(45)
    for _ in range(200):
        curves, total, caps = random_world(rng, rng.randint(1, 64))
        assert min_max_split(curves, total, caps) == former_min_max_split(curves, total, caps)


def test_a_few_ranks_in_python_split_as_numpy_does(monkeypatch):
    """Up to ``_FEW_RANKS`` ranks the split is found per rank in Python (numpy's cost per call
    dominated a re-balancing decision at 2 ranks): the same split as the numpy path on random
    worlds of 2-16 ranks, including caps of one sample and of 2^20."""
    from hetseq_hpc.balance import curves as curves_module

    rng = random.Random(16)
    worlds = [random_world(rng, rng.randint(2, 16)) for _ in range(300)]
    few = [min_max_split(*world) for world in worlds]
    monkeypatch.setattr(curves_module, "_FEW_RANKS", 0)  # every world through numpy
    assert few == [min_max_split(*world) for world in worlds]


@pytest.mark.parametrize("kind", ["identical", "mixed"])
def test_the_split_is_the_former_one_at_1024_ranks(kind):
    rng = random.Random(1024)
    curves = [_curve(rng, kind) for _ in range(1024)]
    caps = [rng.choice([8, 16, 32]) for _ in range(1024)]
    for total in (1024, 1031, 32 * 1024 + 512):
        assert min_max_split(curves, total, caps) == former_min_max_split(curves, total, caps)


def test_the_allocation_and_its_digest_are_the_former_ones():
    """What the ranks compare: the whole allocation, through ``allocate``."""
    rng = random.Random(4545)
    for _ in range(50):
        curves, total, caps = random_world(rng, rng.randint(1, 64))
        got = allocate([1.0] * len(caps), total, caps, curves=curves)
        assert got.samples == former_min_max_split(curves, total, caps)
        rates = [c.samples_per_s(cap) for c, cap in zip(curves, caps)]
        by_rate = allocate(rates, total, caps)
        assert by_rate.samples == former_proportional_counts(rates, total)


def test_the_rounding_is_the_former_one_on_random_weights():
    """Including the case the minimum takes too much (many ranks below one sample's quota),
    where samples are taken back one at a time."""
    rng = random.Random(7)
    for _ in range(1000):
        n = rng.randint(1, 64)
        if rng.random() < 0.7:
            weights = [10 ** rng.uniform(-3, 4) for _ in range(n)]
        else:
            weights = [rng.choice([1.0, 2.0, 1000.0]) for _ in range(n)]
        minimum = rng.choice([1, 1, 2, 3])
        total = minimum * n + rng.choice([0, 1, 5, n, 10 * n, 100 * n])
        got = proportional_counts(weights, total, minimum)
        assert got == former_proportional_counts(weights, total, minimum)
    skewed = [1e6] + [1.0] * 1023  # 1,023 ranks raised to one sample, 100 taken back
    assert proportional_counts(skewed, 1124) == former_proportional_counts(skewed, 1124)


def test_identical_ranks_take_a_linear_number_of_step_times(monkeypatch):
    """512 identical ranks and half a sample each left over: every rank's next sample ends at
    the same time, so the former split handed those 256 samples out by scanning all 512 ranks
    for each (131,072 step times); now a heap does it."""
    calls = []
    step_s = CostCurve.step_s

    def counted(self, samples, cap):
        calls.append(1)
        return step_s(self, samples, cap)

    monkeypatch.setattr(CostCurve, "step_s", counted)
    n = 512
    counts = min_max_split([CostCurve(0.01, 0.005, 0.02)] * n, 32 * n + n // 2, [32] * n)
    assert counts == [33] * (n // 2) + [32] * (n // 2)
    assert len(calls) <= 2 * n


def test_the_errors_are_unchanged():
    with pytest.raises(AllocationError, match=r"trainer\.global_batch_size"):
        min_max_split([CostCurve(0.0, 0.01)] * 3, 2, [8] * 3)
    with pytest.raises(AllocationError, match="rank 1 has a micro-batch cap of 0"):
        min_max_split([CostCurve(0.0, 0.01)] * 2, 8, [8, 0])
    assert min_max_split([CostCurve(0.0, 0.01)] * 3, 3, [1, 1, 1]) == [1, 1, 1]
