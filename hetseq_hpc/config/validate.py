"""Checks that span config groups, run before any process or job starts."""

from __future__ import annotations

import codecs
import glob
import os
from typing import TYPE_CHECKING, List

from hetseq_hpc.config.cluster import visible_gpu_count
from hetseq_hpc.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.config.schema import RunConfig

__all__ = ["check_text_file", "expand_data_files", "planned_world_size", "validate_run_config",
           "visible_gpu_count"]

#: bytes of each data file read before any process starts (the rest is checked while loading);
#: git's binary detection looks at the same first 8000 bytes (xdiff-interface.c, FIRST_FEW_BYTES)
TEXT_PROBE_BYTES = 8000


def planned_world_size(run: RunConfig) -> int:
    """World size the launch will create: ``cluster.ranks`` (or GPUs, else 2) locally; the sum of
    partition ranks on SLURM (:meth:`ClusterConfig.planned_world_size`)."""
    return run.cluster.planned_world_size()


def expand_data_files(patterns: list) -> list:
    """Expand paths and globs (``~`` too) to a sorted list of files. A pattern that names an
    existing file is that file, even if its name holds glob characters (``data[1].txt``).

    Raises:
        ConfigError: a pattern matches no file.
    """
    files = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        if os.path.isfile(expanded):
            files.append(expanded)
            continue
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not matches:
            raise ConfigError(
                f"task.data.files entry {str(pattern)!r} matches no file: check the path "
                "(globs like 'data/**/*.txt' are allowed), or drop task.data.files to use the "
                "embedded corpus"
            )
        files.extend(matches)
    return files


def check_text_file(path: str, probe_bytes: int = TEXT_PROBE_BYTES) -> None:
    """A data file must hold UTF-8 text: not empty, no NUL bytes, valid UTF-8 in its first
    ``probe_bytes`` bytes (a multi-byte character cut at the end of the probe is fine).

    Raises:
        ConfigError: the file is unreadable, empty (or only whitespace), binary, or not UTF-8.
    """
    fix = "give UTF-8 text files in task.data.files (convert with iconv -t UTF-8), or drop it"
    try:
        with open(path, "rb") as fh:
            head = fh.read(probe_bytes)
            more = bool(fh.read(1))
    except OSError as exc:
        raise ConfigError(f"task.data.files: cannot read {path!r} ({exc.strerror}): {fix}") from None
    if not head.strip() and not more:
        raise ConfigError(f"task.data.files: {path!r} is empty: {fix}")
    if b"\x00" in head:
        raise ConfigError(f"task.data.files: {path!r} is a binary file (it holds NUL bytes): {fix}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"task.data.files: {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason}): {fix}"
        ) from None


def _data_files(run: RunConfig) -> List[str]:
    files = getattr(getattr(run.task, "data", None), "files", None)
    return list(files) if files else []


def validate_run_config(run: RunConfig) -> None:
    """Cross-group checks: world size against the global batch and a forced allocation,
    per-rank cluster settings, data files exist and hold text.

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
    run.cluster.check_world(world)
    for path in expand_data_files(_data_files(run)):
        check_text_file(path)
    if run.optim.schedule_steps is not None and run.optim.schedule_steps < trainer.max_steps:
        raise ConfigError(
            f"optim.schedule_steps={run.optim.schedule_steps} is below trainer.max_steps="
            f"{trainer.max_steps}: the learning rate would reach 0 early; raise it or leave it null"
        )
