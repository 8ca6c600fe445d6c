"""``hetseq-hpc export RUN_DIR``: the trained model as one safetensors file, for inference.

The newest checkpoint of the run directory that verifies (its checksum, safe loading; the
same choice as ``trainer.resume=auto``), or the one ``--checkpoint`` names, is read and its
full model state is written to ``--out`` (default ``RUN_DIR/model.safetensors``) with the
safetensors format (https://huggingface.co/docs/safetensors: tensors only, no code runs when
it is loaded). An FSDP run's sharded checkpoint is read whole, shard by shard, on this one
process (no ranks needed), so it exports the same way as a DDP run. Weights tied in the model (BERT's embedding and output layer) are
stored under both names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def export_command(
    run_dir: str, out: Optional[str] = None, checkpoint: Optional[str] = None
) -> Path:
    """Write the model of ``run_dir``'s checkpoint to ``out``; returns the file written.

    Raises:
        CheckpointError: no checkpoint verifies (or the named one does not), or ``out``
            cannot be written; one line naming the file and the fix. Nothing half-written stays.
    """
    import os

    from safetensors.torch import save_file

    from hetseq_hpc.errors import CheckpointError
    from hetseq_hpc.files.atomic import temp_path_for
    from hetseq_hpc.train.checkpoint import choose_checkpoint
    from hetseq_hpc.train.shard_files import shard_dir_of

    folder = Path(run_dir).expanduser()
    if not folder.is_dir():  # read-only is fine: only --out is written
        raise CheckpointError(
            f"run directory {str(folder)!r} does not exist or is not a "
            "directory: pass the hydra.run.dir of a run that wrote checkpoints"
        )
    choice = choose_checkpoint(checkpoint or "auto", folder)
    if choice.path is None or choice.state is None:
        raise CheckpointError(
            f"run directory {str(folder)!r} has no checkpoint: train first "
            "(checkpoints are written every trainer.checkpoint_every steps "
            "and at the end)"
        )
    state = choice.state
    if "shards" in state:  # an FSDP run's sharded checkpoint: its model, read whole
        from hetseq_hpc.train.sharded_checkpoint import full_state

        state["model"] = full_state(shard_dir_of(choice.path, state), [], optimizer=False)["model"]
    state.pop("optimizer", None)  # the moments are not exported: free them first
    tensors, seen = {}, set()
    for k, v in state["model"].items():  # tied weights: each name gets its own storage
        v = v.detach().contiguous()
        tensors[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v
        seen.add(v.untyped_storage().data_ptr())
    metadata = {
        "format": "pt",
        "step": str(state["step"]),
        "run_id": str(state.get("run_id", "")),
        "source": str(choice.path),
    }
    target = Path(out).expanduser() if out else folder / "model.safetensors"
    tmp = temp_path_for(target)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        mask = os.umask(0)  # safetensors creates 0600: give the file the usual mode
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write {str(target)!r} ({exc.strerror or exc}): choose another --out"
        ) from None
    return target
