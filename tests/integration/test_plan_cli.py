"""The planner's command line (python -m hetseq_hpc.plan) end to end: the table and JSON of a
plan, one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO


def _plan_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetseq_hpc.plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_mixed_prints_table_and_json():
    proc = _plan_cli("cluster=mixed", "task=bert")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    for part in ("a100", "v100", "t4"):
        assert any(line.startswith(part) for line in out), proc.stdout
    assert "micro x acc" in proc.stdout and "efficiency" in proc.stdout
    head = json.loads(out[-1])
    assert head["world_size"] == 16
    assert 0 < head["efficiency"] <= 1
    assert head["predicted_samples_per_s"] <= head["ideal_samples_per_s"]
    for key in ("equal_split_samples_per_s", "speedup_vs_equal", "allreduce_share"):
        assert key in head


def test_unknown_gpu_type_is_one_line_and_exit_2():
    proc = _plan_cli("cluster=mixed", "task=bert", "cluster.partitions.t4.gpu_type=k80",
                     timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "k80" in lines[0] and "a100" in lines[0] and lines[0].startswith("hetseq-hpc plan: error:")
    assert proc.stdout == ""


@pytest.mark.parametrize("option, key", [
    ("plan.link_gbps=0", "plan.link_gbps"),
    ("plan.overlap=half", "plan.overlap"),
    ("plan.probe={tmp}/no-such-run/allocation.json", "plan.probe"),
])
def test_bad_plan_option_is_one_line_and_exit_2(tmp_path, option, key):
    proc = _plan_cli("cluster=mixed", "task=bert", option.format(tmp=tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"hetseq-hpc plan: error: {key}"), lines[0]
    assert proc.stdout == ""
