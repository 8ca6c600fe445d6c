"""Checks that span config groups, run before any process or job starts."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config.schema import RunConfig


def visible_gpu_count() -> int:
    """GPUs this process could use (``torch.cuda.device_count()``; 0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - broken CUDA install
        return 0


def planned_world_size(run: "RunConfig") -> int:
    """World size the launch will create: ``cluster.ranks`` (or GPUs, else 2) locally; the sum of
    partition ranks on SLURM."""
    cluster = run.cluster
    if cluster.name == "local":
        if cluster.ranks is not None:
            return cluster.ranks
        gpus = visible_gpu_count()
        return gpus if gpus > 0 else 2
    return cluster.world_size


def expand_data_files(patterns: list) -> list:
    """Expand paths and globs (``~`` too) to a sorted list of files.

    Raises:
        ConfigError: a pattern matches no file.
    """
    files = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not matches:
            raise ConfigError(
                f"task.data.files entry {str(pattern)!r} matches no file: check the path "
                "(globs like 'data/**/*.txt' are allowed), or drop task.data.files to use the "
                "embedded corpus"
            )
        files.extend(matches)
    return files


def validate_run_config(run: "RunConfig") -> None:
    """Cross-group checks: world size against the global batch and a forced allocation,
    data files exist, speeds match the ranks.

    Raises:
        ConfigError: with the offending values and the fix, in one line.
    """
    world = planned_world_size(run)
    trainer = run.trainer
    if trainer.global_batch_size < world:
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is smaller than the world size "
            f"{world}: every rank needs at least one sample; raise trainer.global_batch_size to "
            f">= {world} or use fewer ranks"
        )
    if trainer.allocation is not None and len(trainer.allocation) != world:
        raise ConfigError(
            f"trainer.allocation={list(trainer.allocation)} has {len(trainer.allocation)} entries "
            f"but the world size is {world}: give one sample count per rank"
        )
    if run.cluster.name == "local" and run.cluster.speeds and len(run.cluster.speeds) != world:
        raise ConfigError(
            f"cluster.speeds={list(run.cluster.speeds)} has {len(run.cluster.speeds)} entries but "
            f"cluster.ranks is {world}: give one speed per rank"
        )
    files = getattr(getattr(run.task, "data", None), "files", None)
    if files:
        expand_data_files(files)
    if run.optim.schedule_steps is not None and run.optim.schedule_steps < trainer.max_steps:
        raise ConfigError(
            f"optim.schedule_steps={run.optim.schedule_steps} is below trainer.max_steps="
            f"{trainer.max_steps}: the learning rate would reach 0 early; raise it or leave it null"
        )
