"""The benchmark's own arithmetic (scripts/bench_hetero.py): the figures docs/benchmarks.md
quotes come from these helpers, so they are checked by hand like the planner's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "bench_hetero.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_hetero", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ceiling_at_batch_with_rates_that_do_not_depend_on_the_share(bench):
    # both points on one line through the origin: the rank's rate is one number, so the best
    # integer split of 32 over 120 and 40 samples/s is 24/8 at exactly 160 samples/s
    points = [((32, 120.0), (24, 120.0)), ((32, 40.0), (8, 40.0))]
    rate, split = bench.best_split_ceiling(points, 32)
    assert split == [24, 8]
    assert rate == pytest.approx(160.0)


def test_ceiling_at_batch_charges_the_small_share_its_measured_rate(bench):
    # the slow rank runs 7 samples at 31.2 samples/s but 32 at 37.7: t(n) through the two
    # points; by hand t0(26) = 25/130 + (32/127.1 - 25/130) / 7 = 0.20076 s,
    # t1(6) = 7/31.2 - (32/37.7 - 7/31.2) / 25 = 0.19938 s -> 26/6 at 32 / 0.20076
    points = [((32, 127.1), (25, 130.0)), ((32, 37.7), (7, 31.2))]
    rate, split = bench.best_split_ceiling(points, 32)
    assert split == [26, 6]
    t0 = 25 / 130 + (32 / 127.1 - 25 / 130) / 7
    assert rate == pytest.approx(32 / t0)
    plain = 127.1 + 37.7  # the ceiling that credits each rank with its whole-batch rate
    assert rate < plain


def test_ceiling_at_batch_keeps_a_sample_on_every_rank(bench):
    # a rank 100x slower still gets one sample (a data-parallel rank cannot hold none)
    rate, split = bench.best_split_ceiling([((8, 100.0), (7, 100.0)), ((8, 1.0), (1, 1.0))], 8)
    assert split == [7, 1]
    assert rate == pytest.approx(8.0)


def test_first_move_after_a_change_its_direction_and_a_reversal(bench):
    def row(step, split, to=None):
        r = {"step": step, "ranks": [{"samples": b} for b in split]}
        if to is not None:
            r["reallocation"] = {"at_step": step + 1, "to": to}
        return r

    # rank 1 got faster after step 10; decided after step 14, taken from step 15
    rows = [row(s, [90, 38]) for s in range(1, 14)] + [row(14, [90, 38], [80, 48])]
    rows += [row(s, [80, 48]) for s in range(15, 20)] + [row(20, [80, 48], [95, 33])]
    got = bench.first_move_after(rows, 10, faster_rank=1)
    assert got == {"first_move_after": 4, "first_move_right_way": True, "reversed": True}
    assert bench.first_move_after(rows[:13], 10, 1)["first_move_after"] is None
