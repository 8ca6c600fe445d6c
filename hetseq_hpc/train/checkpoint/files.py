"""The files of one checkpoint: names, the SHA-256 sidecar, the record read without running code.

* ``checkpoints/step_XXXXXXXX.pt`` and its sidecar ``step_XXXXXXXX.pt.sha256`` (``sha256sum``
  format, so ``sha256sum -c`` checks it by hand); :func:`sha256_file` is the one file hash of
  the package (sidecars and a sharded checkpoint's ``SHA256SUMS`` alike).
* What a run directory does with them (choosing, saving, retention, quarantine) is
  :class:`~hetseq_hpc.train.checkpoint.manager.CheckpointManager`'s.
"""

from __future__ import annotations

import hashlib
import re
import stat
from pathlib import Path
from typing import List

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir

_NAME = re.compile(r"^step_(\d{8})\.pt\Z")
#: where retention moves checkpoints that fail their checksum
CORRUPT_DIR = RunDir.CORRUPT_NAME
#: how every "this checkpoint is bad" message ends
FIX = (
    "resume from another checkpoint (trainer.resume=auto skips bad ones), or set "
    "trainer.resume=never to start over"
)


def checkpoint_name(step: int) -> str:
    """``step_XXXXXXXX.pt``: the file name of the checkpoint after optimizer step ``step``."""
    return f"step_{step:08d}.pt"


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


def checkpoints_in(directory: Path) -> List[Path]:
    """Checkpoint files of a ``checkpoints`` directory (regular files named
    ``step_XXXXXXXX.pt``; a directory or FIFO of that name is not one), oldest step first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        try:
            regular = match is not None and stat.S_ISREG(path.stat().st_mode)
        except OSError:
            regular = False
        if regular and match is not None:
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
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
    got = sha256_file(path)
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
    import torch  # lazily: the command line reads records before any rank starts

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


__all__ = [
    "CORRUPT_DIR",
    "FIX",
    "checkpoint_name",
    "checkpoints_in",
    "checksum_path",
    "sha256_file",
    "step_of",
    "stored_checksum",
    "stored_run_id",
    "stored_state",
    "verify_checksum",
]
