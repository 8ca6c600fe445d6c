"""Checkpoints and run directories under attack and fault (issue 8), with real mounts, processes
and runs of the CLI: a full filesystem (a real small tmpfs), the run lock held by a live and a
dead process, a corrupt latest checkpoint, a payload named as trainer.resume, two runs in one
directory, a resume with another configuration. (File-level checks:
tests/unit/test_checkpoint_files.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hetseq_hpc.errors import CheckpointError, LaunchError
from hetseq_hpc.rundir.lock import FD_ENV, acquire, claim_run_dir, lock_run_dir
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.background import HOLD_ENV
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.checkpoints import Payload, flip_middle, small_state, write_with_checksum
from tests.helpers.runs import (
    REPO,
    SMALL_MODEL,
    assert_same_losses,
    cli_env,
    hetseq,
    losses,
    read_rows,
    sigint_as_in_a_terminal,
    start_hetseq,
    step_rows,
    wait_rows,
)
from tests.helpers.shared import built_once
from tests.helpers.waits import wait_for

QUICK = [
    *SMALL_MODEL,
    "cluster.ranks=1",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
]
#: FSDP on 2 ranks, sharded checkpoints (the default of sharding.mode=fsdp), dropout off
SHARDED = [
    *SMALL_MODEL,
    "cluster.ranks=2",
    "sharding.mode=fsdp",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
    "optim.schedule_steps=1000",
]


def _cli(run_dir: Path, token_cache: Path, *overrides: str, timeout: float = 600):
    return hetseq(
        *QUICK, *overrides, f"hydra.run.dir={run_dir}", token_cache=token_cache, timeout=timeout
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error:"), proc.stderr[-3000:]
    return last


@pytest.fixture
def small_tmpfs(tmpfs):
    """``small_tmpfs(size) -> Path``: a real tmpfs of ``size`` (e.g. "7m") to fill up."""
    return lambda size: tmpfs(size)


def test_disk_full_with_no_earlier_checkpoint_says_so(small_tmpfs):
    disk = small_tmpfs("2m")
    with pytest.raises(CheckpointError, match="no earlier checkpoint exists"):
        CheckpointManager(RunDir(disk), keep=2).write(small_state(1, size=1_000_000), 1)


def test_disk_full_keeps_the_previous_checkpoint(small_tmpfs):
    disk = small_tmpfs("2m")
    first = CheckpointManager(RunDir(disk), keep=2).write(small_state(1, size=1000), 1)
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(RunDir(disk), keep=2).write(
            small_state(2, size=1_000_000), 2
        )  # 4 MB into 2 MB
    message = str(err.value)
    assert message.startswith(f"no space left on {disk} ") and "\n" not in message
    assert "free space or move hydra.run.dir" in message
    assert "the earlier checkpoint step_00000001.pt is kept" in message  # true, and named
    left = sorted(p.name for p in (disk / "checkpoints").iterdir())
    assert left == ["step_00000001.pt", "step_00000001.pt.sha256"], left  # no temp file
    assert load_checkpoint(first)["step"] == 1


# ----------------------------------------------------------------------------- run lock
def test_run_lock_is_exclusive_inherited_and_dies_with_its_holder(tmp_path):
    probe = (
        "import sys; from hetseq_hpc.rundir.lock import claim_run_dir\n"
        "from hetseq_hpc.rundir.paths import RunDir\n"
        "with claim_run_dir(RunDir(sys.argv[1]), True) as lock: print('ok', lock.owned)"
    )
    with lock_run_dir(RunDir(tmp_path)) as lock:
        other = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)], cwd=REPO, capture_output=True, text=True
        )
        assert other.returncode == 1 and "is in use by another run" in other.stderr
        assert f"held by pid={os.getpid()} host=" in other.stderr
        child = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            pass_fds=(lock.fd,),
            env={**os.environ, **lock.child_env()},
        )
        assert child.stdout.strip() == "ok False", child.stderr  # the launcher's own rank
        with claim_run_dir(RunDir(tmp_path), False, {}) as none:  # other ranks take nothing
            assert none is None
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from hetseq_hpc.rundir.lock import acquire\n"
                "from hetseq_hpc.rundir.paths import RunDir\n"
                "acquire(RunDir(sys.argv[1])); print('held', flush=True); time.sleep(600)"
            ),
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LaunchError, match=f"held by pid={holder.pid} "):
            acquire(RunDir(tmp_path))
        holder.kill()
        holder.wait()
        acquire(RunDir(tmp_path)).release()  # the kernel dropped the dead holder's lock
    finally:
        holder.kill()
    assert FD_ENV == "HETSEQ_RUN_LOCK_FD"


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def base_run(tmp_path_factory, token_cache):
    """A real 2-step run with a checkpoint after every step (made once, shared by the xdist
    workers: tests copy it before they change it)."""

    def build(directory: Path) -> None:
        run_dir = directory / "run"
        proc = _cli(run_dir, token_cache, "trainer.max_steps=2", "trainer.checkpoint_every=1")
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "checkpoint-base-run", build) / "run"


def _copy(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst, ignore=shutil.ignore_patterns(".hetseq.lock"))
    return dst


@pytest.mark.slow
def test_auto_resume_falls_back_past_a_corrupt_latest(base_run, tmp_path, token_cache):
    run_dir = _copy(base_run, tmp_path / "run")
    bad = CheckpointManager(RunDir(run_dir)).path(2)
    damaged = flip_middle(bad)
    stale = bad.with_name(".step_00000003.pt.999.tmp")
    stale.write_bytes(b"left by a killed writer")
    proc = _cli(
        run_dir,
        token_cache,
        "trainer.max_steps=3",
        "trainer.checkpoint_every=0",
        "trainer.keep_checkpoints=3",
        "trainer.resume=auto",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = bad.parent / "corrupt" / bad.name  # moved aside by retention (issue 26), not deleted
    assert kept.read_bytes() == damaged, "the bad checkpoint must stay for inspection"
    assert not stale.exists()
    said = [
        line
        for line in (run_dir / "logs" / "rank0.log").read_text().splitlines()
        if "resuming from" in line
    ]
    assert len(said) == 1 and str(bad) in said[0] and "step_00000001.pt" in said[0], said
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["resume_fallback"] == {
        "bad": [str(bad)],
        "used": str(CheckpointManager(RunDir(run_dir)).path(1)),
    }
    assert "resume_fallback" not in rows[2]


@pytest.mark.slow
def test_explicit_corrupt_checkpoint_stops_with_one_line(base_run, tmp_path, token_cache):
    run_dir = _copy(base_run, tmp_path / "run")
    bad = CheckpointManager(RunDir(run_dir)).path(2)
    flip_middle(bad)
    proc = _cli(tmp_path / "other", token_cache, "trainer.max_steps=3", f"trainer.resume={bad}")
    last = _error_line(proc)
    assert str(bad) in last and "is corrupt: its SHA-256" in last


@pytest.mark.slow
def test_payload_as_trainer_resume_is_refused(tmp_path, token_cache):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil" / "step_00000009.pt"
    write_with_checksum(evil, {"model": Payload(marker), "format_version": 2})
    proc = _cli(tmp_path / "run", token_cache, "trainer.max_steps=2", f"trainer.resume={evil}")
    last = _error_line(proc)
    assert str(evil) in last and "refused as untrusted" in last
    assert not marker.exists(), "resuming ran code from the checkpoint"


@pytest.mark.slow
def test_resume_with_another_seed_is_refused(base_run, tmp_path, token_cache):
    run_dir = _copy(base_run, tmp_path / "run")
    proc = _cli(run_dir, token_cache, "trainer.max_steps=3", "trainer.seed=2")
    last = _error_line(proc)
    assert "was trained with trainer.seed=0; this run has trainer.seed=2" in last
    assert "trainer.allow_resume_mismatch=true" in last
    assert max(losses(run_dir)) == 2, "the refused run must not touch metrics.jsonl"


@pytest.mark.slow
def test_disk_full_during_a_real_run_is_one_line(small_tmpfs, token_cache):
    disk = small_tmpfs("7m")  # room for one ~4.3 MB checkpoint of the small model, not two
    run_dir = disk / "run"
    proc = _cli(
        run_dir,
        token_cache,
        "trainer.max_steps=2",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=1",
    )
    last = _error_line(proc)
    assert f"no space left on {disk}" in last and "free space or move hydra.run.dir" in last
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000001.pt",
        "step_00000001.pt.sha256",
    ]
    assert load_checkpoint(CheckpointManager(RunDir(run_dir)).path(1))["step"] == 1


@pytest.mark.slow
def test_second_run_in_a_busy_run_dir_fails_fast(tmp_path, token_cache):
    first = start_hetseq(
        *QUICK,
        "trainer.max_steps=100000",
        "optim.schedule_steps=100000",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
        new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        wait_rows(tmp_path, 2, first)
        second = _cli(tmp_path, token_cache, "trainer.max_steps=5", "trainer.seed=3", timeout=300)
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: checkpoint after the current step
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    last = _error_line(second)
    assert f"run directory {str(tmp_path)!r} is in use by another run (held by pid=" in last
    assert "choose another hydra.run.dir" in last
    assert first.returncode == 130
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "the runs mixed"
    latest = sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1]
    assert load_checkpoint(latest)["config"]["trainer.seed"] == 0, "the second run wrote it"


# ----------------------------------------------------------------------------- in the background
def _killed_past_a_held_write(
    run_dir: Path, hold: Path, overrides: list, token_cache: Path, committed
) -> dict:
    """Start a run of ``overrides`` whose background write of step 4 is held (``hold`` holds
    ``hold_4``), wait until steps 5 and 6 trained past it (the training thread is not blocked;
    ``committed()`` must stay false: step 4 is not in place while held), kill the whole run
    -9 and return its losses by step."""
    proc = start_hetseq(
        *overrides,
        f"hydra.run.dir={run_dir}",
        env={**cli_env(token_cache), HOLD_ENV: str(hold)},
        new_session=True,
    )
    try:
        wait_for(lambda: (hold / "held_4").exists(), "the write of step 4 held", proc=proc)
        # training goes on while step 4 is written; the last step's save waits for it
        wait_for(lambda: step_rows(run_dir) >= 6, "step 6 trained", proc=proc)
        assert not committed(), "step 4 was committed while held"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return losses(run_dir)


@pytest.mark.slow
def test_kill_9_during_a_background_write_resumes_the_previous_checkpoint_exactly(
    tmp_path, token_cache
):
    """Issue 43: the write of step 4 is held before its rename (the test-only hook,
    HETSEQ_TEST_HOLD_CHECKPOINT) while steps 5 and 6 train, then the run is killed -9: step 2
    is the checkpoint a resume takes, and the resumed steps 3-6 log the same losses."""
    hold, run_dir = tmp_path / "hold", tmp_path / "run"
    hold.mkdir()
    (hold / "hold_4").touch()
    every = ["trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    trained = _killed_past_a_held_write(
        run_dir, hold, QUICK + every, token_cache, committed=lambda: False
    )
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left[-2:] == ["step_00000002.pt", "step_00000002.pt.sha256"], left
    assert len(left) == 3 and left[0].startswith(".step_00000004.pt."), left  # its temp file
    resumed = _cli(run_dir, token_cache, *every)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = (run_dir / "logs" / "rank0.log").read_text()
    assert f"resumed from {CheckpointManager(RunDir(run_dir)).path(2)} at step 2" in said
    assert_same_losses(trained, losses(run_dir), range(3, 7))
    assert [p.name for p in CheckpointManager(RunDir(run_dir)).list()] == ["step_00000006.pt"]


@pytest.mark.slow
def test_kill_9_during_a_background_sharded_write_resumes_the_previous_checkpoint_exactly(
    tmp_path, token_cache
):
    """Issue 43, FSDP on 2 ranks (sharded checkpoints): the background write of step 4 is held
    on rank 0 after every rank's shards are written and renamed, before its record (the
    test-only hook), while steps 5 and 6 train on both ranks: the training thread is not
    blocked by it. Then every rank is killed -9: step 2 is the checkpoint a resume takes,
    step 4's unreferenced shards and temp file are swept, and the resumed steps 3-6 log the
    same losses."""
    hold, run_dir = tmp_path / "hold", tmp_path / "run"
    hold.mkdir()
    (hold / "hold_4").touch()
    every = [
        *SHARDED,
        "trainer.max_steps=6",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=1",
    ]
    folder = run_dir / "checkpoints"
    trained = _killed_past_a_held_write(
        run_dir, hold, every, token_cache, committed=(folder / "step_00000004.pt").exists
    )
    manager = CheckpointManager(RunDir(run_dir))
    assert [p.name for p in manager.list()] == ["step_00000002.pt"]
    left = sorted(p.name for p in folder.iterdir())
    assert [n for n in left if n.startswith("step_00000004.")], left  # its shards, no record
    resumed = hetseq(*every, f"hydra.run.dir={run_dir}", token_cache=token_cache, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = (run_dir / "logs" / "rank0.log").read_text()
    assert f"resumed from {manager.path(2)} at step 2" in said
    assert_same_losses(trained, losses(run_dir), range(3, 7))
    assert [p.name for p in manager.list()] == ["step_00000006.pt"]
    kept = load_checkpoint(manager.path(6))  # the record and every shard verify
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(["step_00000006.pt", "step_00000006.pt.sha256", kept["shards"]["dir"]])


@pytest.mark.slow
def test_a_failed_background_write_ends_the_run_with_one_line(small_tmpfs, token_cache):
    """Issue 43: the write of step 2 fails in the background (a full real tmpfs) while step 3
    trains; the save of step 3 raises it: one line, the earlier checkpoint kept."""
    disk = small_tmpfs("7m")  # room for one ~4.3 MB checkpoint of the small model, not two
    run_dir = disk / "run"
    proc = _cli(
        run_dir,
        token_cache,
        "trainer.max_steps=4",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=1",
    )
    last = _error_line(proc)
    assert f"no space left on {disk}" in last and "step_00000002.pt" in last, last
    assert "the earlier checkpoint step_00000001.pt is kept" in last
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3], "trained while it was written"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000001.pt",
        "step_00000001.pt.sha256",
    ]
