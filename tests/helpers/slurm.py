"""The real Slurm test cluster (scripts/test-cluster.sh): is it up, its queue, sbatch by hand,
and the CLI with ``cluster=testcluster``."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import pytest

from hetseq_hpc.config import CONF_DIR, register_configs, to_run_config
from hetseq_hpc.launch.sbatch import TASK_MODULE
from hetseq_hpc.launch.slurm import fold_states
from tests.helpers.runs import REPO, SMALL_MODEL, hetseq, processes
from tests.helpers.waits import wait_for


def slurm_unavailable() -> str:
    """'' if the test cluster is up, else why not."""
    if os.environ.get("HETSEQ_TESTCLUSTER_UNAVAILABLE"):
        return os.environ["HETSEQ_TESTCLUSTER_UNAVAILABLE"]
    if not os.environ.get("SLURM_CONF") or shutil.which("sbatch") is None:
        return "no Slurm test cluster: run the tests with scripts/run-tests.sh, which starts one"
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        return "the Slurm test cluster does not answer (scontrol ping failed)"
    return ""


def compose_testcluster(*overrides: str):
    """The validated RunConfig of ``cluster=testcluster`` with ``overrides``."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(
            compose(config_name="config", overrides=["cluster=testcluster", *overrides])
        )


def slurm_cli(
    run_dir: Path, token_cache: Path, *overrides: str, timeout: float = 600, multirun=False
):
    """``python -m hetseq_hpc cluster=testcluster`` with the small model (and its plot: the
    default path under Slurm)."""
    run_dir_override = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return hetseq(
        *(["-m"] if multirun else []),
        "cluster=testcluster",
        *SMALL_MODEL,
        *overrides,
        run_dir_override,
        token_cache=token_cache,
        timeout=timeout,
        plot=True,
    )


def _task_pid(marker: bytes, folder: Path, task: int) -> Optional[int]:
    """pid of this host's process with ``marker`` and ``folder`` on its command line and
    ``SLURM_PROCID=task`` (the test cluster's nodes are all here), or None."""
    for pid, argv, env, _ in processes():
        if (
            marker in argv
            and str(folder).encode() in argv
            and env.get(b"SLURM_PROCID") == str(task).encode()
        ):
            return pid
    return None


def rank_pid(folder: Path, rank: int) -> int:
    """pid of the job's task ``rank`` on this host: its submitit job process
    (:data:`~hetseq_hpc.launch.sbatch.TASK_MODULE`) for ``folder`` with ``SLURM_PROCID=rank``.

    Raises:
        AssertionError: there is none.
    """
    pid = _task_pid(TASK_MODULE.encode(), folder, rank)
    if pid is None:
        raise AssertionError(f"no process of rank {rank} for {folder}")
    return pid


def task_pid(run_dir: Path, task: int) -> int:
    """pid of the worker of Slurm task ``task`` started by a hand-written template for
    ``run_dir`` (``python -m hetseq_hpc.worker --run-dir RUN_DIR``, ``SLURM_PROCID=task``).

    Raises:
        AssertionError: there is none.
    """
    pid = _task_pid(b"hetseq_hpc.worker", run_dir, task)
    if pid is None:
        raise AssertionError(f"no worker of task {task} for {run_dir}")
    return pid


def squeue_state(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T"], capture_output=True, text=True
    ).stdout
    return fold_states([line.split("|")[1] for line in out.splitlines() if "|" in line])


def sbatch_and_wait(args, cwd: Path, env: dict, timeout_s: float) -> str:
    """``sbatch --parsable ARGS``, then wait until the job ended (a guard against hangs)."""
    out = subprocess.run(
        ["sbatch", "--parsable", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    wait_for(
        lambda: squeue_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
        f"job {job_id} ({args[-1]}) did not finish",
        timeout_s,
        poll_s=1,
    )
    return job_id


#: exit code of scripts/test-cluster.sh when the cluster cannot run here (its reason on stderr)
CLUSTER_UNAVAILABLE = 3


@contextlib.contextmanager
def netns_cluster(links: str = "") -> Iterator[str]:
    """A test cluster of its own whose nodes run in network namespaces
    (``HETSEQ_TESTCLUSTER_NETNS=1``, links shaped as ``links`` says); yields its
    ``SLURM_CONF``, then stops it (namespaces, links and bridge removed) and removes its
    state directory. That directory is a fresh short one under /tmp, not the test's
    tmp_path: slurmstepd's socket path under its spool must stay below 108 bytes.

    Where namespaces are not allowed (the script exits 3) the calling test skips with the
    script's reason, except in CI (``CI=true``), where it fails.
    """
    state_dir = tempfile.mkdtemp(prefix="hsq-")
    # none of the suite's own cluster's settings (fixed ports, links): this one picks its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSEQ_TESTCLUSTER")}
    env.update(
        HETSEQ_TESTCLUSTER_DIR=state_dir,
        HETSEQ_TESTCLUSTER_NETNS="1",
        HETSEQ_TESTCLUSTER_LINKS=links,
    )
    script = str(REPO / "scripts" / "test-cluster.sh")
    try:
        start = subprocess.run(
            [script, "start"], env=env, capture_output=True, text=True, timeout=300
        )
        if start.returncode == CLUSTER_UNAVAILABLE and os.environ.get("CI") != "true":
            pytest.skip(f"no network-namespace test cluster here: {start.stderr.strip()}")
        assert start.returncode == 0, f"netns cluster did not start:\n{start.stderr[-3000:]}"
        yield start.stdout.strip().splitlines()[-1].split("=", 1)[1]
    finally:
        stop = subprocess.run([script, "stop"], env=env, capture_output=True, text=True)
        assert stop.returncode == 0, stop.stderr[-3000:]
        shutil.rmtree(state_dir, ignore_errors=True)
    # nothing of the cluster is left: its bridge (alias = its state directory), its
    # namespaces (named after its bridge), its /etc/hosts lines
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    bridge = re.search(r"bridge (hsq\d+)br\b", start.stderr)
    assert bridge and bridge.group(1) + "br" not in links and state_dir not in links, links
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert bridge.group(1) not in namespaces, namespaces
    assert state_dir not in Path("/etc/hosts").read_text()


def node_links(slurm_conf: str) -> Dict[str, Tuple[str, int]]:
    """node name -> (its address, its slurmd's port), from a test cluster's slurm.conf."""
    found = re.findall(
        r"^NodeName=(\S+) .*NodeAddr=(\S+) Port=(\d+)", Path(slurm_conf).read_text(), re.M
    )
    return {name: (addr, int(port)) for name, addr, port in found}


def reachable(addr: str, port: int) -> bool:
    """Whether a TCP connection to ``addr:port`` opens within a second."""
    try:
        socket.create_connection((addr, port), timeout=1).close()
    except OSError:
        return False
    return True
