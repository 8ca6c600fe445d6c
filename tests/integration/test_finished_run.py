"""Issue 40: re-running a finished run loses nothing. Re-run (again, with fewer steps,
rendered, resumed from its last checkpoint) it says so in one line and rewrites nothing;
rewinding it in place is refused; ranks that reach it anyway write nothing; more steps still
continue it from its last checkpoint.

Real CLI runs (1 rank, small BERT). (File-level checks: tests/unit/test_finished_run_files.py;
on Slurm: tests/slurm/test_slurm.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetseq_hpc.config import load_run_config
from hetseq_hpc.launch.local import launch_local
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.runs import (
    REPO,
    SMALL_MODEL,
    assert_ok,
    cli_env,
    hetseq,
    read_rows,
    snapshot,
)

QUICK = [
    *SMALL_MODEL,
    "cluster.ranks=1",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, token_cache) -> Path:
    """A real run of 2 steps, complete (checkpoints of both steps)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    overrides = ["trainer.max_steps=2", "trainer.checkpoint_every=1"]
    assert_ok(hetseq(*QUICK, *overrides, f"hydra.run.dir={run_dir}", token_cache=token_cache))
    return run_dir


@pytest.mark.slow
def test_rerunning_a_finished_run_says_it_is_complete_and_rewrites_nothing(
    finished, token_cache, tmp_path
):
    """... and the command that says so imports no torch (the checkpoint's checksum and its
    plain entries are read without it: ~3 CPU-s less per command)."""
    stack = tmp_path / "torch-imported.txt"
    env = {**cli_env(token_cache), "HETSEQ_TORCH_IMPORTED": str(stack)}
    before = snapshot(finished)
    assert {"summary.json", "metrics.jsonl", "checkpoints/step_00000002.pt"} <= set(before)
    summary = json.loads(before["summary.json"])
    last = finished / "checkpoints" / "step_00000002.pt"
    for argv in (
        [f"hydra.run.dir={finished}"],  # the command
        [f"hydra.run.dir={finished}", "trainer.max_steps=1"],
        [f"hydra.run.dir={finished}", f"trainer.resume={last}"],
        ["render", f"hydra.run.dir={finished}", "cluster=mixed"],  # a job with nothing to do
    ):
        proc = subprocess.run(
            [sys.executable, str(REPO / "tests" / "helpers" / "cli_without_torch.py"), *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert_ok(proc)
        assert not stack.exists(), f"{argv} imported torch:\n{stack.read_text()}"
        assert proc.stderr == "", proc.stderr[-3000:]
        assert proc.stdout.count("\n") == 1, proc.stdout  # one line
        line = proc.stdout.strip()
        assert line.startswith(f"hetseq-hpc: {finished} is complete: 2 steps "), line
        assert f"final loss {summary['final_loss']:.4f}" in line
        assert f"summary {finished / 'summary.json'}" in line
        assert f"hydra.run.dir={finished} trainer.max_steps=<more than 2>" in line
        assert snapshot(finished) == before, f"{argv} rewrote the finished run"
    # training again from step 1 in place would drop step 2's row, summary and checkpoint
    first = finished / "checkpoints" / "step_00000001.pt"
    proc = hetseq(f"hydra.run.dir={finished}", f"trainer.resume={first}", token_cache=token_cache)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "would train again from step 1" in proc.stderr and "complete at step 2" in proc.stderr
    assert snapshot(finished) == before


@pytest.mark.slow
def test_ranks_that_reach_a_finished_run_write_nothing(
    finished, tmp_path, token_cache, monkeypatch
):
    """A second queued job or a job script submitted by hand: no command line checked it
    first (the launcher is called directly here), the ranks start and stop."""
    monkeypatch.setenv("HETSEQ_CACHE", str(token_cache))  # the data the run was trained on
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = snapshot(run_dir, skip=(".hetseq.lock", "logs/"))
    summary = launch_local(load_run_config(run_dir / "hetseq_config.yaml"), RunDir(run_dir))
    assert summary == json.loads(before["summary.json"])
    assert snapshot(run_dir, skip=(".hetseq.lock", "logs/")) == before
    assert f"{run_dir} is complete: 2 steps" in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_more_steps_continue_a_finished_run_from_its_last_checkpoint(
    finished, tmp_path, token_cache
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    rows = (run_dir / "metrics.jsonl").read_text()
    proc = hetseq(f"hydra.run.dir={run_dir}", "trainer.max_steps=3", token_cache=token_cache)
    assert_ok(proc)
    assert "step_00000002.pt at step 2" in (run_dir / "logs" / "rank0.log").read_text()
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
    assert (run_dir / "metrics.jsonl").read_text().startswith(rows)
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 3
