"""The chaos soak's own checks (scripts/chaos_soak.py, issue 45): the fault plan is the same
for the same seed, and every step of metrics.jsonl is counted once, missing or repeated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "chaos_soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plan_is_the_seeds_and_reaches_the_fault_count(soak):
    kinds = list(soak.KINDS)
    plan = soak.schedule(7, 100, (3, 6), kinds)
    assert plan == soak.schedule(7, 100, (3, 6), kinds)
    assert plan != soak.schedule(8, 100, (3, 6), kinds)
    planned = sum(soak.KINDS[kind] for _, kind in plan)
    assert 100 <= planned <= 101  # the last kind may inject two
    assert all(3 <= gap <= 6 and kind in kinds for gap, kind in plan)
    assert {kind for _, kind in plan} == set(kinds)


def test_missing_and_repeated_steps_come_from_the_training_rows_only(soak):
    rows = [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.9},
        {"step": 2, "event": "membership", "lost": [{"rank": 1}]},  # an event, not a step
        {"step": 2, "loss": 1.9},  # written twice
        {"step": 4, "loss": 1.7},
    ]
    counts = soak.step_counts(rows)
    assert counts == {1: 1, 2: 2, 4: 1}
    assert soak.missing_and_repeated(counts, 5) == ([3, 5], [2])


def test_the_loss_difference_is_relative_over_the_shared_steps(soak):
    reference = {1: 2.0, 2: 1.0, 3: 0.5}
    assert soak.max_rel_diff(reference, {1: 2.0, 2: 1.000001}) == pytest.approx(1e-6)
    assert soak.max_rel_diff(reference, {}) is None


def test_a_loss_difference_within_a_clean_runs_drift_counts_as_the_same_trajectory(soak):
    """Beyond 1e-6 only where an uninterrupted run on another split (the control) drifts at
    least as far from the reference: fp32 summation order, not a fault."""
    assert soak.within_drift(5e-7, None)
    assert not soak.within_drift(1e-5, None)
    assert soak.within_drift(1e-5, 2.4e-5)
    assert not soak.within_drift(3e-5, 2.4e-5)
    assert not soak.within_drift(None, 1.0)
