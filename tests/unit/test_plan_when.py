"""Time to result (hetseq_hpc.plan.when, hetseq_hpc.launch.test_only) in-process: parsing
``sbatch --test-only``, the candidate mixes, ranking by expected finish, the picks of
``cluster.choose`` and the "no estimate" case. (Against a real Slurm:
tests/slurm/test_when_slurm.py.)"""

from __future__ import annotations

import json
import time

import pytest

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch.test_only import parse_test_only
from hetseq_hpc.plan.when import StartEstimate, candidate_mixes, rank_mixes, restrict_run
from hetseq_hpc.plan.when_table import duration, render_when, when_json
from tests.helpers.runs import SMALL_MODEL

# Captured from the project's test cluster (scripts/test-cluster.sh, Slurm 22.05.8) with
# SLURM_TIME_FORMAT=standard, partition a100 busy with a blocker job: stderr of
# ``sbatch --test-only`` on the het-job script the launcher renders (a100 1 node + v100 2 nodes),
# on a plain job, and on a job asking for more nodes than the partition has (exit status 1).
GOLDEN_HET = "sbatch: Job 5 to start at 2026-11-25T04:48:32 using 3 processors on n[1,3-4]\n"
GOLDEN_ONE = (
    "sbatch: Job 25 to start at 2026-11-25T04:49:17 using 1 processors on nodes n3 "
    "in partition v100\n"
)
GOLDEN_REFUSED = "allocation failure: Requested node configuration is not available\n"


def _epoch(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


def test_parse_het_job_and_plain_job_golden():
    het = parse_test_only(GOLDEN_HET)
    assert het.start_epoch == _epoch("2026-11-25T04:48:32") and not het.refused
    assert "n[1,3-4]" in het.detail and "3 CPUs" in het.detail
    one = parse_test_only("\n" + GOLDEN_ONE)  # stdout (empty) + stderr
    assert one.start_epoch == _epoch("2026-11-25T04:49:17")
    assert one.detail == "on n3 in v100 (1 CPUs)"


def test_parse_takes_the_latest_start_of_several_lines():
    text = GOLDEN_ONE + GOLDEN_HET  # a het job starts when its last component does
    assert parse_test_only(text).start_epoch == _epoch("2026-11-25T04:49:17")


def test_parse_no_estimate_is_said_not_guessed():
    for text in (
        "",
        "sbatch: some other message\n",
        "sbatch: Job 9 to start at Unknown using 1 processors on nodes n1\n",
    ):
        est = parse_test_only(text)
        assert est.start_epoch is None and not est.refused, text
        assert "no start time" in est.detail or "not a date" in est.detail


def test_parse_refusal():
    est = parse_test_only(GOLDEN_REFUSED, returncode=1)
    assert est.refused and est.start_epoch is None
    assert est.detail == "allocation failure: Requested node configuration is not available"
    est = parse_test_only("sbatch: error: Batch job submission failed: Invalid account\n", 1)
    assert est.refused and est.detail == "Batch job submission failed: Invalid account"


def test_candidate_mixes_every_count_then_thinned_and_said():
    mixes, note = candidate_mixes({"a100": 1, "v100": 2}, 32)
    assert len(mixes) == 5 and note.startswith("5 of 5 possible")
    assert {"a100": 1, "v100": 2} in mixes and {"v100": 1} in mixes and {} not in mixes
    # campus64: 16/24/24 nodes = 10624 mixes -> half and all of each partition (3^3 - 1 = 26)
    mixes, note = candidate_mixes({"a100": 16, "v100": 24, "t4": 24}, 32)
    assert len(mixes) == 26 and "of 10624 possible" in note and "half and all" in note
    assert "plan.max_mixes=32" in note
    assert {"a100": 8, "t4": 24} in mixes
    mixes, note = candidate_mixes({"a": 1, "b": 1, "c": 1}, 3)  # in/out only, then cut
    assert len(mixes) == 3 and mixes[0] == {"a": 1, "b": 1, "c": 1}
    assert "the 3 with the most nodes" in note


def _run(*overrides):
    from hetseq_hpc.config import compose_run_config

    return compose_run_config(
        [
            "cluster=testcluster",
            *SMALL_MODEL,
            "trainer.max_steps=200",
            "trainer.checkpoint_every=100",
            "plan.startup_s=30",
            *overrides,
        ]
    )


def _busy_a100(now):
    """A fake Slurm: partition a100 busy for 10 minutes, v100 free."""

    def estimate(cluster):
        late = "a100" in cluster.partitions
        return StartEstimate(now + (600 if late else -5), "fake")

    return estimate


def test_rank_mixes_orders_by_finish_and_picks():
    now = 1_700_000_000.0
    run = _run()
    table, runs = rank_mixes(run, _busy_a100(now), now=now)
    labels = [r.label for r in table.rows]
    assert len(labels) == 5
    free = [r for r in table.rows if "a100" not in r.mix]
    assert labels[:2] == [r.label for r in free]  # v100 alone finishes first
    assert all(r.start_epoch == now for r in free)  # a start in the past counts as now
    finishes = [r.finish_epoch for r in table.rows]
    assert finishes == sorted(finishes)
    for row in table.rows:  # run = start-up + steps x step + 2 checkpoint writes
        assert row.steps == 200 and row.startup_s == 30 and row.checkpoint_s > 0
        assert row.run_s == pytest.approx(30 + 200 * row.step_s + row.checkpoint_s)
        assert row.finish_epoch == pytest.approx(row.start_epoch + row.run_s)
        assert row.gpu_hours == pytest.approx(row.gpus * row.run_s / 3600)
    first = table.pick("finish_first")
    assert first is table.rows[0] and "a100" not in first.mix
    cheap = table.pick("cheapest")
    assert cheap.gpus == 1 and cheap.gpu_hours == min(r.gpu_hours for r in table.rows)
    chosen = runs[first.label].cluster
    assert list(chosen.partitions) == list(first.mix) and chosen.choose == "none"
    assert {k: p.nodes for k, p in chosen.partitions.items()} == first.mix
    text = render_when(table, run)
    assert "start (Slurm)" in text and "GPU-h" in text and first.label in text
    assert "5 of 5 possible mix(es)" in text
    record = json.loads(when_json(table, run))
    assert record["finish_first"] == first.label and len(record["mixes"]) == 5


def test_a_left_out_partition_is_in_no_mix_and_the_table_says_why():
    """plan --when on a cluster where one partition cannot run: the others are ranked, the note
    and the JSON name it with its reason, and the picks line says cluster.choose refuses."""
    now = 1_700_000_000.0
    why = "cluster.partitions.a100.partition='h100' does not exist on this cluster: use a100"
    run = _run()
    table, runs = rank_mixes(run, _busy_a100(now), now=now, left_out={"a100": why})
    assert [r.label for r in table.rows] == ["v100:2", "v100:1"]
    assert all("a100" not in r.mix for r in table.rows) and set(runs) == {"v100:2", "v100:1"}
    assert f"left out partition a100: {why}" in table.note
    text = render_when(table, run)
    assert "cluster.choose refuses while partition(s) a100 cannot run" in text
    assert "~cluster.partitions.a100" in text
    record = json.loads(when_json(table, run))
    assert record["left_out"] == {"a100": why} and record["finish_first"] == "v100:2"
    assert (
        json.loads(when_json(rank_mixes(run, _busy_a100(now), now=now)[0], run))["left_out"] == {}
    )


def test_no_estimate_rows_say_so_and_finish_first_refuses():
    run = _run()
    table, _ = rank_mixes(
        run,
        lambda c: StartEstimate(None, "sbatch --test-only printed no start time: nothing"),
        now=1e9,
    )
    assert all(r.finish_epoch is None for r in table.rows)
    runs = [r.run_s for r in table.rows]
    assert runs == sorted(runs)  # by run time alone
    text = render_when(table, run)
    assert text.count("no start estimate from Slurm") == 5
    assert "Slurm gave no start estimate for any mix" in text and "nothing is guessed" in text
    with pytest.raises(
        ConfigError,
        match=r"cluster.choose=finish_first: Slurm gave no start "
        r"estimate.*sched/backfill.*cheapest",
    ):
        table.pick("finish_first")
    assert table.pick("cheapest").gpus == 1
    assert json.loads(when_json(table, run))["finish_first"] is None


def test_refused_and_unplannable_mixes_go_last():
    def estimate(cluster):
        if list(cluster.partitions) == ["v100"] and cluster.partitions["v100"].nodes == 2:
            return StartEstimate(None, "Requested node configuration is not available", True)
        return StartEstimate(1e9, "fake")

    table, runs = rank_mixes(_run(), estimate, now=1e9)
    assert table.rows[-1].label == "v100:2"
    assert table.rows[-1].problem.startswith("sbatch refused it: Requested node")
    assert "v100:2" not in runs and len(runs) == 4
    # a forced 3-rank allocation: only the full mix can run; the others say why
    run = _run("balance.allocation=[11,11,10]", "trainer.global_batch_size=32")
    table, runs = rank_mixes(run, estimate, now=1e9)
    assert list(runs) == ["a100:1+v100:2"] and table.rows[0].label == "a100:1+v100:2"
    assert all(
        r.problem.startswith("cannot run: balance.allocation=[11, 11, 10] has 3 entries")
        for r in table.rows[1:]
    )
    assert table.pick("finish_first").label == "a100:1+v100:2"
    table, runs = rank_mixes(run, lambda c: StartEstimate(None, "no", True), now=1e9)
    with pytest.raises(
        ConfigError,
        match=r"cluster.choose=cheapest: no mix of the "
        r"partitions can run",
    ):
        table.pick("cheapest")


def test_restrict_run_keeps_only_the_chosen_partitions_precision():
    run = _run("precision.partitions.a100=bf16", "precision.partitions.v100=fp16")
    small = restrict_run(run, {"v100": 1})
    assert list(small.cluster.partitions) == ["v100"] and small.cluster.world_size == 1
    assert small.precision.partitions == {"v100": "fp16"}
    assert run.cluster.world_size == 3  # the original is untouched
    with pytest.raises(ConfigError, match="not a partition"):
        restrict_run(run, {"p100": 1})


def test_choose_and_when_options_are_validated():
    with pytest.raises(
        ConfigError,
        match=r"cluster.choose='fastest' is unknown: use none, "
        r"finish_first or cheapest",
    ):
        _run("cluster.choose=fastest")
    with pytest.raises(ConfigError, match=r"plan.max_mixes=0 is out of range"):
        _run("plan.max_mixes=0")
    with pytest.raises(ConfigError, match=r"plan.startup_s=-1.0 is out of range"):
        _run("plan.startup_s=-1")
    assert _run().cluster.choose == "none" and _run().plan.when is False
    with pytest.raises(ConfigError, match="pick a SLURM cluster"):
        from hetseq_hpc.config import compose_run_config

        rank_mixes(compose_run_config(["cluster=local", *SMALL_MODEL]), _busy_a100(0.0))


def test_duration_format():
    assert duration(0) == "0:00:00" and duration(3725.4) == "1:02:05"
    assert duration(90000) == "1d 1:00:00" and duration(None) == "-"


def test_asked_time_is_the_predicted_run_plus_a_margin_capped_by_the_limit():
    from hetseq_hpc.plan.when import asked_time_min

    assert asked_time_min(60, 720) == 6  # 1 min + the 5-minute floor of the margin
    assert asked_time_min(4 * 3600, 720) == 300  # 4 h + 25 %
    assert asked_time_min(20 * 3600, 720) == 720  # capped by cluster.timeout_min
    assert asked_time_min(0, 1) == 1
    seen = []

    def estimate(cluster):
        seen.append(cluster.timeout_min)
        return StartEstimate(1e9, "fake")

    run = _run("cluster.timeout_min=600")
    table, runs = rank_mixes(run, estimate, now=1e9)
    # Slurm is asked with each mix's own run time + margin, not the configured 600 minutes
    assert sorted(seen) == sorted(r.asked_min for r in table.rows)
    assert all(
        m == asked_time_min(r.run_s, 600) < 600
        for m, r in zip([r.asked_min for r in table.rows], table.rows)
    )
    # the run that would be submitted keeps the configured limit
    assert all(r.cluster.timeout_min == 600 for r in runs.values())
    record = json.loads(when_json(table, run))
    assert all(m["asked_time_min"] == r.asked_min for m, r in zip(record["mixes"], table.rows))
    assert "asked --time=" in render_when(table, run)


def test_a_mix_over_the_time_limit_is_listed_last_and_never_picked():
    now = 1_700_000_000.0
    run = _run()
    table, _ = rank_mixes(run, _busy_a100(now), now=now)
    fastest = min(table.rows, key=lambda r: r.finish_epoch)
    fastest.over_limit = True  # as if its run were longer than cluster.timeout_min
    from hetseq_hpc.plan.when import _order

    table.rows.sort(key=_order)
    assert table.rows[-1] is fastest
    assert table.pick("finish_first") is not fastest
    assert table.pick("cheapest") is not fastest
    assert "not picked" in render_when(table, run)
    for row in table.rows:
        row.over_limit = True
    with pytest.raises(
        ConfigError,
        match=r"every mix is predicted to run longer than "
        r"cluster.timeout_min.*raise cluster.timeout_min",
    ):
        table.pick("finish_first")


def test_over_limit_comes_from_the_predicted_run_and_the_configured_limit():
    table, _ = rank_mixes(
        _run("trainer.max_steps=100000000", "cluster.timeout_min=1"),
        lambda c: StartEstimate(1e9, "fake"),
        now=1e9,
    )
    assert all(r.over_limit and r.asked_min == 1 for r in table.rows)
    with pytest.raises(ConfigError, match="every mix is predicted to run longer"):
        table.pick("cheapest")
