"""Issue 43: checkpoints written in the background (``trainer.checkpoint_async``), in-process on
real files: the save returns while the write is held before its rename, training's later
in-place changes do not reach the file, the next save waits for the pending write, and a
background write's error is raised by the next save as one line. (A kill -9 while the write is
held, and a real run that fails in the background: tests/integration/test_checkpoint.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.background import Stager
from hetseq_hpc.train.checkpoint.files import checksum_path
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.checkpoints import GUARD_S, held_write


class _Solo:
    """The rendezvous of a one-rank world (what a collective is with nobody else)."""

    world = SimpleNamespace(rank=0, world_size=1)

    def broadcast_object(self, obj):
        return obj

    def all_gather_objects(self, obj):
        return [obj]


def _state(weights: torch.Tensor, step: int) -> dict:
    return {"model": {"w": weights}, "optimizer": {}, "scheduler": {}, "step": step}


def test_a_save_returns_while_its_write_is_held_and_later_changes_do_not_reach_it(tmp_path):
    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    held, release = held_write(manager, 1)
    weights = torch.zeros(64)
    path = manager.save_on_rank0(1, _Solo(), lambda: _state(weights, 1))
    assert held.wait(GUARD_S)
    assert path == manager.path(1) and not path.exists(), "written on the training thread"
    weights.add_(1.0)  # training goes on in place while the copy is written
    release.set()
    manager.finish(_Solo())
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.zeros(64))
    assert manager.pending is None


def test_the_next_save_waits_for_the_pending_write(tmp_path):
    manager = CheckpointManager(RunDir(tmp_path), keep=5, asynchronous=True)
    held, release = held_write(manager, 1)
    manager.save_on_rank0(1, _Solo(), lambda: _state(torch.ones(8), 1))
    assert held.wait(GUARD_S)
    pending = manager.pending
    # released only once the next save waits for it: a save that does not wait stages first
    threading.Thread(target=lambda: pending.waited.wait(GUARD_S) and release.set()).start()
    first_on_disk = []

    def state_of_step_2() -> dict:
        first_on_disk.append(manager.path(1).exists() and checksum_path(manager.path(1)).exists())
        return _state(torch.full((8,), 2.0), 2)

    manager.save_on_rank0(2, _Solo(), state_of_step_2)
    assert first_on_disk == [True], "the second save staged before the first write ended"
    manager.finish(_Solo())
    assert [load_checkpoint(p)["step"] for p in manager.list()] == [1, 2]


def test_a_background_write_error_is_raised_by_the_next_save_as_one_line(tmp_path):
    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    in_way = checksum_path(manager.path(1))
    in_way.mkdir(parents=True)  # the checksum file of step 1 cannot be written
    manager.save_on_rank0(1, _Solo(), lambda: _state(torch.ones(8), 1))  # no error yet
    asked = []
    with pytest.raises(CheckpointError) as err:
        manager.save_on_rank0(2, _Solo(), lambda: asked.append(2) or _state(torch.ones(8), 2))
    message = str(err.value)
    assert "\n" not in message and f"{str(in_way)!r} is a directory" in message, message
    assert asked == [], "no new write starts after a failed one"
    assert manager.list() == [], "the checkpoint without its checksum must not be left"
    manager.finish(_Solo())  # nothing pending any more


def test_the_exit_wait_raises_a_background_error_on_every_rank(tmp_path):
    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    checksum_path(manager.path(3)).mkdir(parents=True)
    manager.save_on_rank0(3, _Solo(), lambda: _state(torch.ones(8), 3))
    with pytest.raises(CheckpointError, match="is a directory, not a file"):
        manager.finish(_Solo())


def test_staging_keeps_tied_tensors_shared_and_reuses_its_buffers():
    stager = Stager()
    tied = torch.arange(6.0)
    state = {"model": {"a": tied, "b": tied}, "opt": [{"lr": 0.1, "m": torch.ones(3)}]}
    first = stager.stage(state).state
    assert first["model"]["a"] is first["model"]["b"], "tied weights written twice"
    assert first["model"]["a"].data_ptr() != tied.data_ptr()
    assert first["opt"][0]["lr"] == 0.1
    tied.add_(1.0)
    second = stager.stage(state).state
    assert second["model"]["a"].data_ptr() == first["model"]["a"].data_ptr(), "not reused"
    assert torch.equal(second["model"]["a"], tied)


def test_a_checkpoint_is_marked_by_the_writing_thread_once_written_and_a_fence_says_nothing(
    tmp_path, caplog
):
    """``on_written`` runs where the record is in place (the background thread), after the
    save returned; a rank fenced meanwhile (its store unreachable) writes one short warning,
    not the fence's line, which the rank's own error says once."""
    from hetseq_hpc.errors import RankFenced

    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    marked = []
    manager.on_written = lambda step: marked.append((step, threading.current_thread().name))
    held, release = held_write(manager, 1)
    manager.save_on_rank0(1, _Solo(), lambda: _state(torch.zeros(4), 1))
    assert held.wait(GUARD_S) and marked == []  # begun, not written: not marked
    release.set()
    manager.finish(_Solo())
    assert [s for s, _ in marked] == [1] and marked[0][1] != threading.current_thread().name

    def fenced(step):
        raise RankFenced("rank 0 cannot reach the job's store at 127.0.0.1:1 (the line)")

    manager.on_written = fenced
    caplog.set_level("WARNING")
    manager.save_on_rank0(2, _Solo(), lambda: _state(torch.zeros(4), 2))
    manager.finish(_Solo())
    assert load_checkpoint(manager.path(2))["step"] == 2  # written, verified
    assert "checkpoint of step 2 written; not marked (this rank is fenced)" in caplog.text
    assert "cannot reach the job's store" not in caplog.text
