"""The planner's command line (python -m hetseq_hpc.plan) end to end: the table and JSON of a
plan, one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.runs import hetseq


def _plan_cli(*args, timeout=120):
    return hetseq(*args, module="hetseq_hpc.plan", timeout=timeout)


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
    proc = _plan_cli("cluster=mixed", "task=bert", "cluster.partitions.t4.gpu_type=k80", timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert (
        "k80" in lines[0] and "a100" in lines[0] and lines[0].startswith("hetseq-hpc plan: error:")
    )
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "option, key",
    [
        ("plan.link_gbps=0", "plan.link_gbps"),
        ("plan.overlap=half", "plan.overlap"),
        ("plan.probe={tmp}/no-such-run/allocation.json", "plan.probe"),
    ],
)
def test_bad_plan_option_is_one_line_and_exit_2(tmp_path, option, key):
    proc = _plan_cli("cluster=mixed", "task=bert", option.format(tmp=tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"hetseq-hpc plan: error: {key}"), lines[0]
    assert proc.stdout == ""


# ------------------------------------------------------------------ time to result (plan --when)
def _hetseq(*args, env=None, timeout=120):
    return hetseq(*args, env=env, timeout=timeout)


def _no_slurm_env():
    """This environment with no Slurm commands on PATH (the interpreter is called by path)."""
    env = dict(os.environ, PATH="/nonexistent")
    env.pop("SLURM_CONF", None)
    return env


def test_plan_when_needs_a_slurm_cluster_and_slurm():
    proc = _hetseq("plan", "--when", "cluster=local")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "pick a SLURM cluster" in proc.stderr
    proc = _hetseq("plan", "cluster=mixed", "task=bert", "plan.when=true", env=_no_slurm_env())
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Slurm is not available here (sbatch, srun, squeue, sinfo not found)" in proc.stderr
    # the planner's own module never asks Slurm: it says which command does
    proc = _plan_cli("cluster=mixed", "plan.when=true", timeout=60)
    assert proc.returncode == 2 and "run hetseq-hpc plan --when" in proc.stderr, proc.stderr


def _dead_controller_env(tmp_path):
    """The real Slurm client commands with a slurm.conf whose controller does not listen (a
    closed port on this host): sinfo fails in about a second with "Unable to contact slurm
    controller (connect failure)"."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\n"
        "SlurmctldPort=1\nMessageTimeout=2\nNodeName=n1 CPUs=1 State=UNKNOWN\n"
        "PartitionName=a100 Nodes=n1 Default=YES State=UP\n"
    )
    return dict(os.environ, SLURM_CONF=str(conf))


@pytest.mark.skipif(
    shutil.which("sinfo") is None or shutil.which("sbatch") is None,
    reason="the Slurm client commands are not installed (scripts/test-cluster.sh installs them)",
)
def test_plan_when_with_an_unreachable_controller_is_one_line_before_any_sbatch(tmp_path):
    """Slurm's commands exist but slurmctld does not answer: sinfo is asked once first, so
    `plan --when` says so in one line (it printed a table of 17 mixes, each "sbatch refused
    it: <the same error>", and exit 0), and `run cluster.choose=...` submits nothing and
    leaves no run directory."""
    env = _dead_controller_env(tmp_path)
    proc = _hetseq("plan", "--when", "cluster=mixed", "task=bert", env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "sinfo failed (" in line and "Unable to contact slurm controller" in line, line
    assert line.endswith("is slurmctld reachable (scontrol ping)?") and "refused" not in line
    assert "sbatch" not in proc.stdout
    run_dir = tmp_path / "run"
    proc = _hetseq(
        "run",
        "cluster=mixed",
        "task=bert",
        "cluster.choose=finish_first",
        f"hydra.run.dir={run_dir}",
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Unable to contact slurm controller" in proc.stderr.strip().splitlines()[-1]
    assert not run_dir.exists()


def test_choose_without_slurm_submits_nothing_and_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = _hetseq(
        "run",
        "cluster=mixed",
        "task=bert",
        "cluster.choose=finish_first",
        f"hydra.run.dir={run_dir}",
        env=_no_slurm_env(),
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("hetseq-hpc: error: Slurm is not available here")
    ), proc.stderr
    assert not run_dir.exists()


def test_test_only_asks_sbatch_with_the_launchers_script(tmp_path, monkeypatch):
    """``test_only_start`` runs ``sbatch --test-only`` on the het-job script the launcher renders,
    with Slurm's standard time format, and reads its answer (a stand-in sbatch on PATH prints
    the line the real one printed on the test cluster)."""
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.launch.sbatch import render_sbatch
    from hetseq_hpc.launch.test_only import test_only_start

    seen = tmp_path / "seen"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\necho "$1 $SLURM_TIME_FORMAT" > {seen}.args\ncp "$2" {seen}.sh\n'
        "echo 'sbatch: Job 5 to start at 2026-11-25T04:48:32 using 3 processors on "
        "n[1,3-4]' >&2\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    cluster = compose_run_config(["cluster=testcluster", "cluster.folder=/shared/sub"]).cluster
    est = test_only_start(cluster, python="/usr/bin/python3")
    assert (tmp_path / "seen.args").read_text().split() == ["--test-only", "standard"]
    assert (tmp_path / "seen.sh").read_text() == render_sbatch(
        cluster, "/shared/sub", "/usr/bin/python3"
    )
    assert est.start_epoch is not None and "n[1,3-4]" in est.detail and not est.refused
