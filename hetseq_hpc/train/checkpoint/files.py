"""The files of one checkpoint: names, the SHA-256 sidecar, the record read without running code.

* ``checkpoints/step_XXXXXXXX.pt`` and its sidecar ``step_XXXXXXXX.pt.sha256`` (``sha256sum``
  format, so ``sha256sum -c`` checks it by hand); :func:`sha256_file` is the one file hash of
  the package (sidecars and a sharded checkpoint's ``SHA256SUMS`` alike).
* What a run directory does with them (choosing, saving, retention, quarantine) is
  :class:`~hetseq_hpc.train.checkpoint.manager.CheckpointManager`'s.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import stat
import zipfile
from pathlib import Path
from typing import Any, List

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


class _Unbuilt:
    """What :class:`_PlainUnpickler` makes of every object that is not plain data (a tensor, a
    storage, a torch type): nothing is built, no code of the file's choosing runs."""

    def __new__(cls, *args: object, **kwargs: object) -> _Unbuilt:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


class _UnbuiltDict(dict):
    """``collections.OrderedDict`` as :class:`_PlainUnpickler` builds it: a dict that drops
    the attributes pickled beside its items (a state dict's ``_metadata``)."""

    def __setstate__(self, state: object) -> None:
        pass


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save`` file's ``data.pkl`` building only Python's containers and
    scalars (and ``collections.OrderedDict``); every other global is :class:`_Unbuilt`."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return _UnbuiltDict
        return _Unbuilt

    def persistent_load(self, pid: object) -> Any:  # a tensor's storage: never read
        return _Unbuilt()


def _plain(value: object) -> bool:
    if isinstance(value, _Unbuilt):
        return False
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def stored_entry(path: Path, key: str) -> Any:
    """Entry ``key`` of a checkpoint (None when it has none), read without importing torch
    where the entry is plain data (None, bool, int, float, str, lists/tuples/dicts of them: the
    run fingerprint ``config``, ``run_id``, ``step``): only the file's pickle (``data.pkl`` of
    the ``torch.save`` zip, tens of KiB) is read, no weights, and nothing but those types is
    built. The launcher's pre-flight checks read it before any rank starts, where importing
    torch would cost ~3 CPU-s per command. Any other file or entry is read by
    :func:`stored_state` (torch). It judges no other entry: a file whose other entries torch
    would refuse (a code-running global) is refused where the checkpoint is loaded.

    Raises:
        CheckpointError: the file cannot be read as a checkpoint (:func:`stored_state`).
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(names) == 1:
                state = _PlainUnpickler(io.BytesIO(archive.read(names[0]))).load()
                if isinstance(state, dict) and _plain(state.get(key)):
                    return state.get(key)
    except Exception:  # not a zip, a cut-off file, an odd pickle: torch names the problem
        pass
    return stored_state(path).get(key)


def stored_run_id(path: Path) -> str:
    """The ``run_id`` a checkpoint was written by, ``""`` for one written before run ids
    existed (:func:`stored_entry`: without torch where the file allows).

    Raises:
        CheckpointError: the file cannot be read as a checkpoint.
    """
    value = stored_entry(path, "run_id")
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
    "stored_entry",
    "stored_run_id",
    "stored_state",
    "verify_checksum",
]
