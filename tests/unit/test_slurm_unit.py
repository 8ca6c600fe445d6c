"""The SLURM middle layer without a Slurm cluster: ``subprocess`` is replaced at the Slurm-command
boundary only (sinfo, squeue, sacct, scontrol answer with recorded text, as submitit's own tests
patch ``subprocess``); everything above it is the real code. The rendered sbatch script is
checked against hostile values that bypass config validation (defence in depth)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import List

import pytest
from submitit.core import utils as submitit_utils

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config.schema import PartitionConfig
from hetseq_hpc.env.preemption import requeue_job
from hetseq_hpc.errors import ConfigError, LaunchError
from hetseq_hpc.launch import slurm_checks, slurm_watch
from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm import launch_slurm
from hetseq_hpc.launch.slurm_checks import (
    check_partitions,
    parse_inventory,
    partition_inventory,
    partition_problems,
    slurm_minutes,
)
from hetseq_hpc.launch.slurm_watch import HetSlurmInfoWatcher, wait_for_job
from hetseq_hpc.rundir.paths import RunDir

#: ``sinfo -h -N -o '%R|%N|%G|%c|%l'`` of the project's test cluster (recorded)
SINFO_TESTCLUSTER = """a100|n1|gpu:a100:2|4|infinite
a100|n2|gpu:a100:2|4|infinite
v100|n3|gpu:v100:2|4|infinite
v100|n4|gpu:v100:2|4|infinite
"""
#: a production-like cluster: MaxTime 2 days on gpu, 30 min on debug; one big node
SINFO_LIMITS = """gpu|g1|gpu:a100:4(S:0-1)|64|2-00:00:00
gpu|g2|gpu:a100:4(S:0-1)|64|2-00:00:00
gpu|g3|gpu:a100:8|128|2-00:00:00
debug|d1|(null)|8|30:00
"""


class FakeSlurm:
    """``subprocess.run`` stand-in: answers Slurm commands from a table, records every call."""

    def __init__(self, **answers):
        self.answers = answers  # command name -> (returncode, stdout, stderr)
        self.calls: List[List[str]] = []

    def __call__(self, cmd, *args, **kwargs):
        self.calls.append(list(cmd))
        if cmd[0] not in self.answers:
            raise AssertionError(f"unexpected command {cmd}")
        code, out, err = self.answers[cmd[0]]
        if isinstance(code, Exception):
            raise code
        return subprocess.CompletedProcess(cmd, code, out, err)

    def ran(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


@pytest.fixture
def testcluster():
    return compose_run_config(["cluster=testcluster"])


def _fake(monkeypatch, **answers) -> FakeSlurm:
    fake = FakeSlurm(**answers)
    monkeypatch.setattr(subprocess, "run", fake)
    return fake


# ------------------------------------------------------------------ partition pre-checks
def test_inventory_from_sinfo(monkeypatch):
    fake = _fake(monkeypatch, sinfo=(0, SINFO_LIMITS, ""))
    inv = partition_inventory()
    assert fake.calls == [["sinfo", "-h", "-N", "-o", "%R|%N|%G|%c|%l"]]
    assert inv["gpu"]["nodes"] == 3 and inv["gpu"]["cpus"] == [64, 64, 128]
    assert inv["gpu"]["max_time_min"] == 2880 and inv["debug"]["max_time_min"] == 30
    assert inv["debug"]["gres"] == ["(null)"]


@pytest.mark.parametrize(
    "answer, fragment",
    [
        ((1, "", "slurm_load_partitions: Unable to contact slurm controller"), "Unable to contact"),
        ((OSError("No such file or directory: 'sinfo'"), "", ""), "could not run"),
    ],
)
def test_sinfo_failure_is_a_launch_error(monkeypatch, answer, fragment):
    _fake(monkeypatch, sinfo=answer)
    with pytest.raises(LaunchError, match=fragment):
        partition_inventory()


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("infinite", None),
        ("UNLIMITED", None),
        ("30", 30),
        ("30:00", 30),
        ("1:30:00", 90),
        ("2-00:00:00", 2880),
        ("1-12", 2160),
        ("1-00:30", 1470),
        ("n/a", None),
    ],
)
def test_slurm_time_strings(text, minutes):
    assert slurm_minutes(text) == minutes


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["cluster.partitions.a100.partition=h100"],
            "cluster.partitions.a100.partition='h100' does not exist",
        ),
        (
            ["cluster.partitions.v100.nodes=3"],
            "cluster.partitions.v100.nodes=3 but partition 'v100' has 2",
        ),
        (["cluster.partitions.a100.gpu_type=t4"], "cluster.partitions.a100.gpu_type='t4'"),
        (
            ["cluster.partitions.a100.cpus_per_rank=8"],
            "cluster.partitions.a100.cpus_per_rank=8 needs 8 CPUs",
        ),
        (
            ["cluster.partitions.v100.gpus_per_node=2", "cluster.partitions.v100.cpus_per_rank=3"],
            "cluster.partitions.v100.cpus_per_rank=3 needs 6 CPUs per node (2 rank(s) per node)",
        ),
    ],
)
def test_precheck_refuses_what_the_cluster_cannot_run(overrides, fragment):
    run = compose_run_config(["cluster=testcluster", *overrides])
    with pytest.raises(ConfigError) as info:
        check_partitions(run.cluster, parse_inventory(SINFO_TESTCLUSTER))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_partition_problems_lists_every_partition_that_cannot_run():
    """plan --when leaves out each partition that cannot run, so all of them are named, each in
    one line; check_partitions (run, cluster.choose) raises the first."""
    run = compose_run_config(
        [
            "cluster=testcluster",
            "cluster.partitions.a100.partition=h100",
            "cluster.partitions.v100.nodes=3",
        ]
    )
    problems = partition_problems(run.cluster, parse_inventory(SINFO_TESTCLUSTER))
    assert list(problems) == ["a100", "v100"]
    assert "cluster.partitions.a100.partition='h100' does not exist" in problems["a100"]
    assert "cluster.partitions.v100.nodes=3 but partition 'v100' has 2" in problems["v100"]
    assert all("\n" not in p for p in problems.values())
    with pytest.raises(ConfigError, match="partition='h100' does not exist"):
        check_partitions(run.cluster, parse_inventory(SINFO_TESTCLUSTER))
    ok = compose_run_config(["cluster=testcluster"])
    assert partition_problems(ok.cluster, parse_inventory(SINFO_TESTCLUSTER)) == {}


def test_precheck_accepts_the_test_cluster(testcluster):
    check_partitions(testcluster.cluster, parse_inventory(SINFO_TESTCLUSTER))


def test_timeout_above_partition_max_time_is_refused():
    run = compose_run_config(
        [
            "cluster=testcluster",
            "cluster.timeout_min=4000",
            "cluster.partitions.a100.partition=gpu",
            "cluster.partitions.v100.partition=gpu",
            "cluster.partitions.v100.gpu_type=a100",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"cluster.timeout_min=4000 exceeds partition 'gpu'.*"
        r"2880 minutes.*cluster.timeout_min<=2880",
    ):
        check_partitions(run.cluster, parse_inventory(SINFO_LIMITS))


def test_cpus_are_counted_only_on_nodes_with_the_gres():
    """Two 64-CPU nodes and one 128-CPU node: 3 nodes x 100 CPUs do not fit."""
    run = compose_run_config(
        [
            "cluster=testcluster",
            "cluster.partitions.a100.partition=gpu",
            "cluster.partitions.a100.cpus_per_rank=100",
            "cluster.partitions.a100.nodes=2",
            "cluster.partitions.v100.partition=gpu",
            "cluster.partitions.v100.gpu_type=a100",
        ]
    )
    with pytest.raises(ConfigError, match="only 1 node"):
        check_partitions(run.cluster, parse_inventory(SINFO_LIMITS))


def test_launch_with_too_many_cpus_submits_nothing(monkeypatch, tmp_path):
    """The whole launcher: sinfo says no node has 8 CPUs; sbatch never runs, no job.json."""
    monkeypatch.setattr(slurm_checks.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")
    fake = _fake(monkeypatch, sinfo=(0, SINFO_TESTCLUSTER, ""))
    run = compose_run_config(["cluster=testcluster", "cluster.partitions.v100.cpus_per_rank=8"])
    with pytest.raises(ConfigError, match="cpus_per_rank=8"):
        launch_slurm(run, RunDir(tmp_path))
    assert fake.ran("sinfo") == 1 and fake.ran("sbatch") == 0
    assert not (tmp_path / "job.json").exists()


# ------------------------------------------------------------------ het-job state folding
def test_watcher_folds_squeue_rows_of_het_components(monkeypatch):
    fake = _fake(
        monkeypatch, squeue=(0, "12+0|RUNNING\n12+1|PENDING\n13+0|COMPLETED\n13+1|FAILED\n", "")
    )
    watcher = HetSlurmInfoWatcher(delay_s=0)
    for job in ("12", "13"):
        watcher.register_job(job)
    watcher.update()
    assert fake.calls[0][:6] == ["squeue", "-h", "-t", "all", "-o", "%i|%T"]
    assert fake.calls[0][-1] == "12,13"
    assert watcher.get_state("12", mode="cache") == "PENDING"
    assert watcher.get_state("13", mode="cache") == "FAILED"
    assert watcher.is_done("13", mode="cache") and not watcher.is_done("12", mode="cache")


def test_watcher_falls_back_to_sacct_for_jobs_squeue_forgot(monkeypatch):
    monkeypatch.setattr(slurm_watch.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")
    fake = _fake(
        monkeypatch, squeue=(0, "", ""), sacct=(0, "21+0|COMPLETED\n21+1|CANCELLED by 0\n", "")
    )
    watcher = HetSlurmInfoWatcher(delay_s=0)
    watcher.register_job("21")
    watcher.update()
    assert fake.ran("sacct") == 1
    assert watcher.get_state("21", mode="cache") == "CANCELLED"


def test_watcher_survives_a_failing_squeue(monkeypatch):
    monkeypatch.setattr(slurm_watch.shutil, "which", lambda cmd: None)
    _fake(monkeypatch, squeue=(subprocess.TimeoutExpired("squeue", 60), "", ""))
    watcher = HetSlurmInfoWatcher(delay_s=0)
    watcher.register_job("5")
    watcher.update()
    assert watcher.get_state("5", mode="cache") == "UNKNOWN"


# ------------------------------------------------------------------ failing-rank attribution
class _Job:
    """The two attributes wait_for_job reads of a submitit job, plus a fixed state."""

    def __init__(self, folder: Path, state: str = "RUNNING"):
        self.job_id = "77"
        self.paths = type("P", (), {"folder": folder})()
        self.watcher = type("W", (), {"get_state": lambda _s, job_id, mode="": state})()


DDP_TRACE = (
    'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
    "torch.distributed.DistBackendError: [gloo/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:5\nException raised from recvBytes at Utils.hpp:672:\n"
    "frame #56: /t/ddp_comm_hooks/ddp_hooks.py(53): <lambda>\n"
)
OWN_TRACE = (
    'Traceback (most recent call last):\n  File "data.py", line 9, in load\n'
    "hetseq_hpc.errors.DataError: train file /d/empty.txt is empty: give a text file\n"
)


def test_wait_names_the_rank_whose_own_error_is_first(tmp_path):
    """Rank 0's DDP traceback (peer disconnect) was named before; rank 1 is the cause."""
    for rank, trace in ((0, DDP_TRACE), (1, OWN_TRACE), (2, DDP_TRACE)):
        submitit_utils.cloudpickle_dump(("error", trace), tmp_path / f"77_{rank}_result.pkl")
    with pytest.raises(LaunchError) as info:
        wait_for_job(_Job(tmp_path), RunDir(tmp_path), 3, poll_s=0.01)
    message = str(info.value)
    assert message.startswith("job 77: rank 1 failed: hetseq_hpc.errors.DataError: train file")
    assert "ddp_hooks" not in message and "77_1_log.err" in message


def test_wait_reports_a_job_that_ended_without_results(tmp_path, monkeypatch):
    submitit_utils.cloudpickle_dump(("success", {"final_step": 3}), tmp_path / "77_0_result.pkl")
    clock = iter(range(0, 1000, 3))
    monkeypatch.setattr(slurm_watch.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(slurm_watch.time, "sleep", lambda s: None)
    with pytest.raises(LaunchError, match="ended CANCELLED before every rank finished"):
        wait_for_job(_Job(tmp_path, "CANCELLED"), RunDir(tmp_path), 2)


# ------------------------------------------------------------------ requeue
def test_requeue_goes_through_the_leader_id(monkeypatch):
    fake = _fake(monkeypatch, scontrol=(0, "", ""))
    assert requeue_job({"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "1"}, max_requeues=3)
    assert fake.calls == [["scontrol", "requeue", "12"]]


@pytest.mark.parametrize("restarts, limit", [("3", 3), ("5", 3), ("0", 0)])
def test_requeue_respects_max_num_timeout(monkeypatch, restarts, limit):
    fake = _fake(monkeypatch)
    env = {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": restarts}
    assert requeue_job(env, max_requeues=limit) is False
    assert fake.calls == []


def test_requeue_outside_a_job_does_nothing(monkeypatch):
    fake = _fake(monkeypatch)
    assert requeue_job({}, max_requeues=3) is False and fake.calls == []


def test_refused_requeue_is_a_launch_error(monkeypatch):
    _fake(monkeypatch, scontrol=(1, "", "Requested operation is presently disabled"))
    with pytest.raises(LaunchError, match="scontrol requeue 12 failed: Requested operation"):
        requeue_job({"SLURM_JOB_ID": "12"}, max_requeues=3)


# ------------------------------------------------------------------ sbatch text: defence in depth
@pytest.mark.parametrize("key", ["a100\nhostname", "a100\r#SBATCH --qos=high", "a\u2028b"])
def test_newline_partition_key_never_becomes_a_script_line(testcluster, key):
    """The attack of issue 8: a newline in a ``cluster.partitions`` key, bypassing the config
    validation (the dict is replaced after it ran)."""
    cluster = testcluster.cluster
    cluster.partitions = {key: cluster.partitions["a100"], "v100": cluster.partitions["v100"]}
    with pytest.raises(ConfigError, match="newline or control character"):
        render_sbatch(cluster, "/RUN/submitit", "/PYTHON")


@pytest.mark.parametrize(
    "field, value",
    [
        ("partition", "a100\nhostname"),
        ("account", "x\n#SBATCH --qos=high"),
        ("gpu_type", "a\nb"),
        ("constraint", "c\x00d"),
    ],
)
def test_newline_in_any_partition_value_is_refused(testcluster, field, value):
    cluster = testcluster.cluster
    setattr(cluster.partitions["a100"], field, value)
    with pytest.raises(ConfigError, match=f"cluster.partitions.a100.{field}"):
        render_sbatch(cluster, "/RUN/submitit", "/PYTHON")


def test_unvalidated_metacharacters_are_quoted_not_run(testcluster):
    cluster = testcluster.cluster
    cluster.partitions["a100"].partition = "a100;touch /tmp/pwned"
    cluster.partitions["a100"].extra_sbatch = {"exclude": "$(id) n7"}
    text = render_sbatch(cluster, "/RUN/submitit", "/PYTHON")
    assert "#SBATCH --partition='a100;touch /tmp/pwned'" in text
    assert "#SBATCH --exclude='$(id) n7'" in text
    script_lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert not any("pwned" in ln or "$(id)" in ln for ln in script_lines)


def test_bad_extra_sbatch_option_name_is_refused(testcluster):
    cluster = testcluster.cluster
    cluster.partitions["a100"].extra_sbatch = {"exclude=n1 --qos": "x"}
    with pytest.raises(ConfigError, match="not an sbatch option name"):
        render_sbatch(cluster, "/RUN/submitit", "/PYTHON")


def test_paths_with_spaces_and_quotes_are_quoted(testcluster):
    folder = '/runs/it\'s a "run"/submitit'
    text = render_sbatch(testcluster.cluster, folder, "/opt/my python/bin/python")
    assert "#SBATCH --output='/runs/it'\"'\"'s a \"run\"/submitit/%j_batch.out'" in text
    srun = text.strip().splitlines()[-1]
    assert "'/opt/my python/bin/python' '/runs/it'\"'\"'s a \"run\"/submitit'" in srun


def test_cluster_env_is_exported_before_setup_runs(testcluster):
    cluster = testcluster.cluster
    cluster.env = {"DATA_ROOT": "/data set"}
    cluster.setup = ['ls "$DATA_ROOT"']
    lines = render_sbatch(cluster, "/RUN/submitit", "/PYTHON").splitlines()
    assert lines.index("export DATA_ROOT='/data set'") < lines.index('ls "$DATA_ROOT"')


def test_partition_config_values_reach_sbatch_unchanged(testcluster):
    part = PartitionConfig(
        partition="gpu",
        gpu_type="a100",
        nodes=2,
        gpus_per_node=4,
        cpus_per_rank=8,
        mem_gb=1.5,
        account="proj-1",
        qos="normal",
    )
    cluster = testcluster.cluster
    cluster.partitions = {"gpu": part}
    text = render_sbatch(cluster, "/RUN/submitit", "/PYTHON")
    for opt in (
        "--partition=gpu",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--cpus-per-task=8",
        "--mem=1536M",
        "--gres=gpu:a100:4",
        "--account=proj-1",
        "--qos=normal",
    ):
        assert f"#SBATCH {opt}\n" in text
    assert json.dumps(text).count("\\n#SBATCH hetjob") == 0


def test_scontrol_killed_by_its_own_requeue_counts_as_requeued(monkeypatch):
    """The requeue SIGTERMs every process of the job, scontrol too (measured: exit -15, no
    output): that is success, not a failure that hides the requeue."""
    _fake(monkeypatch, scontrol=(-15, "", ""))
    assert requeue_job({"SLURM_JOB_ID": "12"}, max_requeues=3)
