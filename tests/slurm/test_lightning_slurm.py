"""A LightningModule with HetSeqStrategy as a real heterogeneous Slurm job: ``hetseq-hpc run
cluster=testcluster cluster.command=[python, script]`` runs the user's script on every task
(two het components, three ranks; the nodes have no CUDA, so gloo on CPU), the strategy reads
the het job through HetJobEnvironment (Lightning's own SLURMEnvironment names the wrong master
and refuses the task layout: docs/integrations.md), and the per-step global losses match a
1-rank run of the same script to 1e-6."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.optional import import_or_skip
from tests.helpers.runs import REPO

import_or_skip("lightning", "lightning")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "scripts" / "lightning_run.py"


def test_a_lightning_script_runs_as_a_het_job_and_matches_one_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    one = tmp_path / "one.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "1", "--out", str(one)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "het.json"
    command = [sys.executable, str(SCRIPT), "--devices", "1", "--out", str(out)]
    proc = subprocess.run(
        [
            sys.executable, "-m", "hetseq_hpc", "run", "cluster=testcluster", "cluster.wait=true",
            f"cluster.command=[{','.join(command)}]", f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    het, ref = json.loads(out.read_text()), json.loads(one.read_text())
    assert het["world"] == 3 and het["het_size"] == 2
    assert het["environment"] == "HetJobEnvironment"
    assert sorted(het["losses"]) == sorted(ref["losses"]) and len(ref["losses"]) == 12
    for step, loss in het["losses"].items():
        assert loss == pytest.approx(ref["losses"][step], rel=1e-6), step
    assert (tmp_path / "run" / "logs" / "rank2.log").is_file()  # each task's output, kept
