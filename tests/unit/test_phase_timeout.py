"""Timeouts of the phases after a step (validation, checkpoint) with in-job recovery."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.train.recovery.timeouts import (
    FACTOR,
    WINDOW,
    PhaseTimeouts,
    first_validation_wait,
    peer_cost_ratio,
)


def test_a_phase_never_measured_waits_the_long_timeout():
    assert PhaseTimeouts(300).seconds("validation", 8.0) == 300


def test_a_measured_phase_waits_a_multiple_of_its_longest_recent_duration_at_least_the_step():
    timeouts = PhaseTimeouts(300)
    timeouts.record("validation", 2.0)
    timeouts.record("validation", 5.0)
    assert timeouts.seconds("validation", 8.0) == FACTOR * 5.0
    assert timeouts.seconds("validation", 20.0) == 20.0  # never below the step's timeout
    assert timeouts.seconds("checkpoint", 8.0) == 300  # each phase its own


def test_only_the_recent_durations_count():
    timeouts = PhaseTimeouts(300)
    timeouts.record("checkpoint", 50.0)
    for _ in range(WINDOW):
        timeouts.record("checkpoint", 1.0)
    assert timeouts.seconds("checkpoint", 1.0) == FACTOR * 1.0


def test_forget_makes_the_next_phase_wait_the_long_timeout_again():
    timeouts = PhaseTimeouts(300)
    timeouts.record("validation", 1.0)
    timeouts.forget()
    assert timeouts.seconds("validation", 8.0) == 300


def _rec(*compute_and_samples):
    return SimpleNamespace(
        per_rank=[StepStats(0.0, 1, n, c, c, 0.0) for c, n in compute_and_samples]
    )


def test_the_peer_ratio_is_the_slowest_peer_per_sample_over_this_rank_at_least_1():
    history = [_rec((1.0, 10), (1.0, 2)), _rec((1.0, 10), (0.5, 2))]  # rank 1: 5x, then 2.5x
    assert peer_cost_ratio(history, 0, 2) == pytest.approx(5.0)
    assert peer_cost_ratio(history, 1, 2) == 1.0  # the slowest itself: never below 1
    assert peer_cost_ratio(history, 0, 3) is None  # no step of a 3-rank world
    assert peer_cost_ratio([], 0, 2) is None


GROUP = object()  # the rendezvous's gloo group (only passed on: _set is replaced below)


def _wait(timeouts, history, step_timeout_s=8.0, group=GROUP):
    """The first validation's wait of rank 0 of 2 with this rendezvous group (None: none)."""
    return partial(first_validation_wait, timeouts, step_timeout_s, group, history, 0, 2)


def test_the_first_validation_gather_waits_an_estimate_then_the_measured_phase(monkeypatch):
    import hetseq_hpc.train.recovery.timeouts as pt

    set_to = []
    monkeypatch.setattr(pt, "_set", lambda seconds, group=None: set_to.append(seconds))
    history = [_rec((1.0, 10), (1.0, 2))]  # the peer takes 5x this rank's time per sample
    timeouts = PhaseTimeouts(600)
    wait = _wait(timeouts, history)
    assert wait(4.0) == FACTOR * 4.0 * 5.0 == set_to[-1]
    assert wait(0.1) == 8.0  # never below the step's timeout
    assert wait(100.0) is None  # not shorter than 600 s: unchanged
    timeouts.record("validation", 2.0)
    assert wait(4.0) is None  # measured: phase_timeout's own rule
    timeouts.forget()  # a timeout that lost nobody: the redo waits the long timeout
    assert wait(4.0) is None
    no_steps = _wait(PhaseTimeouts(600), [])
    assert no_steps(4.0) is None
    assert _wait(PhaseTimeouts(600), history, group=None)(4.0) is None  # no group
    assert len(set_to) == 2
