"""``cluster=local``: start one worker process per rank on this machine and watch them.

Each rank is ``python -m hetseq_hpc.worker --config <run dir>/hetseq_config.yaml`` with the
torch variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``), exactly what torchrun would set, so the worker needs no special case. CPU
threads are split evenly between ranks. If a rank dies, the others are stopped at once
(they would otherwise wait in a collective) and the first failure is reported with its rank,
reason and log file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from hetseq_hpc.config import RunConfig, planned_world_size, save_run_config
from hetseq_hpc.config.validate import visible_gpu_count
from hetseq_hpc.env.hardware import usable_cores
from hetseq_hpc.env.world import free_port
from hetseq_hpc.errors import LaunchError
from hetseq_hpc.worker import CONFIG_NAME, error_file

log = logging.getLogger(__name__)

#: seconds between polls of the worker processes
POLL_S = 0.2
#: seconds a stopped worker gets between SIGTERM and SIGKILL
TERM_GRACE_S = 10.0


def rank_environments(run: RunConfig, config_path: Path) -> List[Dict[str, str]]:
    """The environment of every rank (the parent's environment plus the torch variables)."""
    cluster = run.cluster
    world = planned_world_size(run)
    port = cluster.master_port or free_port()
    threads = cluster.threads_per_rank or max(1, usable_cores() // world)
    gpus = visible_gpu_count()
    if gpus and world > gpus:
        log.warning("%d ranks on %d GPUs: ranks share GPUs", world, gpus)
    envs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
            "HETSEQ_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            # Ctrl-C reaches the launcher, which stops the ranks with SIGTERM: they checkpoint
            # after the current step instead of dying inside a collective
            "HETSEQ_IGNORE_SIGINT": "1",
        })
        if cluster.speeds:
            env["HETSEQ_EMULATE_SPEED"] = str(cluster.speeds[rank])
        envs.append(env)
    return envs


def _stop(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _failure_reason(run_dir: Path, rank: int, code: int) -> str:
    err = error_file(run_dir, rank)
    if err.is_file():
        try:
            data = json.loads(err.read_text())
            return f"{data['type']}: {data['message']}"
        except (OSError, ValueError, KeyError):
            pass
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def launch_local(run: RunConfig, run_dir: Path, poll_s: float = POLL_S) -> Dict:
    """Run the job on this machine and return rank 0's summary.

    Raises:
        LaunchError: a rank failed; the others were stopped; the message names the rank, the
            reason and its log file.
    """
    run_dir = Path(run_dir).resolve()
    config_path = save_run_config(run, run_dir / CONFIG_NAME)
    for stale in (run_dir / "logs").glob("rank*.error.json"):
        stale.unlink()
    envs = rank_environments(run, config_path)
    log.info("starting %d rank(s) on this machine (%s threads each); run directory %s",
             len(envs), envs[0]["HETSEQ_THREADS"], run_dir)
    cmd = [sys.executable, "-m", "hetseq_hpc.worker", "--config", str(config_path),
           "--run-dir", str(run_dir)]
    procs: List[subprocess.Popen] = []
    try:
        for env in envs:
            procs.append(subprocess.Popen(cmd, env=env))
        failed: Optional[int] = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # a rank killed by a signal is the cause, its peers' "connection closed" errors
                # the effect; otherwise the earliest error file names the first failure
                def first(r: int) -> tuple:
                    try:
                        when = json.loads(error_file(run_dir, r).read_text())["time"]
                    except (OSError, ValueError, KeyError):
                        when = float("inf")
                    return (0 if codes[r] < 0 else 1, when, r)

                failed = min(bad, key=first)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
        if failed is not None:
            _stop(procs)
            reason = _failure_reason(run_dir, failed, procs[failed].returncode)
            raise LaunchError(
                f"rank {failed} failed ({reason}); the other ranks were stopped; see "
                f"{run_dir / 'logs' / f'rank{failed}.log'}"
            )
    except BaseException:
        _stop(procs)
        raise
    summary_path = run_dir / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}
