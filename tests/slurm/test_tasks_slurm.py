"""Each new task once as a real heterogeneous SLURM job on the test cluster (cluster=testcluster:
a100 + v100 partitions, 3 ranks; scripts/test-cluster.sh). The nodes have no CUDA: ranks run on
CPU with gloo, the GPUs are the only thing faked. Tiny models and 6 steps: the point is that
the task's data, model, metrics and (for task=custom) the import of the user's module work on
the compute nodes."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import hetseq, read_rows
from tests.helpers.tasks import METRIC, SUMMARY_NAME, task_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.parametrize("name", ["image", "translation", "custom"])
def test_task_runs_as_a_het_job(name, tmp_path, token_cache, task_data_files):
    proc = hetseq(
        "cluster=testcluster",
        "cluster.wait=true",
        *task_overrides(name, task_data_files),
        "trainer.max_steps=6",
        "trainer.val_every=0",
        "trainer.global_batch_size=24",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["partition"] for r in rows[-1]["ranks"]] == ["a100", "v100", "v100"]
    assert METRIC[name] in rows[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["task"]["name"] == SUMMARY_NAME[name] and summary["world_size"] == 3
