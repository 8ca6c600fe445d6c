"""Time to result against the real Slurm test cluster: with partition a100 kept busy by a
blocker job of a known time limit, ``hetseq-hpc plan --when`` ranks the mixes by Slurm's start
estimate (backfill, ``sbatch --test-only``) + predicted run time; every candidate is then
submitted for real, and the pick finishes first. ``cluster.choose=finish_first`` submits the
pick itself.

The candidates: a100 1 node, v100 1 node, both (``cluster=testcluster`` with v100 at 1 node:
three mixes, so that the whole test stays near 90 s: a 1-minute blocker, then tiny BERT jobs of
4 steps). Predicted and actual start and finish of each are printed (``pytest -s``).

A second test makes the run time decide: with v100 busy, the a100 + v100 mix waits but is
predicted minutes faster over 2000 BERT-base steps, so it is picked over a100 alone, which
starts at once (the jobs are not run to the end there: they would take hours on CPU nodes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from tests.helpers.runs import SMALL_MODEL, assert_ok, hetseq, read_rows
from tests.helpers.slurm import slurm_cli, squeue_state
from tests.helpers.waits import wait_for

#: the blocker's limit (minutes; Slurm's smallest) and how long it really sleeps (seconds)
BLOCK_MIN, BLOCK_SLEEP_S = 1, 55
#: the same for the waiting mix's test, whose pick needs the blocker's remaining time at the
#: moment `plan --when` asks Slurm between 20 s and ~150 s (the two mixes' predicted runs
#: differ by ~150 s): 2 minutes keep that for a plan that takes up to 100 s to ask (~50 s on
#: a loaded 2-core VM, where 1 minute left 10 s); the blocker is cancelled, never waited for
WAIT_BLOCK_MIN, WAIT_BLOCK_SLEEP_S = 2, 115
SHORT = [
    *SMALL_MODEL,
    "cluster.partitions.v100.nodes=1",
    "trainer.max_steps=4",
    "optim.warmup_steps=1",
    "trainer.val_every=0",
    "plan.startup_s=10",
    "cluster.timeout_min=5",
]


def _times(job_id: str):
    """``(state, start, end)`` of a (het) job from squeue, epoch seconds: the latest start and
    end of its components (jobs stay listed for MinJobAge)."""
    env = dict(os.environ, SLURM_TIME_FORMAT="standard")
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%S|%e"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]

    def epoch(text):
        try:
            return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None

    starts = [epoch(r[1]) for r in rows]
    ends = [epoch(r[2]) for r in rows]
    return (
        squeue_state(job_id),
        max(starts) if None not in starts and starts else None,
        max(ends) if None not in ends and ends else None,
    )


def _mix_overrides(mix):
    """Overrides that restrict cluster=testcluster (+ SHORT) to ``mix``."""
    out = [f"cluster.partitions.{k}.nodes={n}" for k, n in mix.items()]
    return out + [f"~cluster.partitions.{k}" for k in ("a100", "v100") if k not in mix]


def _clock(epoch):
    return "-" if epoch is None else time.strftime("%H:%M:%S", time.localtime(epoch))


@pytest.mark.slurm
@pytest.mark.slow
def test_plan_when_pick_finishes_first_and_choose_submits_it(tmp_path, token_cache):
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "a100",
            "-N2",
            "--exclusive",
            f"--time={BLOCK_MIN}",
            "-o",
            str(tmp_path / "blocker.out"),
            "--wrap",
            f"sleep {BLOCK_SLEEP_S}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip().split(";")[0]
    jobs = {}
    try:
        wait_for(
            lambda: squeue_state(blocker_id) == "RUNNING",
            "the blocker job did not start",
            60,
            poll_s=0.5,
        )
        plan = hetseq(
            "plan", "--when", "cluster=testcluster", *SHORT, token_cache=token_cache, timeout=300
        )
        assert_ok(plan)
        table = json.loads(plan.stdout.strip().splitlines()[-1])
        rows = {m["label"]: m for m in table["mixes"]}
        # v100 first; a100:1 and a100:1+v100:1 both wait for the blocker and are predicted to
        # finish within milliseconds of each other (10 s runs): their order is not the point
        assert next(iter(rows)) == "v100:1" and set(rows) == {
            "v100:1",
            "a100:1",
            "a100:1+v100:1",
        }, plan.stdout
        assert table["finish_first"] == "v100:1", plan.stdout
        asked = table["asked_at"]
        assert rows["v100:1"]["start"] - asked < 10  # v100 is free: now
        for label in ("a100:1", "a100:1+v100:1"):  # a100 waits for the blocker's time limit
            assert rows[label]["start"] - asked > 20, plan.stdout
            assert rows[label]["finish"] > rows["v100:1"]["finish"]
        assert "no start estimate" not in plan.stdout

        # cluster.choose=finish_first submits the pick; the others are submitted as they are
        chosen = slurm_cli(
            tmp_path / "chosen", token_cache, *SHORT, "cluster.choose=finish_first", timeout=300
        )
        assert_ok(chosen)
        assert re.search(r"cluster.choose=finish_first: submitting v100:1 ", chosen.stdout)
        assert re.search(r"submitted het job \d+: 1 ranks over v100", chosen.stdout)
        when = json.loads((tmp_path / "chosen" / "when.json").read_text())
        assert when["chosen"] == "v100:1" and when["choose"] == "finish_first"
        info = json.loads((tmp_path / "chosen" / "job.json").read_text())
        assert info["partitions"] == ["v100"]
        saved = (tmp_path / "chosen" / "hetseq_config.yaml").read_text()
        assert "choose: none" in saved and "a100:" not in saved.split("partitions:")[1]
        jobs["v100:1"] = str(info["job_id"])
        dirs = {"v100:1": tmp_path / "chosen"}
        for label in ("a100:1", "a100:1+v100:1"):
            mix = rows[label]["mix"]
            run_dir = tmp_path / label.replace(":", "").replace("+", "_")
            proc = slurm_cli(run_dir, token_cache, *SHORT, *_mix_overrides(mix), timeout=300)
            assert_ok(proc)
            jobs[label] = str(json.loads((run_dir / "job.json").read_text())["job_id"])
            dirs[label] = run_dir

        actual = {}

        def all_ended() -> bool:
            for label, job_id in jobs.items():
                state, start, end = _times(job_id)
                if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                    actual[label] = (state, start, end)
            return len(actual) == len(jobs)

        wait_for(all_ended, lambda: f"jobs did not finish: {actual}", 240, poll_s=1)
    finally:
        subprocess.run(["scancel", blocker_id, *jobs.values()], capture_output=True)

    print("\nmix            predicted start/finish    actual start/finish   state")
    for label in rows:
        row, (state, start, end) = rows[label], actual[label]
        print(
            f"{label:14s} {_clock(row['start'])} / {_clock(row['finish'])}   "
            f"{_clock(start)} / {_clock(end)}   {state}"
        )
    assert all(state == "COMPLETED" for state, _, _ in actual.values()), actual
    for label, run_dir in dirs.items():  # each candidate really trained its 4 steps
        assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4], label
    first_end = actual["v100:1"][2]
    assert all(first_end < end for label, (_, _, end) in actual.items() if label != "v100:1"), (
        actual
    )
    for label in ("a100:1", "a100:1+v100:1"):  # they waited for the blocker, as Slurm said
        assert actual[label][1] >= actual["v100:1"][1]


#: BERT-base for 2000 steps: the run time (minutes), not the queue, decides the pick
BASE = [
    "task.model.hidden_size=768",
    "task.model.num_layers=12",
    "task.model.num_heads=12",
    "task.model.intermediate_size=3072",
    "task.model.max_seq_len=128",
    "trainer.global_batch_size=256",
    "trainer.max_steps=2000",
    "trainer.val_every=0",
    "cluster.partitions.v100.nodes=1",
    "plan.startup_s=10",
    "cluster.timeout_min=600",
]


@pytest.mark.slurm
@pytest.mark.slow
def test_plan_when_picks_a_mix_that_waits_when_its_run_is_enough_shorter(tmp_path, token_cache):
    """With partition v100 busy for two minutes, a100 alone starts now but the a100 + v100 mix,
    predicted minutes faster on 2000 BERT-base steps, finishes first even after waiting: the
    pick is decided by start estimate + run time, not by who starts first. ``cheapest`` stays
    a100 alone. ``cluster.choose=finish_first`` submits the waiting mix (cancelled at once:
    2000 BERT-base steps would take hours on these CPU nodes)."""
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "v100",
            "-N2",
            "--exclusive",
            f"--time={WAIT_BLOCK_MIN}",
            "-o",
            str(tmp_path / "blocker.out"),
            "--wrap",
            f"sleep {WAIT_BLOCK_SLEEP_S}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id, submitted = blocker.stdout.strip().split(";")[0], []
    try:
        wait_for(
            lambda: squeue_state(blocker_id) == "RUNNING",
            "the blocker job did not start",
            60,
            poll_s=0.5,
        )
        cmd = ["cluster=testcluster", *BASE]
        plan = hetseq("plan", "--when", *cmd, token_cache=token_cache, timeout=300)
        assert_ok(plan)
        table = json.loads(plan.stdout.strip().splitlines()[-1])
        rows = {m["label"]: m for m in table["mixes"]}
        both, alone, asked = rows["a100:1+v100:1"], rows["a100:1"], table["asked_at"]
        assert alone["start"] - asked < 10 and both["start"] - asked > 20, plan.stdout
        assert both["run_s"] < alone["run_s"] and both["finish"] < alone["finish"], plan.stdout
        assert table["finish_first"] == "a100:1+v100:1" and table["cheapest"] == "a100:1"
        assert next(iter(rows)) == "a100:1+v100:1", plan.stdout  # sorted by expected finish

        run_dir = tmp_path / "chosen"
        chosen = hetseq(
            *cmd,
            "cluster.choose=finish_first",
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
            timeout=300,
        )
        assert_ok(chosen)
        info = json.loads((run_dir / "job.json").read_text())
        submitted.append(str(info["job_id"]))
        assert re.search(r"cluster.choose=finish_first: submitting a100:1\+v100:1 ", chosen.stdout)
        assert sorted(info["partitions"]) == ["a100", "v100"]
    finally:
        subprocess.run(["scancel", blocker_id, *submitted], capture_output=True)


@pytest.mark.slurm
def test_plan_when_leaves_out_a_partition_the_cluster_lacks_and_choose_refuses_it(
    tmp_path, token_cache
):
    """A partition that sinfo does not list (``t4`` on the test cluster): ``plan --when`` ranks
    the mixes of the others and names it with the reason; ``cluster.choose=finish_first``, which
    would submit, refuses in one line and submits nothing."""
    t4 = "+cluster.partitions.t4={partition: t4, gpu_type: t4, nodes: 1, gpus_per_node: 1}"
    plan = hetseq(
        "plan", "--when", "cluster=testcluster", *SHORT, t4, token_cache=token_cache, timeout=300
    )
    assert_ok(plan)
    table = json.loads(plan.stdout.strip().splitlines()[-1])
    assert {m["label"] for m in table["mixes"]} == {"a100:1", "v100:1", "a100:1+v100:1"}
    assert "partition='t4' does not exist on this cluster" in table["left_out"]["t4"]
    assert "left out partition t4" in plan.stdout and "cluster.choose refuses" in plan.stdout

    before = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    run_dir = tmp_path / "chosen"
    chosen = slurm_cli(
        run_dir,
        token_cache,
        *SHORT[len(SMALL_MODEL) :],
        t4,
        "cluster.choose=finish_first",
        timeout=300,
    )
    assert chosen.returncode == 2, chosen.stdout + chosen.stderr
    error = chosen.stderr.strip().splitlines()
    assert len(error) == 1 and "partition='t4' does not exist" in error[0], chosen.stderr
    assert not (run_dir / "job.json").exists()
    after = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    assert set(after) <= set(before)  # nothing submitted
