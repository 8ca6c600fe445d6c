"""Issue 27, "the first hour", on the real Slurm test cluster: a second test cluster (another
clone's scripts/run-tests.sh) runs beside this suite's and stopping it leaves ours alone, and
a job waited for (``cluster.wait=true``) ends with the same summary line a local run prints."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.runs import REPO
from tests.helpers.slurm import slurm_cli

SCRIPT = REPO / "scripts" / "test-cluster.sh"


def _slurm(conf: str, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": conf}
    return subprocess.run(
        list(cmd),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
    )


def _ctld_port(conf: str) -> str:
    return next(
        line.split("=", 1)[1]
        for line in Path(conf).read_text().splitlines()
        if line.startswith("SlurmctldPort=")
    )


def _answers(conf: str) -> None:
    """The cluster of ``conf`` answers and runs a job on a node of each partition."""
    info = _slurm(conf, "sinfo", "-h", "-o", "%P %T")
    assert info.returncode == 0 and "a100" in info.stdout and "v100" in info.stdout, info
    job = _slurm(
        conf,
        "srun",
        "-p",
        "v100",
        "-N1",
        "bash",
        "-c",
        "echo $SLURMD_NODENAME; getent hosts $SLURMD_NODENAME",
        timeout=120,
    )
    assert job.returncode == 0 and job.stdout.split()[0] in ("n3", "n4"), job


@pytest.mark.slurm
def test_a_second_test_cluster_runs_beside_ours_and_its_stop_leaves_ours_alone():
    """What a second clone's ``scripts/run-tests.sh`` does while this suite's cluster runs:
    its own state directory and free ports; both answer; stopping it keeps ours (daemons,
    munge, the n1..n4 names) working."""
    ours = os.environ["SLURM_CONF"]
    second_dir = tempfile.mkdtemp(prefix="hetseq-testcluster-2nd.", dir="/tmp")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HETSEQ_TESTCLUSTER") and k != "SLURM_CONF"
    }
    env["HETSEQ_TESTCLUSTER_DIR"] = second_dir
    try:
        start = subprocess.run(
            [str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300
        )
        assert start.returncode == 0, start.stderr[-3000:]
        second = start.stdout.strip().splitlines()[-1].split("=", 1)[1]
        assert second == f"{second_dir}/etc/slurm.conf" and second != ours
        assert _ctld_port(second) != _ctld_port(ours)
        _answers(second)
        _answers(ours)
    finally:
        stop = subprocess.run(
            [str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=300
        )
        shutil.rmtree(second_dir, ignore_errors=True)
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert _slurm(second, "scontrol", "ping").returncode != 0  # the second one is gone
    assert "is UP" in _slurm(ours, "scontrol", "ping").stdout
    munge = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True)
    assert munge.returncode == 0, munge.stderr
    assert second_dir not in Path("/etc/hosts").read_text()
    _answers(ours)


@pytest.mark.slurm
def test_a_waited_slurm_job_ends_with_the_summary_line(tmp_path, token_cache):
    proc = slurm_cli(
        tmp_path, token_cache, "cluster.wait=true", "trainer.max_steps=3", "trainer.val_every=0"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "done: 3 steps, loss " in out and " samples/s" in out, out[-3000:]
    assert f"metrics: {tmp_path / 'metrics.jsonl'}" in out
    assert f"plot: {tmp_path / 'ranks.png'}" in out
