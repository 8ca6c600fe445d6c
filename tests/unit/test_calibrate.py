"""Calibration: the cost-curve fit on synthetic timings, and a real calibration of a small model
(three sizes, the per-step cost, no more passes than the one-size calibration it replaced), in
one process. (Two processes over a real gloo barrier: tests/integration/test_calibrate_barrier.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from hetseq_hpc.balance.calibrate import LOW_SIZE_DIVISOR, calibrate, fastest_per_size, timed_sizes
from hetseq_hpc.balance.curves import CostCurve, fit_compute, fit_curve, fit_residuals
from hetseq_hpc.errors import AllocationError
from tests.helpers.calibration import Tiny, batches


# --------------------------------------------------------------------------- the fit
def test_fit_recovers_a_line_exactly():
    sizes = [4, 16, 16, 4, 8]
    times = [0.02 + 0.005 * m for m in sizes]
    curve = fit_curve(sizes, times, step_fixed_s=0.03)
    assert curve.overhead_s == pytest.approx(0.02)
    assert curve.per_sample_s == pytest.approx(0.005)
    assert curve.step_fixed_s == 0.03
    assert max(abs(r) for r in fit_residuals(curve, sizes, times)) < 1e-9


def test_fit_on_noisy_timings_is_close():
    rng = random.Random(4)
    sizes = [rng.choice([4, 16]) for _ in range(40)]
    times = [(0.01 + 0.002 * m) * (1 + rng.uniform(-0.03, 0.03)) for m in sizes]
    curve = fit_curve(sizes, times)
    assert curve.overhead_s == pytest.approx(0.01, rel=0.25)
    assert curve.per_sample_s == pytest.approx(0.002, rel=0.05)


def test_fit_never_returns_a_negative_overhead():
    # superlinear timings tilt the free line below zero at m = 0: refit through the origin
    curve = fit_curve([4, 16], [0.01, 0.08])
    assert curve.overhead_s == 0.0
    assert curve.per_sample_s == pytest.approx((4 * 0.01 + 16 * 0.08) / (16 + 256))


def test_fit_of_one_size_is_a_rate():
    curve = fit_curve([8, 8, 8], [0.08, 0.08, 0.08])
    assert (curve.overhead_s, curve.per_sample_s) == (0.0, pytest.approx(0.01))


def test_fit_of_accumulated_steps():
    # (k micro-batches, b samples) -> k a + b c: three splits of one step
    designs = [(1, 30), (2, 34), (4, 98)]
    times = [k * 0.05 + b * 0.01 for k, b in designs]
    assert fit_compute(designs, times) == (pytest.approx(0.05), pytest.approx(0.01))


@pytest.mark.parametrize("times", [[0.0, 0.1], [-1.0, 0.1], [float("nan"), 0.1]])
def test_fit_rejects_bad_timings(times):
    with pytest.raises(AllocationError, match="re-run the calibration"):
        fit_curve([4, 16], times)


def test_fit_needs_one_timing_per_size():
    with pytest.raises(AllocationError):
        fit_curve([4, 16], [0.1])
    with pytest.raises(AllocationError):
        fit_curve([], [])


def test_curve_rejects_bad_figures():
    with pytest.raises(AllocationError, match="per_sample_s"):
        CostCurve(0.0, 0.0)
    with pytest.raises(AllocationError, match="overhead_s"):
        CostCurve(-0.1, 0.01)
    with pytest.raises(AllocationError):
        CostCurve.from_throughput(0.0)


# --------------------------------------------------------------------------- timed sizes
def test_timed_sizes_cycle_through_three_sizes_within_the_cap():
    assert timed_sizes(16, 3, 64) == [16, 16 // LOW_SIZE_DIVISOR, 2]  # m / 16 = 1: 2 at least
    assert timed_sizes(16, 4, 8) == [8, 8 // LOW_SIZE_DIVISOR, 8, 8 // LOW_SIZE_DIVISOR]
    # never one sample when m > 1 (a training-mode BatchNorm refuses a batch of one)
    assert timed_sizes(4, 4, 64) == [4, 2, 4, 2]
    assert timed_sizes(1, 3, 64) == [1, 1, 1]
    assert timed_sizes(16, 1, 64) == [16]


def test_fastest_per_size_ignores_one_off_stalls():
    # the first pass at 16 stalled (3x): the fit sees the undisturbed 0.10 s, not a mean
    sizes, times = fastest_per_size([16, 4, 16, 4], [0.30, 0.04, 0.10, 0.05])
    assert sizes == [4, 16] and times == [0.04, 0.10]
    curve = fit_curve(sizes, times)
    assert curve.micro_s(16) == pytest.approx(0.10) and curve.micro_s(4) == pytest.approx(0.04)


# --------------------------------------------------------------------------- a real calibration
def test_the_warm_up_pass_is_capped_by_a_small_probe_first():
    """A budget too small for the calibration micro-batch: the probes' saved bytes (2 and 4
    samples) cap the warm-up pass too, so no pass of calibration runs far above the cap."""
    torch.manual_seed(0)
    model = Tiny()
    seen = []

    def make_batch(n):
        seen.append(n)
        return {"x": torch.randn(n, 32), "y": torch.randn(n, 1)}

    probe = {}
    calibrate(model, lambda n: probe.setdefault(n, make_batch(n)), torch.device("cpu"), 2, 1, 2**30)
    seen.clear()
    per_sample = 1.5 * sum(v.numel() * 4 for v in probe[2].values()) / 2  # a rough guide
    static = 1000.0
    budget = (static + 6 * max(per_sample, 1.0) * 8) / 0.9
    cal = calibrate(model, make_batch, torch.device("cpu"), 4096, 3, budget, static_bytes=static)
    assert seen[:2] == [2, 4] and max(seen[2:]) < 4096, seen  # the warm-up was capped too
    assert cal.max_micro_batch < 4096


def test_calibration_fits_three_sizes_and_times_the_optimizer():
    torch.manual_seed(0)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def make_batch(n):
        seen.append(n)
        return {"x": torch.randn(n, 32), "y": torch.randn(n, 1)}

    cal = calibrate(model, make_batch, torch.device("cpu"), 16, 3, 2**30)
    sizes = [n for n, _ in cal.timings]
    assert sizes == [16, 4, 2]
    assert seen == [2, 4, 16, 16, 4, 2]  # probes of 2 and 4, one warm-up pass, the timed ones
    assert all(t > 0 for _, t in cal.timings)
    assert cal.per_sample_s > 0 and cal.overhead_s >= 0 and cal.step_fixed_s > 0
    curve = CostCurve(
        cal.overhead_s, cal.per_sample_s, cal.step_fixed_s, cal.host_s, cal.host_per_sample_s
    )
    assert cal.samples_per_s == pytest.approx(16 / curve.micro_s(16))
    assert cal.max_micro_batch >= 16 and cal.activation_bytes_per_sample > 0
    # no more forward+backward work than the one-size calibration (1 + 3 passes of 16, one of
    # 1) and the probe
    assert len(seen) <= 2 + 1 + 3 + 1 and sum(seen) <= 6 + 16 * 4 + 1
    # the model is untouched (the optimizer ran on copies) and holds no gradients
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    data = cal.to_dict()
    assert {"overhead_s", "per_sample_s", "step_fixed_s", "timings"} <= set(data)
    assert CostCurve.from_dict(data) == curve


def test_calibration_times_within_the_memory_cap():
    model = Tiny()

    def make_batch(n):
        return {"x": torch.randn(n, 32), "y": torch.randn(n, 1)}

    cal = calibrate(model, make_batch, torch.device("cpu"), 16, 2, 2**30, max_micro_batch=8)
    assert cal.max_micro_batch == 8
    assert [n for n, _ in cal.timings] == [8, 8 // LOW_SIZE_DIVISOR]
    assert cal.micro_batch == 8


class _Peers:
    """Stands in for a PendingBarrier: done when ``done_when()`` says so; counts waits."""

    def __init__(self, done_when):
        self.done_when = done_when
        self.waited = 0

    def done(self):
        return self.done_when()

    def wait(self):
        self.waited += 1


def test_a_rank_done_early_times_more_passes_until_its_peers_are_done():
    # the peers are done after three more passes: the rank times exactly those, alternating on
    # from where its own passes stopped, and every pass joins the fit's data
    asked = []
    passes = []
    peers = _Peers(lambda: len(passes) >= 2 + 3 + 3 + 1)  # probes, warm-up, 3 own, 3 more

    def wait_for_peers():
        asked.append(len(passes))
        return peers

    def make_batch(n):
        passes.append(n)
        return batches(n)

    cal = calibrate(
        Tiny(), make_batch, torch.device("cpu"), 16, 3, 2**30, wait_for_peers=wait_for_peers
    )
    assert asked == [6], "asked once, after the probes, the warm-up and its own three passes"
    assert [n for n, _ in cal.timings] == [16, 4, 2, 16, 4, 2]
    assert peers.waited == 1, "it leaves calibration only through the barrier's wait"
    assert cal.overhead_s >= 0 and cal.per_sample_s > 0


def test_the_last_rank_to_finish_times_no_extra_pass():
    # every rank is done by the time it asks (or within the grace period): no pass is added
    cal = calibrate(
        Tiny(),
        batches,
        torch.device("cpu"),
        16,
        2,
        2**30,
        wait_for_peers=lambda: _Peers(lambda: True),
    )
    assert [n for n, _ in cal.timings] == [16, 4]


def test_peers_done_within_the_grace_period_cost_no_extra_pass():
    # the last rank's barrier completes a round trip after it posts: that is no reason to time
    # another pass (which would hold every other rank up by one slow pass)
    import time

    from hetseq_hpc.balance.calibrate import PEER_GRACE_S

    def wait_for_peers():
        posted = time.perf_counter()
        return _Peers(lambda: time.perf_counter() - posted >= PEER_GRACE_S / 4)

    cal = calibrate(
        Tiny(), batches, torch.device("cpu"), 16, 2, 2**30, wait_for_peers=wait_for_peers
    )
    assert [n for n, _ in cal.timings] == [16, 4]


def test_extra_passes_are_bounded_when_peers_never_finish():
    from hetseq_hpc.balance.calibrate import MAX_EXTRA_PASSES

    cal = calibrate(
        Tiny(),
        batches,
        torch.device("cpu"),
        8,
        2,
        2**30,
        wait_for_peers=lambda: _Peers(lambda: False),
    )
    assert len(cal.timings) == 2 + MAX_EXTRA_PASSES
    assert {n for n, _ in cal.timings} == {8, 2}


# --------------------------------------------------------------------------- start-up phases
def test_phase_clock_counts_from_the_process_start():
    import sys
    import time

    from hetseq_hpc.env.startup import PhaseClock, prefetch_imports, process_start_epoch

    started = process_start_epoch()
    assert started is not None and started <= time.time()
    clock = PhaseClock()
    assert 0 <= clock.phases_s["imports"] <= time.time() - started + 1
    clock.mark("probe")
    clock.mark("rendezvous")
    data = clock.to_dict()
    assert list(data["phases_s"]) == ["imports", "probe", "rendezvous"]
    assert data["process_start"] == clock.process_start and data["allocated"] >= started
    thread = prefetch_imports(["colorsys", "no_such_module_hetseq"])
    thread.join(timeout=30)
    assert "colorsys" in sys.modules
    assert prefetch_imports(()) is None
