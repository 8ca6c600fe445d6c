"""Issue 26, critical cases 1-3, performed for real: starting over in a used run directory
keeps both runs apart, retention never deletes the good checkpoints, and continuing someone
else's run directory never imports code the user did not name.

Each runs the real CLI (``python -m hetseq_hpc``, 1 rank, small BERT) and reads what it left on
disk. (File-level checks of the checkpoint functions: tests/unit/test_checkpoint_retention.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.rundir.history import current_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.checkpoints import plant_corrupt
from tests.helpers.runs import SMALL_MODEL, hetseq, read_rows

QUICK = [
    *SMALL_MODEL,
    "cluster.ranks=1",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
]


def _cli(
    run_dir: Path, token_cache: Path, *overrides: str, quick: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess:
    return hetseq(
        *(QUICK if quick else []),
        *overrides,
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_starting_over_keeps_both_runs_apart(tmp_path, token_cache):
    """Case 1: an old run to step 4, then trainer.resume=never to step 2, then resume=auto
    continues the NEW run (not the old run's higher step), and the old run is intact."""
    run_dir = tmp_path / "run"
    _ok(
        _cli(
            run_dir,
            token_cache,
            "trainer.max_steps=4",
            "trainer.checkpoint_every=1",
            "trainer.keep_checkpoints=5",
        )
    )
    old_id = current_run_id(RunDir(run_dir))
    old_rows = (run_dir / "metrics.jsonl").read_text()
    old_ckpt = CheckpointManager(RunDir(run_dir)).path(4).read_bytes()

    proc = _cli(
        run_dir,
        token_cache,
        "trainer.max_steps=2",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=1",
        "trainer.resume=never",
    )
    _ok(proc)
    archived = run_dir / "previous" / old_id
    assert str(archived) in (run_dir / "logs" / "rank0.log").read_text()
    assert (archived / "metrics.jsonl").read_text() == old_rows
    assert (archived / "checkpoints" / "step_00000004.pt").read_bytes() == old_ckpt
    new_id = current_run_id(RunDir(run_dir))
    assert new_id and new_id != old_id
    assert [p.name for p in CheckpointManager(RunDir(run_dir)).list()] == ["step_00000002.pt"]
    assert load_checkpoint(CheckpointManager(RunDir(run_dir)).path(2))["run_id"] == new_id
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and {r["run_id"] for r in rows} == {new_id}

    proc = _cli(run_dir, token_cache, "trainer.max_steps=3", "trainer.resume=auto")
    _ok(proc)
    assert "nothing to train" not in proc.stdout + proc.stderr
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and {r["run_id"] for r in rows} == {new_id}
    assert (archived / "checkpoints" / "step_00000004.pt").read_bytes() == old_ckpt


@pytest.mark.slow
def test_keep_one_with_a_corrupt_newer_checkpoint_leaves_a_resumable_run(tmp_path, token_cache):
    """Case 2 as a user meets it: keep_checkpoints=1 and a corrupt step 20; the resumed run
    falls back, trains, keeps its own new checkpoint, and the directory resumes again."""
    run_dir = tmp_path / "run"
    _ok(
        _cli(
            run_dir,
            token_cache,
            "trainer.max_steps=2",
            "trainer.checkpoint_every=1",
            "trainer.keep_checkpoints=2",
        )
    )
    damaged = plant_corrupt(run_dir, 2, 20)
    _ok(_cli(run_dir, token_cache, "trainer.max_steps=3", "trainer.keep_checkpoints=1"))
    assert [p.name for p in CheckpointManager(RunDir(run_dir)).list()] == ["step_00000003.pt"]
    assert load_checkpoint(CheckpointManager(RunDir(run_dir)).path(3))["step"] == 3
    assert (run_dir / "checkpoints" / "corrupt" / "step_00000020.pt").read_bytes() == damaged
    _ok(_cli(run_dir, token_cache, "trainer.max_steps=4", "trainer.keep_checkpoints=1"))
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- foreign code
MARKER_TASK = '''
from pathlib import Path

with open(Path(__file__).with_name("IMPORTED"), "a") as fh:  # the marker: proof of an import
    fh.write("imported\\n")

from examples.char_lm import CharLMTask


class MarkerTask(CharLMTask):
    """examples/char_lm.py under another module name."""
'''


@pytest.mark.slow
def test_a_saved_task_module_is_imported_only_when_named(tmp_path, token_cache):
    """Case 3: continuing a copied run directory whose saved config names a task module
    refuses (naming the file) and imports nothing; resume=never imports nothing from the saved
    config; naming the target again, or trainer.trust_saved_task=true, runs it."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "marker_task.py").write_text(MARKER_TASK)
    marker = code / "IMPORTED"
    task = ["task=custom", "task.target=marker_task.MarkerTask", f"task.path={code}"]
    first = tmp_path / "first"
    _ok(
        _cli(
            first,
            token_cache,
            *task,
            "trainer.max_steps=1",
            "cluster.ranks=1",
            "trainer.global_batch_size=8",
            "trainer.val_every=0",
            quick=False,
        )
    )
    copied = tmp_path / "copied"
    shutil.copytree(first, copied, ignore=shutil.ignore_patterns(".hetseq.lock"))

    marker.unlink()
    proc = _cli(copied, token_cache, "trainer.max_steps=2", quick=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error:") and str(code / "marker_task.py") in last, last
    assert "trainer.trust_saved_task=true" in last and "task.target=marker_task.MarkerTask" in last
    assert not marker.exists(), "the saved task module was imported"

    proc = _cli(
        copied, token_cache, "trainer.max_steps=1", "trainer.resume=never", "trainer.val_every=0"
    )
    _ok(proc)
    assert not marker.exists(), "resume=never imported the saved task module"

    proc = _cli(
        first, token_cache, "trainer.max_steps=2", "trainer.trust_saved_task=true", quick=False
    )
    _ok(proc)
    assert marker.exists()
    assert str(code / "marker_task.py") in proc.stdout
    assert [r["step"] for r in read_rows(first)] == [1, 2]


@pytest.mark.slow
def test_resume_over_a_damaged_metrics_file_drops_the_damage(tmp_path, token_cache):
    """Binary bytes and a 100 000-deep row in metrics.jsonl: the resumed run's writer drops
    them (no traceback on rank 0) and the file reads as one run again."""
    run_dir = tmp_path / "run"
    _ok(_cli(run_dir, token_cache, "trainer.max_steps=2", "trainer.checkpoint_every=1"))
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b"\xff\xfe\x00binary\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    _ok(_cli(run_dir, token_cache, "trainer.max_steps=3"))
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
