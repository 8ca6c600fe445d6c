"""cluster=local launcher: the ranks die with their launcher, the right rank is blamed. Real
processes, real signals, real gloo; nothing mocked. (Picking the failed rank from what the ranks
left, and the loopback rendezvous store, in-process: tests/unit/test_failure_attribution.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fault_tasks import fail_on_rank
from tests.helpers.runs import REPO, SMALL_MODEL, cli_env, start_hetseq, wait_rows, worker_pids
from tests.helpers.waits import wait_for

#: how long ranks that should be gone may still run: a guard against hangs, not a speed check
#: (the ranks of LONG_RUN would train for hours if nothing stopped them)
GONE_GUARD_S = 120

LONG_RUN = [
    "cluster.ranks=2",
    "trainer.max_steps=100000",
    "optim.schedule_steps=100000",
    "trainer.val_every=0",
    "trainer.checkpoint_every=0",
]


# ------------------------------------------------------------------ helpers
def _ranks_of(run_dir: Path) -> dict:
    """rank -> pid of the live worker processes of ``run_dir`` (zombies count as gone)."""
    return worker_pids(run_dir, live=True)


def _wait_gone(run_dir: Path, timeout_s: float = GONE_GUARD_S) -> None:
    """Wait until no worker of ``run_dir`` is alive (``timeout_s``: a guard against hangs); on
    the timeout, SIGKILL them (do not leave them running after a failed test)."""
    try:
        wait_for(
            lambda: not _ranks_of(run_dir), f"workers of {run_dir} gone", timeout_s, poll_s=0.2
        )
    except AssertionError:
        pids = _ranks_of(run_dir)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"workers {pids} still alive {timeout_s:.0f} s later") from None


@contextlib.contextmanager
def _launcher(run_dir: Path, token_cache: Path, *overrides: str, small: bool = True):
    """The CLI running in the background (its own session); killed with its group on exit."""
    proc = start_hetseq(
        *(SMALL_MODEL if small else []),
        *overrides,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _checkpoints(run_dir: Path) -> list:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))


# ------------------------------------------------------------------ the ranks die with the launcher
@pytest.mark.slow
def test_sigterm_to_launcher_checkpoints_and_stops_the_ranks(tmp_path, token_cache):
    """``kill <launcher>`` (what timeout, a CI cancel or a closed terminal send): the ranks
    checkpoint after their current step and exit; nobody keeps training."""
    with _launcher(tmp_path, token_cache, *LONG_RUN) as proc:
        wait_rows(tmp_path, 3, proc)
        assert set(_ranks_of(tmp_path)) == {0, 1}
        os.kill(proc.pid, signal.SIGTERM)
        _wait_gone(tmp_path)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "trainer.resume=auto" in stderr.strip().splitlines()[-1]
    assert _checkpoints(tmp_path), "no checkpoint written on SIGTERM"


@pytest.mark.slow
def test_sigkill_to_launcher_stops_the_ranks_within_seconds(tmp_path, token_cache):
    """SIGKILL cannot be caught: the ranks' parent-death signal (prctl, SIGHUP) makes them
    checkpoint and exit on their own, also in an elastic run (the default), whose launcher
    serves the job store from threads: the kernel sends the signal once per launcher thread
    that ends, and a repeated SIGTERM used to end a rank before its checkpoint (2 runs in 3)."""
    with _launcher(tmp_path, token_cache, *LONG_RUN) as proc:
        wait_rows(tmp_path, 3, proc)
        assert set(_ranks_of(tmp_path)) == {0, 1}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_gone(tmp_path)
    assert _checkpoints(tmp_path), "the orphaned ranks wrote no checkpoint"


# ------------------------------------------------------------------ the right rank is blamed
@pytest.mark.slow
def test_failing_rank_is_named_and_peers_tracebacks_stay_in_their_logs(tmp_path, token_cache):
    """Rank 1 fails on its own (the test task of fail_on_rank(1) raises in its load()); rank 0
    only sees it disconnect. Rank 1 is named with its reason, and rank 0's traceback is in its
    log, not on the console."""
    with _launcher(
        tmp_path,
        token_cache,
        *fail_on_rank(1),
        "cluster.ranks=2",
        "trainer.max_steps=5",
        small=False,
    ) as proc:
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "injected failure on rank 1" in last, last
    assert "[rank 0] ERROR" not in stderr, stderr[-3000:]
    assert stderr.count("Traceback") <= 1, stderr[-3000:]
    _wait_gone(tmp_path)


@pytest.mark.slow
def test_stopped_rank_is_named_not_the_peer_that_timed_out(tmp_path, token_cache):
    """SIGSTOP on rank 1 without in-job recovery: rank 0 times out in a collective and exits
    first. The old launcher blamed rank 0 (the first to exit); the cause is the stopped rank 1."""
    with _launcher(
        tmp_path,
        token_cache,
        *LONG_RUN,
        "cluster.collective_timeout_s=10",
        "trainer.elastic.enabled=false",
    ) as proc:
        wait_rows(tmp_path, 2, proc)
        os.kill(_ranks_of(tmp_path)[1], signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=180)
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "stopped (SIGSTOP" in last, last
    _wait_gone(tmp_path)


# ------------------------------------------------------------------ what the launcher costs
def test_a_local_run_launcher_never_imports_torch(tmp_path, token_cache):
    """The launcher of a 2-rank FSDP run (configuration, pre-flight checks, the job's store, the
    watch over the ranks, the summary) and of its resume (the checkpoint's fingerprint read
    from its pickle) imports no torch: ~3 CPU-s per command on the 2-core machine, spent in
    every command of the suite (the ranks import it)."""
    stack = tmp_path / "torch-imported.txt"
    env = {**cli_env(token_cache), "HETSEQ_TORCH_IMPORTED": str(stack)}
    for steps in (2, 4):
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "tests" / "helpers" / "cli_without_torch.py"),
                *SMALL_MODEL,
                "cluster.ranks=2",
                "sharding.mode=fsdp",
                "trainer.checkpoint_every=2",
                f"trainer.max_steps={steps}",
                "trainer.plot=false",
                f"hydra.run.dir={tmp_path / 'run'}",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"done: {steps} steps" in done.stdout + done.stderr
        assert not stack.exists(), f"the launcher imported torch:\n{stack.read_text()}"
    assert "resum" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
