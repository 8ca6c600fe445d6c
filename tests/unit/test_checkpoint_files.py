"""Checkpoint files under attack and fault (issue 8), in-process on real files: a code-running
payload, flipped bytes, a checkpoint without a model, a killed write's temp file. (A full
filesystem, the run lock and real runs of the CLI: tests/integration/test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import checksum_path, stored_entry
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from tests.helpers.checkpoints import Payload, flip_middle, small_state, write_with_checksum


# ----------------------------------------------------------------------------- file level
def test_a_plain_entry_reads_as_torch_reads_it_and_builds_nothing_else(tmp_path):
    """stored_entry (the launcher's read of ``config``/``run_id``/``step``, without torch) gives
    what torch.load(weights_only=True) gives, beside tensors, a state dict's OrderedDict with
    its _metadata and a code-running payload, which it never builds."""
    model = torch.nn.Linear(3, 2)
    config = {"task.name": "bert", "trainer.seed": 7, "lr": 1e-3, "ok": True, "none": None}
    marker = tmp_path / "PWNED"
    path = tmp_path / "step_00000004.pt"
    state = {"model": model.state_dict(), "config": config, "run_id": "ab12", "step": 4}
    torch.save({**state, "nested": {"list": [1, "two", (3.0,)]}}, path)
    for key in ("config", "run_id", "step", "nested", "absent"):
        assert stored_entry(path, key) == torch.load(path, weights_only=True).get(key), key
    # an entry that is not plain data (a tensor inside) is left to torch, which reads it whole
    assert torch.equal(stored_entry(path, "model")["weight"], model.weight.detach())

    evil = tmp_path / "evil.pt"
    torch.save({"model": Payload(marker), "config": config, "step": 2}, evil)
    assert stored_entry(evil, "config") == config and stored_entry(evil, "step") == 2
    assert not marker.exists(), "reading a plain entry ran the file's code"
    with pytest.raises(CheckpointError, match="unreadable"):
        stored_entry(evil, "model")  # torch's weights_only refuses the payload: one error
    assert not marker.exists()

    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="unreadable"):
        stored_entry(cut, "config")


def test_payload_checkpoint_never_runs_code(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    torch.save(Payload(control / "ran"), control / "evil.pt")
    torch.load(control / "evil.pt", weights_only=False)
    assert (control / "ran").exists(), "negative control: the payload must run when trusted"

    marker = tmp_path / "PWNED"
    CheckpointManager(RunDir(tmp_path), keep=5).write(small_state(1), 1)
    evil = CheckpointManager(RunDir(tmp_path)).path(2)
    write_with_checksum(evil, {"model": Payload(marker), "format_version": 2, "step": 2})
    choice = CheckpointManager(RunDir(tmp_path)).choose(
        "auto"
    )  # newest is the payload: skipped, never run
    assert choice.path == CheckpointManager(RunDir(tmp_path)).path(1)
    assert "refused as untrusted" in choice.skipped[0][1]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(evil)
    assert "refused as untrusted" in str(err.value) and str(evil) in str(err.value)
    assert "\n" not in str(err.value)
    checksum_path(evil).unlink()  # without a sidecar it is not even unpickled
    with pytest.raises(CheckpointError, match="checksum file"):
        load_checkpoint(evil)
    assert not marker.exists(), "the checkpoint ran code"


def test_flipped_bytes_and_missing_model_are_named(tmp_path):
    path = CheckpointManager(RunDir(tmp_path), keep=2).write(small_state(1, size=100_000), 1)
    load_checkpoint(path)
    flip_middle(path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert f"checkpoint {str(path)!r} is corrupt: its SHA-256" in str(err.value)
    no_model = CheckpointManager(RunDir(tmp_path)).path(2)
    write_with_checksum(
        no_model, {"optimizer": {}, "scheduler": {}, "step": 2, "format_version": 2}
    )
    with pytest.raises(CheckpointError, match="has no model entry"):
        load_checkpoint(no_model)


def test_stale_temp_files_are_swept_at_start(tmp_path):
    CheckpointManager(RunDir(tmp_path), keep=2).write(small_state(1), 1)
    stale = CheckpointManager(RunDir(tmp_path)).path(2).with_name(".step_00000002.pt.4242.tmp")
    stale.write_bytes(b"half a checkpoint")
    path, state, skipped = CheckpointManager(RunDir(tmp_path)).load("auto", FakeGang())
    assert not stale.exists()
    assert (
        path == str(CheckpointManager(RunDir(tmp_path)).path(1))
        and state["step"] == 1
        and skipped == []
    )
