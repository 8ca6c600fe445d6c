"""cluster=testcluster on the command line, with no Slurm needed: a dry run writes the script and
submits nothing, an unsafe partition name is refused, and a machine without Slurm is told so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.runs import assert_ok, cli_env, hetseq
from tests.helpers.slurm import compose_testcluster, slurm_cli


def test_dry_run_writes_the_script_and_submits_nothing(tmp_path, token_cache):
    proc = slurm_cli(tmp_path, token_cache, "cluster.dry_run=true")
    assert_ok(proc)
    script = (tmp_path / "job.sbatch").read_text()
    # a DDP run with trainer.elastic on (the default): the script serves the job's store, its
    # step survives a task's death, and it exits 0 when the survivors finished the run
    assert script == render_sbatch(
        compose_testcluster().cluster,
        str(tmp_path / "submitit"),
        sys.executable,
        elastic=True,
        run_dir=RunDir(tmp_path.resolve()),
    )
    assert "--kill-on-bad-exit=0 --no-kill" in script and "store_server" in script
    assert f"{tmp_path.resolve()}/summary.json" in script
    assert not (tmp_path / "job.json").exists()
    assert (tmp_path / "hetseq_config.yaml").is_file()


@pytest.mark.parametrize("bad", ["a100;rm -rf ~", "a100$(id)", "a100 b"])
def test_unsafe_partition_name_is_rejected(tmp_path, token_cache, bad):
    proc = slurm_cli(
        tmp_path, token_cache, f"cluster.partitions.a100.partition='{bad}'", "cluster.dry_run=true"
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("hetseq-hpc: error: cluster.partitions.a100.partition=")
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "job.json").exists()


def test_missing_slurm_says_what_and_suggests_local(tmp_path, token_cache):
    env = cli_env(token_cache)
    env["PATH"] = str(Path(sys.executable).parent)  # python only: no sbatch, srun, sinfo
    proc = hetseq("cluster=testcluster", f"hydra.run.dir={tmp_path}", env=env, timeout=300)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "sbatch" in line and "cluster=local" in line, line
    assert not (tmp_path / "job.json").exists()
