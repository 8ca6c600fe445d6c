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


def test_elastic_script_serves_the_store_and_its_step_survives_a_task():
    """``trainer.elastic`` (a DDP run): the store is served on the batch host before ``srun``
    with a fresh token, ended on exit, and the step neither ends on a task's bad exit nor on a
    lost node; without it, the golden script (one task's failure ends the step)."""
    run = compose_testcluster()
    text = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON", elastic=True)
    lines = text.splitlines()
    srun = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    store = next(i for i, ln in enumerate(lines) if "hetseq_hpc.distributed.store_server" in ln)
    assert store < srun and lines[store].endswith("&")
    assert "--kill-on-bad-exit=0 --no-kill" in lines[srun]
    assert "export HETSEQ_JOB_TOKEN" in text and "trap 'kill $store_pid" in text
    assert 'export HETSEQ_STORE="$(hostname):' in text
    plain = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON")
    assert "--kill-on-bad-exit=1" in plain and "store_server" not in plain


def test_store_server_listens_on_its_address_only(tmp_path):
    """The job's store binds the address it is given, not every interface (torch's TCPStore
    alone would), and serves keys under a job's token."""
    import socket

    import torch.distributed as dist

    from hetseq_hpc.distributed.membership import job_store, serve_job_store

    store, port = serve_job_store("127.0.0.1")
    listening = [ln.split()[1] for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if ln.split()[3] == "0A"]  # LISTEN
    ours = [a for a in listening if int(a.split(":")[1], 16) == port]
    assert ours == ["0100007F:" + f"{port:04X}"], ours  # 127.0.0.1 only
    client = job_store(10, {"HETSEQ_STORE": f"127.0.0.1:{port}", "HETSEQ_JOB_TOKEN": "t1"})
    client.set("x", "1")
    other = dist.TCPStore("127.0.0.1", port, is_master=False)
    assert other.check(["job/t1/x"]) and not other.check(["x"])
    with pytest.raises(OSError):  # the port is taken on that address
        socket.create_server(("127.0.0.1", port))
    del store


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
