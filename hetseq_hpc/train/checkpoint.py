"""Atomic checkpoints in ``<run dir>/checkpoints``.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then
renamed over its final name (``os.replace`` is atomic on POSIX), so a crash or a preemption
never leaves a half-written ``step_XXXXXXXX.pt``. Only complete files match the name pattern.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hetseq_hpc.errors import CheckpointError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.pt$")
#: bump when the checkpoint layout changes
FORMAT_VERSION = 1


def checkpoint_dir(run_dir: Path) -> Path:
    """``<run dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Path of the checkpoint after optimizer step ``step``."""
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Complete checkpoints of a run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(state: Dict[str, Any], run_dir: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; keep the newest ``keep`` files.

    Raises:
        CheckpointError: the file cannot be written (disk full, permissions); any temporary
            file is removed and earlier checkpoints are untouched.
    """
    final = checkpoint_path(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    payload = dict(state, format_version=FORMAT_VERSION, step=step)
    try:
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {str(final)!r} ({exc.strerror}): free disk space or fix "
            "permissions; earlier checkpoints are intact"
        ) from exc
    try:  # make the rename itself durable
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("checkpoint: %s", final)
    return final


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Read a checkpoint onto the CPU.

    Raises:
        CheckpointError: the file is missing, truncated or not a hetseq_hpc checkpoint; the
            message names the file and how to go on.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist: check trainer.resume, or set "
            "trainer.resume=auto to use the latest checkpoint of the run directory"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or unreadable ({type(exc).__name__}): delete it "
            "to resume from the previous checkpoint, or set trainer.resume=never to start over"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a hetseq_hpc checkpoint of format {FORMAT_VERSION}: "
            "point trainer.resume at one written by this version, or set trainer.resume=never"
        )
    return state


def resolve_resume(resume: str, run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from: ``auto`` = the newest in the run dir (None if none),
    ``never`` = None, anything else = that path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    return Path(os.path.expanduser(resume))
