"""Issue 26, critical cases 1-2, on real files in-process: retention never deletes the good
checkpoints (a corrupt newer one is moved aside, another run's and later steps are kept), auto
resume never picks another run's checkpoint, and a new run archives the earlier run's records.
(The same performed with the real CLI, and case 3: tests/integration/test_run_safety.py.)"""

from __future__ import annotations

import json
import os

import torch

from hetseq_hpc.rundir.history import current_run_id, start_or_continue, write_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import checksum_path
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.checkpoints import plant_corrupt


def _state(step: int, run_id: str = "") -> dict:
    state = {
        "model": {"w": torch.full((8,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "step": step,
    }
    if run_id:
        state["run_id"] = run_id
    return state


# ----------------------------------------------------------------------------- retention
def test_retention_keeps_the_new_checkpoint_and_moves_a_corrupt_newer_one_aside(tmp_path):
    """keep_checkpoints=1 with a corrupt step 20: the checkpoint just written and the newest
    verified one survive; the corrupt file goes to checkpoints/corrupt/ byte for byte."""
    CheckpointManager(RunDir(tmp_path), keep=1).write(_state(1, "r1"), 1)
    CheckpointManager(RunDir(tmp_path), keep=1).write(_state(2, "r1"), 2)
    damaged = plant_corrupt(tmp_path, 2, 20)
    written = CheckpointManager(RunDir(tmp_path), keep=1).write(_state(3, "r1"), 3)
    assert CheckpointManager(RunDir(tmp_path)).list() == [written]
    assert load_checkpoint(written)["step"] == 3
    corrupt = tmp_path / "checkpoints" / "corrupt" / "step_00000020.pt"
    assert corrupt.read_bytes() == damaged, "the corrupt file must be kept, not deleted"
    assert checksum_path(corrupt).is_file()
    assert CheckpointManager(RunDir(tmp_path)).choose("auto").path == written


def test_a_write_removes_what_killed_writers_left_and_keeps_its_own_temp(tmp_path):
    """Issue 45 (chaos soak): an elastic run never restarts, so the start-of-run sweep never
    came and every checkpoint write killed mid-way left its temp file (a whole model and
    optimizer each) and maybe a sidecar without its checkpoint. The next write removes those
    of other processes and earlier steps; this process's own temp (a write in flight), a later
    step's sidecar and the checkpoints stay."""
    manager = CheckpointManager(RunDir(tmp_path), keep=2)
    kept = manager.write(_state(5, "r1"), 5)
    folder = kept.parent
    dead = [
        folder / ".step_00000007.pt.999999.tmp",  # a killed rank 0's checkpoint
        folder / ".step_00000007.pt.sha256.999999.tmp",
        folder / "step_00000006.pt.sha256",  # renamed before its checkpoint: never was
    ]
    alive = [
        folder / f".step_00000011.pt.{os.getpid()}.tmp",  # this process's write in flight
        folder / "step_00000012.pt.sha256",  # a later step's: not this write's to judge
    ]
    for path in dead + alive:
        path.write_bytes(b"x" * 64)
    written = manager.write(_state(10, "r1"), 10)
    assert [p for p in dead if p.exists()] == []
    assert all(p.exists() for p in alive)
    assert manager.list() == [kept, written]
    assert load_checkpoint(kept)["step"] == 5 and load_checkpoint(written)["step"] == 10


def test_a_checkpoint_rewritten_at_a_corrupt_ones_step_moves_the_corrupt_file_aside(tmp_path):
    """Issue 40: resume=auto fell back past a corrupt step 4 and trained to step 4 again: the
    new checkpoint of step 4 takes the name, the corrupt file goes to checkpoints/corrupt/
    byte for byte (it was overwritten before)."""
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(2, "r1"), 2)
    damaged = plant_corrupt(tmp_path, 2, 4)
    written = CheckpointManager(RunDir(tmp_path), keep=5).write(_state(4, "r1"), 4)
    assert load_checkpoint(written)["step"] == 4
    corrupt = tmp_path / "checkpoints" / "corrupt" / "step_00000004.pt"
    assert corrupt.read_bytes() == damaged, "the corrupt file must be kept, not overwritten"
    assert checksum_path(corrupt).is_file()
    assert [p.name for p in CheckpointManager(RunDir(tmp_path)).list()] == [
        "step_00000002.pt",
        "step_00000004.pt",
    ]


def test_retention_never_deletes_a_later_step_or_another_runs_checkpoint(tmp_path):
    write_run_id(RunDir(tmp_path), "mine")
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(1, "theirs"), 1)
    CheckpointManager(RunDir(tmp_path), keep=5).write(
        _state(9, "mine"), 9
    )  # a later step of this run
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(2, "mine"), 2)
    CheckpointManager(RunDir(tmp_path), keep=1).write(_state(3, "mine"), 3)  # deletes only step 2
    assert [p.name for p in CheckpointManager(RunDir(tmp_path)).list()] == [
        "step_00000001.pt",
        "step_00000003.pt",
        "step_00000009.pt",
    ]


def test_auto_resume_never_picks_another_runs_checkpoint(tmp_path):
    write_run_id(RunDir(tmp_path), "mine")
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(2, "mine"), 2)
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(40, "theirs"), 40)
    assert CheckpointManager(RunDir(tmp_path)).choose("auto").path == CheckpointManager(
        RunDir(tmp_path)
    ).path(2)


def test_a_new_run_archives_the_earlier_runs_records(tmp_path):
    write_run_id(RunDir(tmp_path), "old")
    CheckpointManager(RunDir(tmp_path), keep=5).write(_state(4, "old"), 4)
    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    (tmp_path / "logs").mkdir()
    run_id, archived = start_or_continue(RunDir(tmp_path), None)
    assert run_id != "old" and current_run_id(RunDir(tmp_path)) == run_id
    assert archived == tmp_path / "previous" / "old"
    assert (archived / "checkpoints" / "step_00000004.pt").is_file()
    assert (archived / "metrics.jsonl").read_text() == '{"step": 4, "loss": 1.0}\n'
    assert json.loads((archived / "run.json").read_text())["run_id"] == "old"
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "logs").is_dir()
    # continuing keeps the id and moves nothing
    assert start_or_continue(RunDir(tmp_path), run_id) == (run_id, None)
