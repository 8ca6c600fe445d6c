"""Sharded checkpoints of FSDP runs: every rank writes and reads its own shard, in parallel.

With ``sharding.mode=fsdp`` and ``sharding.checkpoint=sharded`` (the default) no rank ever
holds the whole model state: each rank writes its shards of the parameters and of the AdamW
moments with ``torch.distributed.checkpoint`` (DCP, https://pytorch.org/docs/stable/distributed.checkpoint.html),
and a resume loads them through DCP, which reshards onto any world size. The files and their
safety rules are in :mod:`hetseq_hpc.train.shard_files`.

* :func:`save_sharded` (a collective): shards into a temp directory, every rank's SHA-256s
  gathered into ``SHA256SUMS``, the directory renamed into place, then rank 0 writes the
  checksummed commit record ``step_XXXXXXXX.pt`` (scheduler, step, RNG, config, the optimizer's
  param_groups ... everything but the tensors) through :func:`~hetseq_hpc.train.checkpoint.save_checkpoint`,
  with its retention.
* :func:`load_sharded` (a collective, FSDP): DCP loads into this rank's DTensor shards.
* :func:`full_state` (no collective): the whole model and optimizer state on the CPU, in the
  layout of a full checkpoint, for a DDP resume and for ``hetseq-hpc export``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.storage import filesystem_problem, write_problem
from hetseq_hpc.train.checkpoint import save_checkpoint, write_error
from hetseq_hpc.train.checkpoint_files import checkpoint_dir, checkpoint_path
from hetseq_hpc.train.shard_files import (
    METADATA,
    rank_files,
    read_metadata_safely,
    referenced_shard_dirs,
    safe_reader,
    sha256_file,
    shard_dir_name,
    shard_dir_of,
    sweep_orphans,
    verify_shards,
    write_manifest,
)

log = logging.getLogger(__name__)


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


def shard_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """This rank's shards: ``({"model": {fqn: DTensor}, "optim": {fqn: {name: tensor}}},
    param_groups)`` (parameter names in the groups' ``params``). Only tensors go to DCP (it
    would pickle anything else); the groups go to the record."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    optim = get_optimizer_state_dict(model, optimizer, options=_options())
    tensors = {"model": get_model_state_dict(model, options=_options()), "optim": optim["state"]}
    return tensors, optim["param_groups"]


def save_sharded(
    rdv: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    record: Dict[str, Any],
    run_dir: Path,
    step: int,
    keep: int,
) -> Path:
    """Write the checkpoint of ``step`` sharded (a collective: EVERY rank calls it).

    Args:
        rdv: the joined rendezvous.
        model: the FSDP2 model; optimizer: its optimizer.
        record: everything but the model and optimizer tensors (rank 0's is written).
        run_dir: the run directory; step: the optimizer step; keep: checkpoints kept.

    Returns:
        The commit record's path.

    Raises:
        CheckpointError: on every rank, when any rank could not write (disk full or
            read-only: named with its mount point; permissions); nothing of this write is left
            (no temp or unreferenced shard directory) and earlier checkpoints are kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank = rdv.world.rank
    folder = checkpoint_dir(run_dir)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    name = shard_dir_name(step, rdv.broadcast_object(secrets.token_hex(8) if rank == 0 else None))
    tmp, final = folder / f".{name}.tmp", folder / name
    error, problem, digests = None, None, {}
    try:
        tensors, groups = shard_state(model, optimizer)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, thread_count=1))
        digests = {p.name: sha256_file(p) for p in rank_files(tmp, rank)}
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, for any rank
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # torch's serializer loses the errno: ask the filesystem before the tmp is removed
        problem = write_problem(exc, folder) or filesystem_problem(folder)
    gathered = rdv.all_gather_objects((digests, error, problem))
    failed = next((e for _, e, _ in gathered if e), None)
    problem = next((p for _, _, p in gathered if p), None)
    path, error, renamed = None, None, False
    if rank == 0:
        try:
            if failed:
                raise OSError(failed)
            manifest = {k: v for d, _, _ in gathered for k, v in d.items()}
            manifest[METADATA] = sha256_file(tmp / METADATA)
            record = dict(
                record,
                model={},
                optimizer={"param_groups": groups},
                shards={
                    "dir": name,
                    "manifest_sha256": write_manifest(tmp, manifest),
                    "world_size": rdv.world.world_size,
                },
            )
            os.replace(tmp, final)
            renamed = True
            _fsync_dir(folder)
            path = save_checkpoint(record, run_dir, step, keep)
            sweep_orphans(folder, referenced_shard_dirs(run_dir))
        except (OSError, CheckpointError) as exc:
            if path is None:  # no record names the shards: nothing of this write is kept
                shutil.rmtree(final if renamed else tmp, ignore_errors=True)
            if isinstance(exc, CheckpointError):
                error = str(exc)
            elif problem or write_problem(exc, folder):  # full or read-only: named
                error = str(write_error(checkpoint_path(run_dir, step), exc, problem=problem))
            else:
                error = (
                    f"could not write sharded checkpoint {str(final)!r} ({exc}; earlier "
                    "checkpoints are kept): free disk space or fix permissions, then continue "
                    f"with hetseq-hpc hydra.run.dir={run_dir} trainer.resume=auto"
                )
    path, error = rdv.broadcast_object((path and str(path), error))
    if error:
        raise CheckpointError(error)
    return Path(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model_keys(metadata: Any) -> set:
    return {
        key[len("model.") :] for key in metadata.state_dict_metadata if key.startswith("model.")
    }


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    param_groups: List[Dict[str, Any]],
    source: str,
) -> None:
    """Load a sharded checkpoint into this rank's FSDP2 shards (a collective: EVERY rank calls
    it); DCP reads the pieces each shard needs, whatever world size wrote them.

    Raises:
        CheckpointError: the checkpoint holds another model (names, shapes), or reading failed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    metadata = read_metadata_safely(directory)
    model_sd = get_model_state_dict(model, options=_options())
    _same_model(set(model_sd), _model_keys(metadata), source)
    # torch creates the optimizer state to load into by a step on zero gradients (lr 0)
    optimizer.zero_grad(set_to_none=True)
    optim = get_optimizer_state_dict(model, optimizer, options=_options())["state"]
    saved = {key for key in metadata.state_dict_metadata if key.startswith("optim.")}
    optim = {
        fqn: v
        for fqn, v in optim.items()  # parameters that never had a gradient
        if all(f"optim.{fqn}.{k}" in saved for k in v)
    }
    tensors = {"model": model_sd, "optim": optim}
    try:
        dcp.load(
            tensors,
            storage_reader=safe_reader(directory),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    except Exception as exc:
        raise _different(source, exc) from None
    set_model_state_dict(model, tensors["model"], options=_options())
    set_optimizer_state_dict(
        model,
        optimizer,
        {"state": tensors["optim"], "param_groups": param_groups},
        options=_options(),
    )


def _same_model(wanted: set, saved: set, source: str) -> None:
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {source!r} holds a different model (missing keys {missing[:3]}, "
            f"unexpected keys {unexpected[:3]}): use the task.model settings it was trained with, "
            "or a new run directory"
        )


def _different(source: str, exc: BaseException) -> CheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"checkpoint {source!r} could not be loaded into this model "
        f"({first[:200]}): use the task.model settings it was trained with, "
        "or a new run directory"
    )


def full_state(
    directory: Path, param_groups: List[Dict[str, Any]], optimizer: bool = True
) -> Dict[str, Any]:
    """The whole model and optimizer state of a sharded checkpoint on the CPU, in a full
    checkpoint's layout (``{"model": {fqn: tensor}, "optimizer": Optimizer.state_dict()
    layout}``), read by THIS process alone (no collective): a DDP resume, ``export``
    (``optimizer=False``: the model only, nothing of the optimizer is read).

    Raises:
        CheckpointError: the metadata is refused or a file cannot be read.
    """
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata_safely(directory)
    paths = metadata.planner_data or {}
    nested: Dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = paths.get(key) or tuple(key.split(".", 1))
        if not all(isinstance(p, (str, int)) for p in path) or len(path) < 2:
            raise CheckpointError(
                f"sharded checkpoint {str(directory)!r} is refused: entry "
                f"{key!r} has no valid place: resume from another checkpoint"
            )
        if path[0] != "model" and not optimizer:
            continue
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(nested, storage_reader=safe_reader(directory), no_dist=True)
    except Exception as exc:
        raise _different(str(directory), exc) from None
    order = [fqn for group in param_groups for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    optim = nested.get("optim", {})
    return {
        "model": nested.get("model", {}),
        "optimizer": {
            "state": {index[fqn]: optim[fqn] for fqn in order if fqn in optim},
            "param_groups": [
                {**g, "params": [index[f] for f in g["params"]]} for g in param_groups
            ],
        },
    }


def with_full_tensors(record: Dict[str, Any], record_path: Path) -> Dict[str, Any]:
    """A sharded checkpoint's record with the whole model and optimizer state filled in
    (:func:`full_state`); a full checkpoint is returned as it is."""
    if "shards" not in record:
        return record
    directory = verify_shards(record_path, record, full=False)
    return dict(record, **full_state(directory, record["optimizer"]["param_groups"]))


def load_tensors(
    parallel: Any, optimizer: torch.optim.Optimizer, state: Dict[str, Any], source: str
) -> None:
    """Load a checkpoint's model and optimizer state through ``parallel``
    (:mod:`hetseq_hpc.train.parallel`): a sharded checkpoint into FSDP shards with
    :func:`load_sharded`; otherwise the full state (a sharded one made whole by
    :func:`with_full_tensors`). A collective under FSDP.

    Raises:
        CheckpointError: the checkpoint holds another model; one line naming ``source``.
    """
    if "shards" in state and parallel.sharded:  # each rank reads what its shard needs
        load_sharded(
            parallel.model,
            optimizer,
            shard_dir_of(Path(source), state),
            state["optimizer"]["param_groups"],
            source,
        )
        return
    state = with_full_tensors(state, Path(source))
    try:
        parallel.load_model_state(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint {source!r} holds a different model ({str(exc).splitlines()[0]}): use "
            "the task.model settings it was trained with, or a new run directory"
        ) from None
    parallel.load_optimizer_state(optimizer, state["optimizer"])
