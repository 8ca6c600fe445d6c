"""Timeouts of the phases after a step (validation, checkpoint) with in-job recovery."""

from __future__ import annotations

from hetseq_hpc.train.phase_timeout import FACTOR, WINDOW, PhaseTimeouts


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
