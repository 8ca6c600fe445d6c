"""The files of ``<run dir>/checkpoints``: names, checksums, which run wrote them, retention.

* ``step_XXXXXXXX.pt`` and its SHA-256 sidecar ``step_XXXXXXXX.pt.sha256`` (``sha256sum``
  format, so ``sha256sum -c`` checks it by hand).
* Retention (:func:`apply_retention`) counts only checkpoints that VERIFY and belong to the
  current run (their ``run_id``, see :mod:`hetseq_hpc.rundir.history`); it never deletes the
  checkpoint just written nor any checkpoint newer than it, and a checkpoint that fails its
  checksum is moved to ``checkpoints/corrupt/`` (kept for inspection, never counted, never
  deleted). A checkpoint written at the step of one that fails its checksum moves that one
  there first (:func:`set_aside_corrupt`) instead of overwriting it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Collection, Dict, List, Optional, Tuple

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.pt\Z")
#: where retention moves checkpoints that fail their checksum
CORRUPT_DIR = "corrupt"
#: how every "this checkpoint is bad" message ends
FIX = (
    "resume from another checkpoint (trainer.resume=auto skips bad ones), or set "
    "trainer.resume=never to start over"
)

#: checkpoints already verified by this process: path -> ((size, mtime_ns), run id or "")
_VERIFIED: Dict[str, Tuple[tuple, str]] = {}


def checkpoint_dir(run_dir: Path) -> Path:
    """``<run dir>/checkpoints``."""
    return RunDir(run_dir).checkpoints


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Path of the checkpoint after optimizer step ``step``."""
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def checksum_path(path: Path) -> Path:
    """The SHA-256 sidecar of checkpoint ``path``: ``<path>.sha256``."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def step_of(path: Path) -> int:
    """The optimizer step in a checkpoint's file name (``step_00000012.pt`` -> 12)."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named step_XXXXXXXX.pt")
    return int(match.group(1))


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Checkpoint files of a run directory (regular files named ``step_XXXXXXXX.pt``; a
    directory or FIFO of that name is not one), oldest step first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        try:
            regular = match is not None and stat.S_ISREG(path.stat().st_mode)
        except OSError:
            regular = False
        if regular:
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def _sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def stored_checksum(path: Path) -> str:
    """The SHA-256 (hex, lower case) that ``path``'s ``.sha256`` sidecar records; cheap (the
    checkpoint itself is not read), so a launcher can refuse a wrong ``trainer.resume`` file
    before anything starts.

    Raises:
        CheckpointError: the sidecar is missing or unreadable.
    """
    sidecar = checksum_path(path)
    try:
        return sidecar.read_text(encoding="ascii").split()[0].lower()
    except (OSError, UnicodeDecodeError, IndexError):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or incomplete: its checksum file "
            f"{sidecar.name} is missing or unreadable (cut off while saving, or not written by "
            f"this hetseq_hpc): {FIX}"
        ) from None


def verify_checksum(path: Path) -> None:
    """Check ``path`` against its ``.sha256`` sidecar.

    Raises:
        CheckpointError: the sidecar is missing or unreadable, or the content differs.
    """
    sidecar = checksum_path(path)
    want = stored_checksum(path)
    got = _sha256_of(path)
    if got != want:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: its SHA-256 {got[:16]}... differs from "
            f"{want[:16]}... in {sidecar.name}: {FIX}"
        )


def stored_state(path: Path) -> dict:
    """A checkpoint's content, read memory-mapped with ``torch.load(weights_only=True)`` (no
    weights are read until used, no code runs); ``{}`` when it is not a dict.

    Raises:
        CheckpointError: the file cannot be read as a checkpoint.
    """
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unreadable ({type(exc).__name__}): {FIX}"
        ) from None
    return state if isinstance(state, dict) else {}


def stored_run_id(path: Path) -> str:
    """The ``run_id`` a checkpoint was written by, ``""`` for one written before run ids
    existed (:func:`stored_state`).

    Raises:
        CheckpointError: the file cannot be read as a checkpoint.
    """
    value = stored_state(path).get("run_id")
    return value if isinstance(value, str) else ""


def shard_dirs(path: Path) -> List[Path]:
    """The shard directories of checkpoint ``path``'s step (``step_XXXXXXXX.<token>.shards``,
    :mod:`hetseq_hpc.train.shard_files`); empty for a full checkpoint."""
    stem = Path(path).name[: -len(".pt")]
    return sorted(p for p in Path(path).parent.glob(f"{stem}.*.shards") if p.is_dir())


def verified_run_id(path: Path) -> str:
    """:func:`verify_checksum` (and a sharded checkpoint's files), then its run id; cached per file size and mtime, so
    retention hashes each checkpoint once per process.

    Raises:
        CheckpointError: the checkpoint does not verify or cannot be read.
    """
    info = Path(path).stat()
    key = (
        info.st_size,
        info.st_mtime_ns,
        tuple(  # a sharded checkpoint: its files too
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for d in shard_dirs(path)
            for f in sorted(d.iterdir())
        ),
    )
    cached = _VERIFIED.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    verify_checksum(path)
    state = stored_state(path)
    if "shards" in state:  # a sharded checkpoint verifies only with all its files
        from hetseq_hpc.train.shard_files import verify_shards

        verify_shards(path, state)
    run_id = state.get("run_id") if isinstance(state.get("run_id"), str) else ""
    _VERIFIED[str(path)] = (key, run_id)
    return run_id


def quarantine(path: Path, keep_shards: Collection[str] = ()) -> Path:
    """Move a bad checkpoint and its sidecar (and its step's shard directories, but those
    named in ``keep_shards``) to ``checkpoints/corrupt/`` (never deleted); returns the new
    path."""
    target_dir = Path(path).parent / CORRUPT_DIR
    target_dir.mkdir(exist_ok=True)
    target = target_dir / Path(path).name
    n = 1
    while target.exists():
        n += 1
        target = target_dir / f"{Path(path).name}.{n}"
    os.replace(path, target)
    _VERIFIED.pop(str(path), None)
    sidecar = checksum_path(path)
    if sidecar.exists():
        os.replace(sidecar, target.with_name(target.name + ".sha256"))
    for shards in shard_dirs(path):  # a sharded checkpoint's tensors go with its record
        if shards.name not in keep_shards:
            os.replace(shards, target_dir / shards.name)
    return target


def set_aside_corrupt(path: Path, keep_shards: Collection[str] = ()) -> Optional[Path]:
    """Before a checkpoint is written to ``path``: a checkpoint already there that does not
    verify (``trainer.resume=auto`` fell back past it and the run trained to its step again)
    is moved to ``checkpoints/corrupt/`` (:func:`quarantine`) instead of being overwritten.
    One that verifies is left for the write to replace (the same step trained again).

    Args:
        path: the checkpoint about to be written; keep_shards: shard directories of the new
            checkpoint already in place (a sharded save), which stay.

    Returns:
        where the corrupt file went, or None (nothing there, or it verifies).
    """
    try:
        if not stat.S_ISREG(Path(path).stat().st_mode):
            return None
    except OSError:  # nothing there
        return None
    try:
        verified_run_id(path)
        return None
    except (CheckpointError, OSError) as exc:
        moved = quarantine(path, keep_shards)
        log.warning(
            "%s; moved to %s before writing the new checkpoint of its step (not overwritten)",
            str(exc).rsplit(": ", 1)[0],
            moved,
        )
        return moved


def apply_retention(run_dir: Path, written: Path, keep: int, run_id: Optional[str]) -> List[Path]:
    """Keep ``written`` and the newest ``keep - 1`` older verified checkpoints of run
    ``run_id``; delete the other older ones of that run.

    Never deleted: the checkpoint just written, any checkpoint of a later step, checkpoints of
    another run (a different ``run_id``), files that do not verify (moved to
    ``checkpoints/corrupt/`` with a warning instead, whatever their step). A checkpoint without a run id (written
    before run ids existed) counts as the current run's.

    Args:
        run_dir: the run directory.
        written: the checkpoint just written (trusted: its hash was computed while writing).
        keep: ``trainer.keep_checkpoints`` (>= 1).
        run_id: the current run's id (None: every verified checkpoint counts).

    Returns:
        The checkpoints deleted.
    """
    written_step = step_of(written)
    older: List[Path] = []
    for path in list_checkpoints(run_dir):
        if path == written:
            continue
        try:
            owner = verified_run_id(path)
        except (CheckpointError, OSError) as exc:
            moved = quarantine(path)
            log.warning(
                "%s; moved to %s (not counted by retention, not deleted)",
                str(exc).rsplit(": ", 1)[0],
                moved,
            )
            continue
        if step_of(path) > written_step or (run_id and owner and owner != run_id):
            continue  # a later step, or another run's file: not ours to delete
        older.append(path)
    doomed = older[: max(len(older) - (keep - 1), 0)]
    for path in doomed:
        for shards in shard_dirs(path):
            shutil.rmtree(shards, ignore_errors=True)
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)
        _VERIFIED.pop(str(path), None)
    return doomed


__all__ = [
    "CORRUPT_DIR",
    "FIX",
    "apply_retention",
    "checkpoint_dir",
    "checkpoint_path",
    "checksum_path",
    "list_checkpoints",
    "quarantine",
    "set_aside_corrupt",
    "shard_dirs",
    "step_of",
    "stored_run_id",
    "stored_state",
    "verified_run_id",
    "verify_checksum",
]
