"""Write files so that a reader never sees half of one: temp file in the same folder, rename.

``os.replace`` is atomic on POSIX within one filesystem, so a crash, a preemption or a full disk
leaves either the old file or the new one, never a mix. With ``durable=True`` the data and the
rename are fsynced (checkpoints, caches a later run trusts); logs and summaries skip the fsync.
Temporary files are named ``.<name>.<pid>.tmp`` next to the target, and are removed on any
error; :func:`remove_stale_temps` sweeps those a killed writer left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, List, Union

from hetseq_hpc.files.fence import check_write

PathLike = Union[str, "os.PathLike[str]"]


def current_umask() -> int:
    """This process's umask, e.g. ``0o022`` (``os.umask`` reads it only by setting it: it is
    set and put back).

    A new file's mode is ``0o666 & ~current_umask()``: for a file written by a library that
    makes it ``0o600`` (safetensors) but should look like any other new file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_path_for(path: PathLike) -> Path:
    """``<dir>/.<name>.<pid>.tmp``: the temporary sibling a write of ``path`` goes through."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_dir(directory: PathLike) -> None:
    """Make a rename inside ``directory`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[BinaryIO], Any], durable: bool = False) -> Path:
    """Call ``write(fh)`` on a temp file next to ``path``, then rename it over ``path``.

    Args:
        path: the final file; its folder is created if needed.
        write: writes the content into the binary file object it is given.
        durable: fsync the file and its folder (data must survive a power loss).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        RankFenced: ``path`` is in the run directory of a rank the others left out (or cut
            off from the job's store): nothing is written (:mod:`hetseq_hpc.files.fence`).
        Whatever ``write`` or the filesystem raises (``OSError`` for a full disk; torch's
        serializer raises ``RuntimeError`` there); the temporary file is removed first, and an
        existing ``path`` is untouched.
    """
    path = Path(path)
    check_write(path)  # a left-out rank writes nothing, not even the temporary file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        check_write(path, ask=False)  # still current after a long write (a lease will do)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: PathLike, data: bytes, durable: bool = False) -> Path:
    """Atomically replace ``path`` with ``data`` (see :func:`atomic_write`)."""
    return atomic_write(path, lambda fh: fh.write(data), durable=durable)


def atomic_write_text(path: PathLike, text: str, durable: bool = False) -> Path:
    """Atomically replace ``path`` with UTF-8 ``text`` (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: PathLike, data: Any, durable: bool = False) -> Path:
    """Atomically replace ``path`` with ``data`` as indented JSON (``default=str``)."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str), durable=durable)


def remove_stale_temps(directories: Iterable[PathLike]) -> List[Path]:
    """Delete ``.*.tmp`` files a killed writer left in ``directories``; returns what was removed.

    Call it only where no other live process writes (at the start of a run, on rank 0).
    """
    removed = []
    for directory in directories:
        directory = Path(directory)
        if not directory.is_dir():
            continue
        for tmp in directory.glob(".*.tmp"):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed
