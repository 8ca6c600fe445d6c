"""The test cluster script's settings (scripts/test-cluster.sh): a bad value is refused before
anything is installed, started or created."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers.runs import REPO


@pytest.mark.parametrize("value", ["3", "5s", "-1"])
def test_a_bad_slurmd_timeout_is_one_line_and_starts_nothing(value, tmp_path):
    """``HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT`` (the partition drills' clusters use Slurm's default
    300 s, scripts/partition_drills.py) must be whole seconds >= 5: anything else is one line
    naming the value and an example, exit 1, and no state directory."""
    state = tmp_path / "c"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSEQ_TESTCLUSTER")}
    env.update(HETSEQ_TESTCLUSTER_DIR=str(state), HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT=value)
    script = str(REPO / "scripts" / "test-cluster.sh")
    start = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=60)
    assert start.returncode == 1, start.stderr
    assert start.stderr.strip().splitlines() == [
        "test-cluster.sh: HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT must be a whole number of seconds "
        f">= 5 (got '{value}'), e.g. 300"
    ]
    assert start.stdout == "" and not state.exists()
