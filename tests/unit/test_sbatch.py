"""cluster=testcluster without Slurm: the het-job script is pinned by a golden file, values that
would break out of an sbatch line are refused, the watcher folds het components.
(tests/integration/test_slurm_cli.py: the command line without a cluster;
tests/slurm/test_slurm.py: against the real Slurm test cluster.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm import HetSlurmInfoWatcher
from tests.helpers.slurm import compose_testcluster

GOLDEN = Path(__file__).parent.parent / "golden" / "testcluster.sbatch"


# ------------------------------------------------------------------ no Slurm needed
def test_sbatch_text_matches_golden_file():
    """The rendered het-job script is pinned (regenerate: HETSEQ_REGEN_GOLDEN=1)."""
    run = compose_testcluster()
    text = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON")
    if os.environ.get("HETSEQ_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert text.count("#SBATCH hetjob") == 1
    assert "--het-group=0-1" in text and "--gres=gpu:v100:1" in text


@pytest.mark.parametrize("bad", ["a100\nq", "a100\n#SBATCH --qos=high", "`id`", "a'b"])
def test_sbatch_values_with_newlines_or_quotes_are_rejected(bad):
    from hetseq_hpc.config.schema import PartitionConfig
    from hetseq_hpc.errors import ConfigError

    with pytest.raises(ConfigError, match="not allowed in an sbatch script"):
        PartitionConfig(partition=bad).validate("a100")
    with pytest.raises(ConfigError):
        PartitionConfig(partition="a100", extra_sbatch={"exclude": bad}).validate("a100")


def test_watcher_folds_het_components():
    watcher = HetSlurmInfoWatcher()
    info = watcher.read_info("12+0|RUNNING\n12+1|PENDING\n13+0|COMPLETED\n13+1|CANCELLED\n"
                             "14+0|COMPLETED\n14+1|COMPLETED\n15|FAILED\n")
    assert {k: v["State"] for k, v in info.items()} == {
        "12": "PENDING", "13": "CANCELLED", "14": "COMPLETED", "15": "FAILED"}
