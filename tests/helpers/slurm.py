"""The real Slurm test cluster (scripts/test-cluster.sh): is it up, its queue, sbatch by hand,
and the CLI with ``cluster=testcluster``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hetseq_hpc.config import CONF_DIR, register_configs, to_run_config
from hetseq_hpc.launch.slurm import fold_states
from tests.helpers.runs import REPO, SMALL_MODEL, cli_env


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
    """``python -m hetseq_hpc cluster=testcluster`` with the small model."""
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        *(["-m"] if multirun else []),
        "cluster=testcluster",
        *SMALL_MODEL,
        *overrides,
    ]
    cmd.append(f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}")
    return subprocess.run(
        cmd, cwd=REPO, env=cli_env(token_cache), capture_output=True, text=True, timeout=timeout
    )


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
    deadline = time.monotonic() + timeout_s
    while squeue_state(job_id) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, f"job {job_id} ({args[-1]}) did not finish"
        time.sleep(1)
    return job_id
