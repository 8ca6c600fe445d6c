"""Properties of the batch allocation: seeded random loops (no hypothesis dependency)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from hetseq_hpc.balance.agree import RankReport
from hetseq_hpc.balance.allocation import (
    Allocation,
    RankShare,
    allocate,
    equal_split,
    proportional_counts,
    shares_for,
)
from hetseq_hpc.balance.curves import CostCurve, min_max_split, predicted_step_s
from hetseq_hpc.balance.memory import micro_batch_cap
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.errors import AllocationError
from tests.helpers.reports import rank_report

GiB = 1024**3


def random_case(rng: random.Random):
    """(throughputs, global batch, micro-batch caps) with world 1..16 and B >= world."""
    n = rng.randint(1, 16)
    batch = rng.randint(n, n * rng.choice([1, 2, 8, 64]))
    # log-uniform over five decades: from a crawling CPU rank to a fast GPU
    throughputs = [10 ** rng.uniform(-2, 3) for _ in range(n)]
    if rng.random() < 0.2:  # exact ties
        throughputs = [rng.choice([1.0, 2.0, 3.0]) for _ in range(n)]
    caps = [rng.randint(1, 64) for _ in range(n)]
    return throughputs, batch, caps


def check_allocation(alloc: Allocation, batch: int, caps) -> None:
    assert sum(alloc.samples) == batch
    assert len(alloc.shares) == len(caps)
    offsets = alloc.offsets()
    assert offsets[0] == 0
    for i, share in enumerate(alloc.shares):
        assert share.rank == i
        assert share.samples >= 1
        assert share.max_micro_batch == caps[i]
        assert 1 <= share.micro_batch <= caps[i]
        assert share.accum_steps >= 1
        assert share.micro_batch * share.accum_steps >= share.samples
        # no wasted accumulation step: one fewer would not be enough
        assert share.micro_batch * (share.accum_steps - 1) < share.samples
        sizes = share.micro_sizes
        assert len(sizes) == share.accum_steps
        assert sum(sizes) == share.samples
        assert max(sizes) <= share.micro_batch
        assert max(sizes) - min(sizes) <= 1
        assert min(sizes) >= 1
        if i > 0:
            assert offsets[i] == offsets[i - 1] + alloc.shares[i - 1].samples


# --------------------------------------------------------------------------- random properties
def test_random_allocations_sum_to_batch_and_respect_caps():
    rng = random.Random(20240521)
    for _ in range(2000):
        throughputs, batch, caps = random_case(rng)
        alloc = allocate(throughputs, batch, caps)
        assert alloc.source == "throughput"
        assert alloc.throughputs == tuple(throughputs)
        check_allocation(alloc, batch, caps)


def test_random_proportional_counts_are_quotas_rounded():
    """Counts sum to the total, respect the minimum, follow the weights' order and stay
    close to the exact quotas."""
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 16)
        minimum = rng.choice([0, 1, 1, 2])
        total = rng.randint(max(minimum * n, 1), 5000)
        weights = [10 ** rng.uniform(-3, 3) for _ in range(n)]
        counts = proportional_counts(weights, total, minimum=minimum)
        assert sum(counts) == total
        assert all(c >= minimum for c in counts)
        wsum = sum(weights)
        for c, w in zip(counts, weights):
            # the exact share, off by at most the reserved minimum samples plus rounding
            quota = total * w / wsum
            assert abs(c - quota) <= minimum * n + 1
        for i in range(n):
            for j in range(n):
                if weights[i] > weights[j]:
                    assert counts[i] >= counts[j]


def test_random_shares_for_respects_caps():
    rng = random.Random(99)
    for _ in range(2000):
        n = rng.randint(1, 8)
        samples = [rng.randint(1, 500) for _ in range(n)]
        caps = [rng.randint(1, 128) for _ in range(n)]
        shares = shares_for(samples, caps)
        for share, b, cap in zip(shares, samples, caps):
            assert share.samples == b
            assert share.micro_batch <= cap
            assert share.accum_steps == max(1, math.ceil(b / cap))
            assert share.micro_batch * share.accum_steps >= b
            assert sum(share.micro_sizes) == b


def test_random_equal_split_is_balanced():
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(1, 16)
        batch = rng.randint(n, 1000)
        caps = [rng.randint(1, 64) for _ in range(n)]
        alloc = equal_split(n, batch, caps)
        assert alloc.source == "equal"
        check_allocation(alloc, batch, caps)
        samples = alloc.samples
        assert max(samples) - min(samples) <= 1
        assert samples == sorted(samples, reverse=True)  # the remainder goes to low ranks


# --------------------------------------------------------------------------- fixed examples
@pytest.mark.parametrize(
    "weights, total, expected",
    [
        pytest.param([3, 1], 32, [24, 8], id="3-to-1"),
        pytest.param([1, 1], 32, [16, 16], id="equal"),
        pytest.param([1, 1, 1], 4, [2, 1, 1], id="tie-to-rank-0"),
        pytest.param([1, 1, 1], 5, [2, 2, 1], id="ties-to-low-ranks"),
        pytest.param([2, 1], 6, [4, 2], id="largest-remainder"),
        pytest.param([1000, 1], 4, [3, 1], id="slow-rank-keeps-one"),
        pytest.param([5.0], 7, [7], id="single-rank"),
        pytest.param([2, 1, 1], 3, [1, 1, 1], id="batch-equals-world"),
    ],
)
def test_proportional_counts_examples(weights, total, expected):
    assert proportional_counts(weights, total) == expected


def test_allocate_three_to_one():
    alloc = allocate([3.0, 1.0], 32, [64, 64])
    assert alloc.samples == [24, 8]
    assert alloc.offsets() == [0, 24]
    assert [s.accum_steps for s in alloc.shares] == [1, 1]


def test_micro_batch_and_accumulation_under_cap():
    alloc = allocate([3.0, 1.0], 32, [10, 3])
    a, b = alloc.shares
    assert (a.samples, a.accum_steps, a.micro_batch, a.micro_sizes) == (24, 3, 8, [8, 8, 8])
    assert (b.samples, b.accum_steps, b.micro_batch, b.micro_sizes) == (8, 3, 3, [3, 3, 2])


def test_micro_sizes_docstring_example():
    share = RankShare(rank=0, samples=10, micro_batch=4, accum_steps=3, max_micro_batch=4)
    assert share.micro_sizes == [4, 3, 3]


# --------------------------------------------------------------------------- determinism
def test_same_inputs_same_digest():
    rng = random.Random(11)
    for _ in range(200):
        throughputs, batch, caps = random_case(rng)
        first = allocate(throughputs, batch, caps)
        second = allocate(list(throughputs), batch, list(caps))
        assert first == second
        assert first.digest() == second.digest()
        assert len(first.digest()) == 64


def test_ties_go_to_lower_rank():
    assert allocate([2.0, 2.0, 2.0, 2.0], 6, [8] * 4).samples == [2, 2, 1, 1]
    assert proportional_counts([1.0] * 5, 7) == [2, 2, 1, 1, 1]


def test_digest_covers_the_split_not_the_label():
    forced = allocate([1.0, 1.0], 32, [64, 64], forced=[24, 8])
    measured = allocate([3.0, 1.0], 32, [64, 64])
    assert forced.samples == measured.samples
    assert forced.source != measured.source
    assert forced.digest() == measured.digest()


def test_digest_changes_when_any_share_changes():
    caps = [4, 4, 4, 4]
    base = allocate([1.0] * 4, 16, caps, forced=[4, 4, 4, 4])
    digests = {base.digest()}
    # move one sample from every rank to every other rank
    for src in range(4):
        for dst in range(4):
            if src == dst:
                continue
            samples = [4, 4, 4, 4]
            samples[src] -= 1
            samples[dst] += 1
            digest = allocate([1.0] * 4, 16, caps, forced=samples).digest()
            assert digest != base.digest()
            digests.add(digest)
    assert len(digests) == 1 + 12
    # same samples, different micro-batch / accumulation on one rank
    for rank in range(4):
        other = list(caps)
        other[rank] = 2
        assert allocate([1.0] * 4, 16, other, forced=[4] * 4).digest() != base.digest()
    # different global batch
    assert allocate([1.0] * 4, 20, caps, forced=[5] * 4).digest() != base.digest()


# --------------------------------------------------------------------------- forced
def test_forced_allocation_is_used_as_given():
    alloc = allocate([1.0, 100.0], 32, [16, 16], forced=[24, 8])
    assert alloc.source == "forced"
    assert alloc.samples == [24, 8]
    check_allocation(alloc, 32, [16, 16])


def test_forced_allocation_custom_source_and_step():
    alloc = allocate([1.0, 1.0], 32, [16, 16], forced=[20, 12], source="rebalanced", step=50)
    assert (alloc.source, alloc.step, alloc.samples) == ("rebalanced", 50, [20, 12])


@pytest.mark.parametrize(
    "forced",
    [
        pytest.param([20, 8], id="sums-to-28"),
        pytest.param([16, 8, 8], id="too-many-entries"),
        pytest.param([32], id="too-few-entries"),
        pytest.param([32, 0], id="zero-entry"),
        pytest.param([40, -8], id="negative-entry"),
    ],
)
def test_wrong_forced_allocation_raises(forced):
    with pytest.raises(AllocationError) as info:
        allocate([1.0, 1.0], 32, [16, 16], forced=forced)
    message = str(info.value)
    assert "balance.allocation" in message and "\n" not in message


# --------------------------------------------------------------------------- errors
def test_batch_smaller_than_world_names_the_fix():
    with pytest.raises(AllocationError) as info:
        allocate([1.0, 1.0, 1.0], 2, [8, 8, 8])
    message = str(info.value)
    assert "trainer.global_batch_size" in message
    assert "fewer ranks" in message
    with pytest.raises(AllocationError, match=r"trainer\.global_batch_size"):
        equal_split(4, 3, [8] * 4)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(0.0, id="zero"),
        pytest.param(-1.0, id="negative"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("inf"), id="inf"),
    ],
)
@pytest.mark.parametrize("position", [0, 1, 2])
def test_bad_throughput_raises(bad, position):
    throughputs = [1.0, 2.0, 3.0]
    throughputs[position] = bad
    with pytest.raises(AllocationError, match=f"rank {position}"):
        allocate(throughputs, 32, [16, 16, 16])


def test_no_ranks_raises():
    with pytest.raises(AllocationError):
        proportional_counts([], 8)


def test_throughput_count_mismatch_raises():
    with pytest.raises(AllocationError, match="3 throughputs for 2 ranks"):
        allocate([1.0, 1.0, 1.0], 32, [16, 16])


@pytest.mark.parametrize("cap", [0, -1])
def test_cap_below_one_raises(cap):
    with pytest.raises(AllocationError, match="rank 1"):
        allocate([1.0, 1.0], 32, [16, cap])


@pytest.mark.parametrize(
    "shares",
    [
        pytest.param((RankShare(0, 20, 20, 1, 20), RankShare(1, 8, 8, 1, 8)), id="wrong-sum"),
        pytest.param((RankShare(1, 24, 24, 1, 24), RankShare(0, 8, 8, 1, 8)), id="wrong-order"),
        pytest.param((RankShare(0, 32, 32, 1, 32), RankShare(1, 0, 1, 1, 1)), id="zero-samples"),
        pytest.param((RankShare(0, 24, 8, 2, 8), RankShare(1, 8, 8, 1, 8)), id="accum-too-small"),
        pytest.param((RankShare(0, 24, 0, 1, 8), RankShare(1, 8, 8, 1, 8)), id="zero-micro"),
    ],
)
def test_malformed_allocation_raises(shares):
    with pytest.raises(AllocationError):
        Allocation(global_batch_size=32, shares=shares, source="forced")


# --------------------------------------------------------------------------- serialisation
def test_to_dict_from_dict_round_trip():
    rng = random.Random(5)
    for _ in range(200):
        throughputs, batch, caps = random_case(rng)
        alloc = allocate(throughputs, batch, caps, step=rng.randint(1, 1000))
        data = alloc.to_dict()
        assert isinstance(data["shares"], list) and isinstance(data["throughputs"], list)
        through_json = json.loads(json.dumps(data))
        for copy in (data, through_json):
            back = Allocation.from_dict(copy)
            assert back == alloc
            assert back.digest() == alloc.digest()


def test_from_dict_defaults_and_validation():
    data = allocate([1.0, 1.0], 8, [4, 4], forced=[5, 3]).to_dict()
    del data["throughputs"], data["step"]
    back = Allocation.from_dict(data)
    assert back.throughputs == () and back.step == 1
    data["global_batch_size"] = 9
    with pytest.raises(AllocationError):
        Allocation.from_dict(data)


# --------------------------------------------------------------------------- micro_batch_cap
@pytest.mark.parametrize(
    "budget, static, per_sample, limit, cap",
    [
        pytest.param(10 * GiB, 2 * GiB, 1 * GiB, None, 8, id="fits-8"),
        pytest.param(10 * GiB, 2 * GiB, 1 * GiB, 4, 4, id="limit-lowers"),
        pytest.param(10 * GiB, 2 * GiB, 1 * GiB, 100, 8, id="limit-above-memory"),
        pytest.param(10 * GiB, 2 * GiB, 3 * GiB, None, 2, id="floor"),
        pytest.param(10 * GiB, 9.5 * GiB, 1 * GiB, None, 0, id="nothing-fits"),
        pytest.param(10 * GiB, 12 * GiB, 1 * GiB, None, 0, id="static-over-budget"),
        pytest.param(10 * GiB, 12 * GiB, 1 * GiB, 4, 0, id="static-over-budget-limited"),
        pytest.param(10 * GiB, 2 * GiB, 0, 16, 16, id="unmeasured-sample-uses-limit"),
        pytest.param(10 * GiB, 2 * GiB, 0, None, 1 << 20, id="unmeasured-sample-no-limit"),
        pytest.param(1.0, 0.0, 1.0, None, 1, id="exactly-one"),
    ],
)
def test_micro_batch_cap(budget, static, per_sample, limit, cap):
    got = micro_batch_cap(budget, static, per_sample, limit)
    assert got == cap
    assert isinstance(got, int)


def test_micro_batch_cap_feeds_allocate():
    caps = [
        micro_batch_cap(80 * GiB, 2 * GiB, 1 * GiB, 32),
        micro_batch_cap(16 * GiB, 2 * GiB, 1 * GiB),
    ]
    assert caps == [32, 14]
    alloc = allocate([3.0, 1.0], 96, caps)
    check_allocation(alloc, 96, caps)
    assert alloc.samples == [72, 24]
    assert [s.accum_steps for s in alloc.shares] == [3, 2]
    assert [s.micro_batch for s in alloc.shares] == [24, 12]


# --------------------------------------------------------------------------- exact splits
@pytest.mark.parametrize(
    "weights, total, exact",
    [
        pytest.param([9, 1], 10, [9, 1], id="9-to-1"),
        pytest.param([4, 1], 100, [80, 20], id="4-to-1"),
        pytest.param([3, 1, 1], 50, [30, 10, 10], id="3-1-1"),
    ],
)
def test_exact_proportional_split_is_found(weights, total, exact):
    # every quota total * w / sum(w) is an integer >= 1: the proportional split is exact
    assert proportional_counts(weights, total) == exact


def _report(rank: int, cap: int, partition_key=None) -> RankReport:
    """One rank's report as the worker gathers it (a CPU rank that fits ``cap`` samples)."""
    return rank_report(
        rank,
        2,
        max_micro_batch=cap,
        static_bytes=2 * GiB,
        activation_bytes_per_sample=0.5 * GiB,
        memory_budget_bytes=1 * GiB,
        partition_key=partition_key,
    )


@pytest.mark.parametrize(
    "placement, knob",
    [
        pytest.param(None, "cluster.memory_budget_gb", id="local"),
        pytest.param("t4", "cluster.partitions.t4.memory_budget_gb", id="partition"),
    ],
)
def test_cannot_fit_one_sample_names_the_memory_budget_knob(placement, knob):
    from hetseq_hpc.balance.agree import agree_on_allocation
    from hetseq_hpc.config import compose_run_config

    run = compose_run_config(["cluster.ranks=2"])
    with pytest.raises(AllocationError) as info:
        agree_on_allocation(run, [_report(0, 4), _report(1, 0, placement)], rdv=FakeGang(2))
    message = str(info.value)
    assert message.startswith("rank 1 (cpu) cannot fit one sample: needs 2.50 GiB, has 1.00 GiB")
    assert f"raise {knob}" in message and "\n" not in message


# --------------------------------------------------------------------------- cost curves
def _curve_case(rng: random.Random):
    """(curves, global batch, caps): world 1..8, micro-batch overheads from none to dominant."""
    n = rng.randint(1, 8)
    curves = [
        CostCurve(
            rng.choice([0.0, 10 ** rng.uniform(-4, -1)]),
            10 ** rng.uniform(-4, -1),
            rng.choice([0.0, 10 ** rng.uniform(-3, 0)]),
        )
        for _ in range(n)
    ]
    caps = [rng.randint(1, 64) for _ in range(n)]
    return curves, rng.randint(n, n * rng.choice([1, 4, 32, 128])), caps


def test_cost_curve_optimum_by_hand():
    # 0.01 s vs 0.03 s per sample, no fixed costs: 30 + 10 samples both take 0.3 s
    curves = [CostCurve(0.0, 0.01), CostCurve(0.0, 0.03)]
    alloc = allocate([100.0, 33.3], 40, [64, 64], curves=curves)
    assert alloc.samples == [30, 10] and alloc.source == "cost_curve"
    assert predicted_step_s(curves, alloc.samples, [64, 64]) == pytest.approx(0.3)
    # a per-step fixed cost of 0.1 s on the fast rank moves samples to the slow one:
    # T = 0.01 b0 + 0.1 = 0.03 b1 with b0 + b1 = 40 -> b0 = 27.5: 27/13 (0.37 / 0.39) or 28/12
    # (0.38 / 0.36); 28/12 is faster
    fixed = [CostCurve(0.0, 0.01, 0.1), CostCurve(0.0, 0.03)]
    assert allocate([1.0, 1.0], 40, [64, 64], curves=fixed).samples == [28, 12]


def test_fewer_fuller_micro_batches_win():
    """The proportional split gives the slow rank 34 samples = 2 micro-batches of 17; each
    micro-batch costs it 0.15 s, so 32 samples in ONE micro-batch is faster overall."""
    caps = [32, 32]
    curves = [CostCurve(0.02, 0.01), CostCurve(0.15, 0.025)]
    rates = [c.samples_per_s(32) for c in curves]  # 94.1 and 33.7 samples/s at full micro-batches
    proportional = allocate(rates, 128, caps)
    assert proportional.samples == [94, 34]
    assert [s.accum_steps for s in proportional.shares] == [3, 2]
    best = allocate(rates, 128, caps, curves=curves)
    assert best.samples == [96, 32]
    assert [(s.micro_batch, s.accum_steps) for s in best.shares] == [(32, 3), (32, 1)]
    # 1.15 s (slow rank: 2 x 0.15 + 34 x 0.025) -> 1.02 s (fast rank: 3 x 0.02 + 96 x 0.01)
    assert predicted_step_s(curves, proportional.samples, caps) == pytest.approx(1.15)
    assert predicted_step_s(curves, best.samples, caps) == pytest.approx(1.02)


def test_cost_curve_allocation_respects_the_memory_cap():
    rng = random.Random(17)
    for _ in range(300):
        curves, batch, caps = _curve_case(rng)
        alloc = allocate([1.0] * len(caps), batch, caps, curves=curves)
        check_allocation(alloc, batch, caps)
        for share, cap in zip(alloc.shares, caps):
            assert share.accum_steps == math.ceil(share.samples / cap)


def test_cost_curve_allocation_is_optimal_on_small_cases():
    """Against every split of small batches over 1-3 ranks (brute force)."""
    rng = random.Random(23)
    for _ in range(150):
        n = rng.randint(1, 3)
        batch = rng.randint(n, 24)
        curves = [
            CostCurve(rng.uniform(0, 0.05), rng.uniform(1e-3, 0.05), rng.uniform(0, 0.1))
            for _ in range(n)
        ]
        caps = [rng.randint(1, 12) for _ in range(n)]
        got = min_max_split(curves, batch, caps)
        best = min(
            predicted_step_s(curves, split, caps)
            for split in itertools.product(range(1, batch + 1), repeat=n)
            if sum(split) == batch
        )
        assert predicted_step_s(curves, got, caps) == best


def test_cost_curve_never_worse_than_the_proportional_split():
    """Property (seeded random curves): under the model, the chosen split's step time is at most
    that of the proportional split by throughput at full micro-batches, or by 1 / c."""
    rng = random.Random(20241122)
    for _ in range(500):
        curves, batch, caps = _curve_case(rng)
        got = predicted_step_s(curves, min_max_split(curves, batch, caps), caps)
        for weights in (
            [c.samples_per_s(cap) for c, cap in zip(curves, caps)],
            [1.0 / c.per_sample_s for c in curves],
        ):
            proportional = proportional_counts(weights, batch)
            assert got <= predicted_step_s(curves, proportional, caps) * (1 + 1e-12)


def test_cost_curve_allocation_is_deterministic():
    rng = random.Random(31)
    for _ in range(100):
        curves, batch, caps = _curve_case(rng)
        first = allocate([1.0] * len(caps), batch, caps, curves=curves)
        # the same floats after a trip through JSON (what every rank gathers)
        again = [CostCurve.from_dict(json.loads(json.dumps(c.to_dict()))) for c in curves]
        second = allocate([1.0] * len(caps), batch, list(caps), curves=again)
        assert first == second and first.digest() == second.digest()
    # identical ranks: ties go to the lower ranks
    same = [CostCurve(0.0, 0.01)] * 4
    assert min_max_split(same, 6, [8] * 4) == [2, 2, 1, 1]


def test_cost_curves_round_trip_and_forced_still_wins():
    curves = [CostCurve(0.01, 0.002, 0.05), CostCurve(0.02, 0.006, 0.1)]
    alloc = allocate([1.0, 1.0], 64, [32, 32], curves=curves)
    back = Allocation.from_dict(json.loads(json.dumps(alloc.to_dict())))
    assert back == alloc and back.curves == tuple(curves)
    forced = allocate([1.0, 1.0], 64, [32, 32], forced=[40, 24], curves=curves)
    assert forced.samples == [40, 24] and forced.source == "forced"


def test_cost_curve_split_errors():
    with pytest.raises(AllocationError, match=r"trainer\.global_batch_size"):
        min_max_split([CostCurve(0.0, 0.01)] * 3, 2, [8] * 3)
    with pytest.raises(AllocationError, match="rank 1"):
        min_max_split([CostCurve(0.0, 0.01)] * 2, 8, [8, 0])
    with pytest.raises(AllocationError):
        min_max_split([], 8, [])
