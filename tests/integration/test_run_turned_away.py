"""Issue 40: a second run turned away from a run directory in use writes nothing there,
``.hydra/`` included, whether the first run has written its configuration yet or not (a
second run started 0-0.5 s after the first went the Hydra way and rewrote ``.hydra/`` before
the launcher refused it).

The first run is a real process that took the run lock as a run's command line does, before
Hydra writes; the test waits for its line saying so, never for a time. (The lock itself:
tests/unit/test_run_lock_once.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMALL_MODEL, assert_ok, hetseq, snapshot

QUICK = [
    *SMALL_MODEL,
    "cluster.ranks=1",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
]


@pytest.fixture
def hold_lock():
    """``hold_lock(run_dir)``: a process takes the run lock (as a run's command line does) and
    holds it until the test ends; returns once it holds it (its line, not a sleep)."""
    holders = []

    def _hold(run_dir: Path) -> None:
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from hetseq_hpc.rundir.lock import acquire\n"
                "from hetseq_hpc.rundir.paths import RunDir\n"
                "acquire(RunDir(sys.argv[1])); print('held', flush=True); sys.stdin.read()",
                str(run_dir),
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        holders.append(holder)
        assert holder.stdout.readline().strip() == "held"

    yield _hold
    for holder in holders:
        holder.kill()
        holder.wait()


def _turned_away(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is in use by another run (held by pid=" in lines[0], proc.stderr
    assert str(run_dir) in lines[0]


def test_a_run_turned_away_before_the_first_wrote_its_config_writes_nothing(
    tmp_path, hold_lock, token_cache
):
    """The first run holds the lock and its Hydra wrote .hydra/, its launcher has not written
    hetseq_config.yaml yet (the 0-0.5 s window): the second run goes the Hydra way, and was
    refused only after Hydra rewrote .hydra/ with its own overrides."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=100000\n")
    hold_lock(run_dir)
    before = snapshot(run_dir, skip=())
    proc = hetseq(*QUICK, "trainer.seed=3", f"hydra.run.dir={run_dir}", token_cache=token_cache)
    _turned_away(proc, run_dir)
    assert snapshot(run_dir, skip=()) == before


@pytest.mark.slow
def test_a_run_turned_away_from_a_used_run_dir_writes_nothing(tmp_path, hold_lock, token_cache):
    """The first run wrote its configuration (the second continues it from there): refused
    before its cli.log line; a finished run in use is "in use", not "complete"."""
    run_dir = tmp_path / "run"
    assert_ok(
        hetseq(*QUICK, "trainer.max_steps=1", f"hydra.run.dir={run_dir}", token_cache=token_cache)
    )
    hold_lock(run_dir)
    before = snapshot(run_dir, skip=())
    for extra in (["trainer.max_steps=5"], []):
        proc = hetseq(*extra, f"hydra.run.dir={run_dir}", token_cache=token_cache)
        _turned_away(proc, run_dir)
        assert proc.stdout == ""
    assert snapshot(run_dir, skip=()) == before
