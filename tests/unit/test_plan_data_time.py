"""The planner counts the time a rank spends building its batches (``plan.data_ms_per_sample``).

Each rank builds step k+1's batches on a background thread while step k runs
(``train/batches.py``), so a data path slower than the passes bounds every step and a faster
one is hidden: a spec rank's per-sample time is ``max(compute, data)``. The GPU spec model
does not know the data path, so ``plan`` times the task's own batch function on the machine
that plans, or takes ``plan.data_ms_per_sample`` where it is given.
"""

from __future__ import annotations

import json
import re

import pytest

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.plan import model_info
from hetseq_hpc.plan.planner import make_plan, with_batch_building
from hetseq_hpc.plan.render import headline_json


def _plan(*overrides: str):
    return make_plan(compose_run_config(["cluster=mixed", "task=bert", *overrides]))


def test_batch_build_time_is_the_fastest_build_per_row(monkeypatch):
    """Arithmetic of :func:`batch_build_s` on a fake clock (the only fake here: a clock that
    advances 1 ms per row built, 5 ms more on the first timed build): the warm-up is not
    counted, the fastest build counts, and it is divided by the rows the build returned (a data
    set of 8 rows gives 8 for 32 asked)."""
    clock = [0.0]
    calls = []

    def make(n: int):
        rows = min(n, 8)
        calls.append(n)
        clock[0] += rows * 1e-3 + (5e-3 if len(calls) == 2 else 0.0)
        return {"x": __import__("torch").zeros(rows, 3)}

    monkeypatch.setattr(model_info.time, "perf_counter", lambda: clock[0])
    assert model_info.batch_build_s(make) == pytest.approx(1e-3)
    assert calls == [2] + [model_info.DATA_TIMING_SAMPLES] * model_info.DATA_TIMING_REPEATS


def test_a_slow_first_build_is_measurement_enough(monkeypatch):
    clock = [0.0]
    calls = []

    def make(n: int):
        calls.append(n)
        clock[0] += 1.0 * n
        return {"x": __import__("torch").zeros(n, 3)}

    monkeypatch.setattr(model_info.time, "perf_counter", lambda: clock[0])
    assert model_info.batch_build_s(make) == pytest.approx(1.0)
    assert calls == [2]


def test_spec_ranks_are_bounded_by_the_given_batch_time():
    """``plan.data_ms_per_sample=5`` (slower than every spec rank's passes of BERT-base):
    every rank's per-sample time is the larger of its compute and 5 ms (its cost curve and its
    rate), the step grows, and the source line says where the figure came from; ``=0`` leaves
    it out and says so; 0.01 ms (faster than every rank) changes no rank."""
    none, given = _plan("plan.data_ms_per_sample=0"), _plan("plan.data_ms_per_sample=5")
    for a, b in zip(none.ranks, given.ranks):
        assert b.curve.per_sample_s == pytest.approx(max(a.curve.per_sample_s, 5e-3))
        assert 1 / b.samples_per_s == pytest.approx(max(1 / a.samples_per_s, 5e-3))
    assert given.prediction.balanced.step_s > none.prediction.balanced.step_s
    assert "5.000 ms per sample building batches (plan.data_ms_per_sample" in given.source
    assert "a rank runs at the slower of the two" in given.source
    assert "no time for building batches (plan.data_ms_per_sample=0)" in none.source
    assert json.loads(headline_json(given))["data_ms_per_sample"] == pytest.approx(5.0)
    hidden = _plan("plan.data_ms_per_sample=0.01")
    assert [r.curve for r in hidden.ranks] == [r.curve for r in none.ranks]


def test_plan_times_the_tasks_batch_function_by_default():
    plan = _plan()
    assert plan.model.data_s_per_sample > 0
    timed = re.search(
        r"([0-9.]+) ms per sample building batches \(the task's batch "
        r"function timed on this machine",
        plan.source,
    )
    assert timed and float(timed.group(1)) == pytest.approx(
        plan.model.data_s_per_sample * 1e3, abs=1e-3
    ), plan.source


def test_measured_ranks_already_include_it():
    """A probe or this CPU's calibration times the ranks' own passes: no spec rank, nothing
    changed (the same ranks with the option at 0 and at 50 ms)."""
    ranks = [
        make_plan(
            compose_run_config(
                [
                    "task=bert",
                    "cluster.ranks=2",
                    "trainer.max_steps=2",
                    f"plan.data_ms_per_sample={ms}",
                ]
            )
        ).ranks
        for ms in (0, 50)
    ]
    assert [r.curve for r in ranks[0]] == [r.curve for r in ranks[1]]
    assert with_batch_building(ranks[0], 0.0) == ranks[0]
    local = make_plan(compose_run_config(["task=bert", "cluster.ranks=2", "trainer.max_steps=2"]))
    assert json.loads(headline_json(local))["data_ms_per_sample"] == 0


def test_a_data_path_that_reopens_its_file_per_item_shows_in_the_plan(tmp_path):
    """A user's Dataset that opens and decompresses a 2 MB file for every item (HetSeq's
    loader does this with its HDF5 shard) against the same items from memory: the plan times
    both (no option given) and rates the slow one's ranks slower. The two data paths differ by
    about 200x here; the check asks for 10x."""
    base = ["cluster=mixed", "task=dataset", "trainer.global_batch_size=256"]
    fast = make_plan(compose_run_config([*base, "task.target=tests.helpers.user_dataset:build"]))
    slow = make_plan(
        compose_run_config(
            [
                *base,
                "task.target=tests.helpers.user_dataset:build_file_per_item",
                f"+task.args.root={tmp_path}",
            ]
        )
    )
    assert slow.model.data_s_per_sample > 10 * fast.model.data_s_per_sample
    assert slow.prediction.balanced.step_s > fast.prediction.balanced.step_s


@pytest.mark.parametrize("value", ["-1", "abc", "true"])
def test_a_bad_data_time_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^plan\.data_ms_per_sample=") as err:
        compose_run_config(["task=bert", f"plan.data_ms_per_sample={value}"])
    assert "\n" not in str(err.value) and (
        "milliseconds >= 0" in str(err.value) or "expected a number" in str(err.value)
    )
