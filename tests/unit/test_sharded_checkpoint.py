"""Sharded (DCP) checkpoints of FSDP runs under attack and fault, in-process on real files: a
real one-rank gloo process group, a real FSDP2 model, real ``torch.distributed.checkpoint``
files. A ``.metadata`` that would run code, flipped bytes in a shard, a data file outside the
directory, a pickled (byte) entry: each is refused before anything is unpickled, with one line;
``trainer.resume=auto`` falls back past it. Retention and quarantine take the shard directory
with the record. (Loading on another world size and under DDP: tests/integration/test_sharding_exact.py.)
"""

from __future__ import annotations

import hashlib
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hetseq_hpc.distributed.rendezvous import Rendezvous, single_process_rendezvous
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.background import ShardStager, shard_layout
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from hetseq_hpc.train.checkpoint.shards import MANIFEST, METADATA, full_state, shard_dir_of
from hetseq_hpc.train.parallel import Sharded
from tests.helpers.checkpoints import (
    GUARD_S,
    Payload,
    flip_middle,
    held_write,
    write_with_checksum,
)


def _strategy(seed: int) -> Sharded:
    """A small model sharded by the FSDP2 strategy (its units: the two linear layers)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return Sharded(model, [model[0], model[2]], torch.device("cpu"))


def _trained(seed: int = 0):
    strategy = _strategy(seed)
    optimizer = torch.optim.AdamW(strategy.model.parameters(), lr=1e-2)
    strategy.model(torch.randn(5, 6)).sum().backward()
    optimizer.step()
    return strategy, optimizer


def _record(step: int) -> dict:
    return {"scheduler": {}, "step": step, "run_id": ""}


@pytest.fixture
def rdv():
    with single_process_rendezvous() as joined:
        yield joined


def _save(rdv, run_dir, step, keep=5):
    strategy, optimizer = _trained(step)
    path = CheckpointManager(RunDir(run_dir), keep).save(
        step, rdv, strategy, optimizer, lambda tensors: _record(step)
    )
    return path, strategy.model


def _rewrite_consistently(record_path, state, shards):
    """What an attacker with write access does after changing files in the shard directory:
    a matching SHA256SUMS, a record naming its digest, a matching record checksum."""
    lines = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(shards.iterdir())
        if p.name != MANIFEST
    )
    (shards / MANIFEST).write_text(lines)
    state["shards"]["manifest_sha256"] = hashlib.sha256(lines.encode()).hexdigest()
    write_with_checksum(record_path, state)


def test_sharded_checkpoint_round_trips_and_reads_whole(tmp_path, rdv):
    path, model = _save(rdv, tmp_path, 1)
    state = load_checkpoint(path)
    assert state["model"] == {} and "shards" in state
    shards = shard_dir_of(path, state)
    assert sorted(p.name for p in shards.iterdir()) == [METADATA, MANIFEST, "__0_0.distcp"]
    fresh = _strategy(99)
    optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=1e-2)
    fresh.load_shards(optimizer, shards, state["optimizer"]["param_groups"], str(path))
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert len(optimizer.state) == 4  # the AdamW moments came back too
    whole = full_state(shards, state["optimizer"]["param_groups"])
    assert sorted(whole["model"]) == sorted(model.state_dict())
    assert sorted(whole["optimizer"]["state"]) == [0, 1, 2, 3]
    assert whole["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_malicious_metadata_never_runs_code(tmp_path, rdv):
    marker = tmp_path / "PWNED"
    good, _ = _save(rdv, tmp_path, 1)
    evil, _ = _save(rdv, tmp_path, 2)
    state = load_checkpoint(evil)
    shards = shard_dir_of(evil, state)
    (shards / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"checksum|corrupt"):  # not even unpickled
        load_checkpoint(evil)
    _rewrite_consistently(evil, state, shards)  # checksums match: the unpickler must refuse
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(evil)
    assert "refused as untrusted" in str(err.value) and "open is not DCP" in str(err.value)
    assert "\n" not in str(err.value)
    choice = CheckpointManager(RunDir(tmp_path)).choose(
        "auto"
    )  # the newest is refused: the older one is used
    assert choice.path == good and "refused as untrusted" in choice.skipped[0][1]
    assert not marker.exists(), "the checkpoint ran code"


def test_flipped_shard_is_named_before_anything_is_read(tmp_path, rdv):
    path, _ = _save(rdv, tmp_path, 1)
    shards = shard_dir_of(path, load_checkpoint(path))
    flip_middle(shards / "__0_0.distcp", 16)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert f"{str(shards / '__0_0.distcp')!r} is corrupt: its SHA-256" in str(err.value)
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        load_checkpoint(path)


@pytest.mark.parametrize("change", ["outside", "bytes", "record_dir"])
def test_metadata_that_reaches_outside_or_holds_objects_is_refused(tmp_path, rdv, change):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path, _ = _save(rdv, tmp_path, 1)
    state = load_checkpoint(path)
    shards = shard_dir_of(path, state)
    if change == "record_dir":
        state["shards"]["dir"] = "../../etc"
        write_with_checksum(path, state)
        with pytest.raises(CheckpointError, match="names no valid shard directory"):
            load_checkpoint(path)
        return
    metadata = pickle.loads((shards / METADATA).read_bytes())  # the test's own file: trusted
    if change == "outside":
        for info in metadata.storage_data.values():
            info.relative_path = "../../../etc/passwd"
    else:
        metadata.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    (shards / METADATA).write_bytes(pickle.dumps(metadata))
    _rewrite_consistently(path, state, shards)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert ("outside the directory" if change == "outside" else "refused as untrusted") in str(
        err.value
    )


def test_retention_quarantine_and_orphans_take_the_shard_directory(tmp_path, rdv):
    for step in (1, 2, 3):
        _save(rdv, tmp_path, step, keep=2)
    folder = CheckpointManager(RunDir(tmp_path)).path(1).parent
    names = sorted(p.name.split(".")[0] + p.suffix for p in folder.iterdir())
    assert names == [
        "step_00000002.pt",
        "step_00000002.sha256",
        "step_00000002.shards",
        "step_00000003.pt",
        "step_00000003.sha256",
        "step_00000003.shards",
    ]
    # a write cut off before its record: a temp directory and a directory no record names
    (folder / ".step_00000004.0123456789abcdef.shards.tmp").mkdir()
    (folder / "step_00000004.0123456789abcdef.shards").mkdir()
    swept = CheckpointManager(RunDir(tmp_path)).sweep_orphan_shards()
    assert len(swept) == 2 and len(list(folder.glob("*.shards"))) == 2
    # a flipped shard in an older checkpoint: the next save moves it, with its record, aside
    older = CheckpointManager(RunDir(tmp_path)).path(2)
    flip_middle(shard_dir_of(older, load_checkpoint(older)) / "__0_0.distcp", 16)
    _save(rdv, tmp_path, 4, keep=2)
    corrupt = folder / "corrupt"
    assert sorted(p.name.split(".")[0] for p in corrupt.iterdir()) == ["step_00000002"] * 3


def test_a_sharded_checkpoint_rewritten_at_a_corrupt_ones_step_keeps_both(tmp_path, rdv):
    """Issue 40: a sharded checkpoint of step 2 whose shard fails its checksum, then step 2
    written again (resume=auto fell back past it): the corrupt record and ITS shard directory
    go to checkpoints/corrupt/, the new record and its new shard directory stay and load."""
    old = CheckpointManager(RunDir(tmp_path)).path(2)
    _save(rdv, tmp_path, 2)
    old_shards = shard_dir_of(old, load_checkpoint(old))
    flip_middle(old_shards / "__0_0.distcp", 16)
    path, _ = _save(rdv, tmp_path, 2)
    state = load_checkpoint(path)  # the new one verifies, shards and all
    assert shard_dir_of(path, state).name != old_shards.name
    corrupt = CheckpointManager(RunDir(tmp_path)).path(2).parent / "corrupt"
    assert sorted(p.name for p in corrupt.iterdir()) == sorted(
        ["step_00000002.pt", "step_00000002.pt.sha256", old_shards.name]
    )


# ----------------------------------------------------------------------------- in the background


def test_a_background_sharded_save_returns_while_held_and_writes_the_staged_shards(tmp_path, rdv):
    """Issue 43: the save returns once the shards are staged; the write (DCP over its own gloo
    group, SHA256SUMS, rename, record) is held in the background while the model trains on;
    the checkpoint then holds the state of the save, not the later one."""
    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    held, release = held_write(manager, 1)
    strategy, optimizer = _trained(1)
    saved = {k: v.full_tensor().clone() for k, v in strategy.model.state_dict().items()}
    path = manager.save(1, rdv, strategy, optimizer, lambda tensors: _record(1))
    assert held.wait(GUARD_S)
    assert path == manager.path(1) and not path.exists(), "committed on the training thread"
    assert manager.pending is not None and manager.checkpoint_group(rdv) is not rdv.cpu_group
    strategy.model(torch.randn(5, 6)).sum().backward()  # training goes on: a new step
    optimizer.step()
    release.set()
    manager.finish(rdv)
    state = load_checkpoint(path)  # the record and every shard verify
    fresh = _strategy(99)
    fresh_optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=1e-2)
    fresh.load_shards(
        fresh_optimizer, shard_dir_of(path, state), state["optimizer"]["param_groups"], str(path)
    )
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value.full_tensor(), saved[name]), name
    assert not [p for p in tmp_path.joinpath("checkpoints").iterdir() if p.name.endswith(".tmp")]


def _failing_background_save(tmp_path, rdv):
    """A background sharded save of step 1 whose write fails: held before its record, a
    directory made where the record goes, then released -> ``(manager, strategy, optimizer)``."""
    manager = CheckpointManager(RunDir(tmp_path), keep=2, asynchronous=True)
    held, release = held_write(manager, 1)
    strategy, optimizer = _trained(1)
    manager.save(1, rdv, strategy, optimizer, lambda tensors: _record(1))
    assert held.wait(GUARD_S)
    manager.path(1).mkdir()  # a directory where the record goes: the rename fails
    release.set()
    return manager, strategy, optimizer


def test_the_next_background_sharded_save_raises_the_failed_ones_line(tmp_path, rdv):
    """Issue 43: a background sharded write that fails (here its folder is made a file under
    it) is raised by the next save on the training thread, one line; nothing of it is kept."""
    manager, strategy, optimizer = _failing_background_save(tmp_path, rdv)
    with pytest.raises(CheckpointError) as caught:
        manager.save(2, rdv, strategy, optimizer, lambda tensors: _record(2))
    assert "is a directory, not a file" in str(caught.value) and "\n" not in str(caught.value)
    assert not list(manager.directory.glob("*.shards")) + list(manager.directory.glob("*.tmp"))


@pytest.mark.parametrize("re_formed", [False, True])
def test_a_failed_background_write_is_raised_by_finish_or_abandoned_after_a_re_form(
    re_formed, tmp_path, rdv, caplog
):
    """Issue 43: :meth:`finish` raises a failed background sharded write as one line in the
    world that began it; in a re-formed world (another gang group: a rank was lost during
    the write) it logs one line and goes on, nothing of the write left, so that the reload
    takes the newest checkpoint that verifies."""
    manager, _, _ = _failing_background_save(tmp_path, rdv)
    world = rdv
    if re_formed:
        world = Rendezvous(world=rdv.world, cpu_group=dist.new_group(backend="gloo"))
        manager.finish(world)
        assert "the background write of the checkpoint of step 1 did not finish" in caplog.text
    else:
        with pytest.raises(CheckpointError, match="is a directory, not a file"):
            manager.finish(world)
    assert manager.pending is None
    assert not list(manager.directory.glob("*.shards")) + list(manager.directory.glob("*.tmp"))


def test_shard_staging_reuses_its_buffers_while_the_layout_stays(rdv):
    """Issue 43: staged copies are CPU tensors of their own (a later change of the model does
    not reach them), reused by the next stage of the same layout, new for another layout."""
    strategy, optimizer = _trained(1)
    tensors, _ = strategy.shard_state(optimizer)
    stager = ShardStager()
    first = stager.stage(tensors)
    name = next(iter(first["model"]))
    kept = first["model"][name].to_local().clone()
    with torch.no_grad():
        for p in strategy.model.parameters():
            p.add_(1.0)
    assert torch.equal(first["model"][name].to_local(), kept)
    again = stager.stage(strategy.shard_state(optimizer)[0])
    assert again["model"][name].to_local().data_ptr() == first["model"][name].to_local().data_ptr()
    assert torch.equal(again["model"][name].to_local(), kept + 1.0)
    other = dict(tensors, extra=torch.zeros(3))
    assert shard_layout(other) != shard_layout(tensors)
    moved = stager.stage(other)
    assert moved["model"][name].to_local().data_ptr() != first["model"][name].to_local().data_ptr()
