"""Faults around a local run that must neither stop it for nothing nor start it for nothing.

* Metrics never stop a run: an optional logger (csv, tensorboard) that cannot open or write
  gives ONE warning naming its path and the fix and is dropped; training and ``metrics.jsonl``
  go on (real 2-rank runs).
* A run that cannot work is refused before any process starts, in one line with exit 2:
  ``trainer.loggers=[wandb]`` without wandb, ``comm.grad_combine=adasum`` on a world size
  that is not a power of two (local and SLURM configs).
* A directory at a checkpoint's name stops the run with the right advice (remove or rename it,
  and how to continue), and is never taken for a checkpoint.

The tests run as root, which ignores permission bits: "read-only" is made with what root
cannot bypass either, a read-only tmpfs mount (EROFS), a file where a directory is expected,
or a directory where a file is expected. (The in-process checks:
tests/unit/test_run_faults_units.py.)
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from hetseq_hpc.train.metrics.loggers import CSV_NAME, TB_DIR
from tests.helpers.loggers import LOGGERS, logger_warnings
from tests.helpers.runs import SMALL_MODEL, hetseq, read_rows

TWO_RANKS = [
    "cluster.ranks=2",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
]


def _cli(
    run_dir: Path, token_cache: Path, *overrides: str, small: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess:
    return hetseq(
        *(SMALL_MODEL if small else []),
        *overrides,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _refused(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    """The one error line of a run refused before anything started."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stderr.startswith("hetseq-hpc: error:") and proc.stderr.count("\n") == 1, (
        proc.stderr
    )
    assert not run_dir.exists(), "refused before Hydra created the run directory"
    return proc.stderr.strip()


@pytest.fixture
def ro_tmpfs(tmpfs):
    """``ro_tmpfs(where) -> where``: a read-only tmpfs mounted on the (new, empty) directory
    ``where`` (EROFS even for root), unmounted after the test."""
    return lambda where: tmpfs("1m", where, readonly=True)


# ------------------------------------------------------------------ optional loggers
@pytest.mark.slow
def test_loggers_blocked_at_resume_warn_once_and_the_run_goes_on(tmp_path, token_cache):
    """A run is resumed where ``tb`` has become a FILE and ``metrics.csv`` a DIRECTORY (a
    resume keeps the run's records in place): rank 0 used to fail with 0 new rows. Now each
    logger gives one warning with its path and the fix, and steps 3-4 reach metrics.jsonl."""
    run_dir = tmp_path / "run"
    _ok(
        _cli(
            run_dir,
            token_cache,
            *TWO_RANKS,
            "trainer.max_steps=2",
            "trainer.checkpoint_every=2",
            LOGGERS,
        )
    )
    shutil.rmtree(run_dir / TB_DIR)
    (run_dir / TB_DIR).write_text("a file where TensorBoard's directory should be\n")
    (run_dir / CSV_NAME).unlink()
    (run_dir / CSV_NAME).mkdir()
    (run_dir / CSV_NAME / "keep").write_text("x\n")
    out = _ok(_cli(run_dir, token_cache, "trainer.max_steps=4", small=False))
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4]
    tb, csv_dir = run_dir / TB_DIR, run_dir / CSV_NAME
    for path, words in (
        (tb, "is not a directory: remove or rename it"),
        (csv_dir, "is a directory: remove or rename it"),
    ):
        lines = logger_warnings(out, path)
        assert len(lines) == 1, out[-3000:]
        assert words in lines[0] and "training goes on" in lines[0], lines[0]
        assert lines[0].rstrip().endswith("from trainer.loggers"), lines[0]
        assert len(logger_warnings((run_dir / "logs" / "rank0.log").read_text(), path)) == 1
    assert tb.is_file() and csv_dir.is_dir(), "nothing of the user's is removed"


@pytest.mark.slow
def test_read_only_tensorboard_dir_and_csv_directory_on_a_fresh_run(
    tmp_path, token_cache, ro_tmpfs
):
    """``tb/`` on a read-only filesystem and ``metrics.csv`` an (empty) directory, at the start
    of a fresh run: both are dropped with one warning each; 3 steps in metrics.jsonl."""
    run_dir = tmp_path / "run"
    tb = ro_tmpfs(run_dir / TB_DIR)
    (run_dir / CSV_NAME).mkdir()
    out = _ok(_cli(run_dir, token_cache, *TWO_RANKS, "trainer.max_steps=3", LOGGERS))
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
    ro = logger_warnings(out, tb)
    assert len(ro) == 1 and "Read-only file system" in ro[0] and f"make {tb} writable" in ro[0]
    assert len(logger_warnings(out, run_dir / CSV_NAME)) == 1
    assert list(tb.iterdir()) == []


# ------------------------------------------------------------------ refused before the start
def test_wandb_without_the_package_is_refused_before_any_process(tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the unit test below covers the refusal")
    run_dir = tmp_path / "run"
    proc = hetseq(
        "trainer.loggers=[jsonl,wandb]", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=120
    )
    line = _refused(proc, run_dir)
    assert "wandb package is not installed" in line and "pip install wandb" in line
    assert line.endswith("(trainer.loggers=[jsonl])"), line


def test_adasum_on_three_local_ranks_is_refused_before_any_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = hetseq(
        "cluster.ranks=3",
        "comm.grad_combine=adasum",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=120,
    )
    line = _refused(proc, run_dir)
    assert "comm.grad_combine=adasum needs a power-of-two number of ranks" in line
    assert "plans 3: use 2 or 4 ranks" in line and line.endswith("comm.grad_combine=sum")


@pytest.mark.slow
def test_directory_at_a_checkpoint_name_stops_a_real_run_with_the_right_advice(
    tmp_path, token_cache
):
    """Steps 1-2 checkpointed; a directory then sits at step 4's checkpoint name. The resumed
    run trains steps 3-4 and stops at the save with one line naming the directory and the fix
    (it said "free disk space or fix permissions" before)."""
    run_dir = tmp_path / "run"
    quick = [
        *SMALL_MODEL,
        "cluster.ranks=1",
        "trainer.val_every=0",
        "balance.calibration_steps=1",
        "trainer.global_batch_size=16",
        "trainer.checkpoint_every=2",
    ]
    _ok(_cli(run_dir, token_cache, *quick, "trainer.max_steps=2", small=False))
    blocker = CheckpointManager(RunDir(run_dir)).path(4)
    blocker.mkdir()
    (blocker / "notes.txt").write_text("someone's files\n")
    proc = _cli(run_dir, token_cache, "trainer.max_steps=4", small=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error: rank 0 failed"), last
    assert f"{str(blocker)!r} is a directory, not a file: remove or rename it" in last, last
    assert f"hydra.run.dir={run_dir} trainer.resume=auto" in last
    assert (blocker / "notes.txt").is_file()
    assert [p.name for p in CheckpointManager(RunDir(run_dir)).list()] == ["step_00000002.pt"]
