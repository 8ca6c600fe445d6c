"""The collective timeout of a training step under in-job recovery (issue 24):
``max(trainer.elastic.timeout_s, 3 × the step time)``, predicted before the first step and
measured after (:class:`hetseq_hpc.train.recovery.timeouts.StepTimeout`), so that a healthy but long or
uneven step is never taken for a lost rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hetseq_hpc.balance.allocation import equal_split
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.train.records import DONE, LOGGED, TRAINED
from hetseq_hpc.train.recovery.timeouts import StepTimeout, predicted_step_s


def test_short_steps_keep_the_configured_floor():
    timeout = StepTimeout(10.0)
    assert timeout.seconds == 10.0
    timeout.observe(0.5)
    assert timeout.seconds == 10.0


def test_a_long_step_raises_the_timeout_to_three_times_it():
    timeout = StepTimeout(10.0)
    timeout.observe(2.0)
    assert timeout.observe(12.0)  # moved: to be applied
    assert timeout.seconds == 36.0
    assert not timeout.stale() or timeout.applied is None


def test_the_longest_of_the_recent_steps_counts_and_old_ones_age_out():
    timeout = StepTimeout(10.0, window=3)
    for seconds in (20.0, 1.0, 1.0):
        timeout.observe(seconds)
    assert timeout.seconds == 60.0
    timeout.observe(1.0)  # the 20 s step left the window
    assert timeout.seconds == 10.0


def test_before_any_step_twice_the_prediction_covers_the_warm_up():
    timeout = StepTimeout(10.0)
    timeout.predict(8.0)
    assert timeout.seconds == 48.0  # 3 x 2 x 8
    timeout.observe(8.0)
    assert timeout.seconds == 24.0


def test_fewer_survivors_scale_the_measured_steps_up():
    timeout = StepTimeout(10.0)
    timeout.observe(6.0)
    timeout.rescale(3 / 2)
    assert timeout.seconds == 27.0


def test_the_prediction_comes_from_the_slowest_rank_of_the_split():
    alloc = equal_split(2, 8, [8, 8])
    assert predicted_step_s(alloc) == 0.0  # no measured speeds (equal): nothing predicted
    measured = dataclasses.replace(alloc, source="throughput", throughputs=(4.0, 1.0))
    assert predicted_step_s(measured) == 4.0


def test_apply_sets_the_default_groups_timeout():
    with single_process_rendezvous() as _:
        timeout = StepTimeout(10.0)
        timeout.observe(15.0)
        assert timeout.apply() == 45.0
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 45.0
        assert not timeout.stale()


def test_phases_are_ordered():
    assert TRAINED < LOGGED < DONE
