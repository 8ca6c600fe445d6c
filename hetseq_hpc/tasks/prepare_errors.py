"""``task.prepare()`` with file-system failures as one line: the path, the reason, the fix.

A full disk or an unwritable ``task.data.cache_dir`` surfaces deep inside a cache build as a
bare ``OSError``; :func:`prepare_task` turns it into a :class:`~hetseq_hpc.errors.DataError`
that names the path (and, for a full disk, its mount point). The built-in caches are written
atomically with ``meta.json`` last (:mod:`hetseq_hpc.files.atomic`), so a failed build leaves nothing
a later run trusts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Optional

from hetseq_hpc.errors import DataError

#: errno values of a full disk or an exhausted quota
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: errno values of a path that may not be written
DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
#: errno values of a file standing where a directory should be (or the reverse)
SHAPE_ERRNOS = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
_FIX = "set task.data.cache_dir (or $HETSEQ_CACHE) to a writable directory"


def mount_point(path: Path) -> Path:
    """The mount point holding ``path`` (its nearest ancestor that is one)."""
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _blocking_file(path: Path) -> Optional[Path]:
    """The nearest ancestor of ``path`` (or ``path`` itself) that exists and is not a
    directory, or None."""
    path = Path(os.path.abspath(path))
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def describe_os_error(exc: OSError, cache: Optional[Path] = None) -> str:
    """One line for an ``OSError`` raised while preparing data.

    Args:
        exc: the error (its ``filename`` is the path when the OS named one).
        cache: the task's cache directory, if it has one (named when ``exc`` names no path).

    Returns:
        ``"<what> <path> (<reason>): <fix>"``, the fix depending on ``exc.errno``.
    """
    path = Path(exc.filename) if exc.filename else cache
    reason = exc.strerror or type(exc).__name__
    where = f"{str(path)!r}" if path is not None else "the data cache"
    if exc.errno in SPACE_ERRNOS:
        mount = mount_point(path.parent if path is not None else Path.cwd())
        return (
            f"no space left on {mount} while preparing the data (writing {where}; its "
            "unfinished files were removed, nothing half-written is used): free space there, "
            "or set task.data.cache_dir (or $HETSEQ_CACHE) to a disk with room"
        )
    if exc.errno in SHAPE_ERRNOS and path is not None:
        blocker = _blocking_file(path)
        if blocker is not None:
            return (
                f"cannot create the data cache {where}: {str(blocker)!r} is a file, not a "
                f"directory; {_FIX}"
            )
    if exc.errno in DENIED_ERRNOS:
        return f"cannot write the data cache {where} ({reason}): make it writable, or {_FIX}"
    return f"preparing the data failed on {where} ({reason}): check that path, or {_FIX}"


def prepare_task(task: Any) -> None:
    """Call ``task.prepare()``; a file-system error becomes one :class:`DataError` line.

    Raises:
        DataError: ``prepare()`` raised an ``OSError`` (full disk, read-only or missing
            folder, a file in place of the cache directory), or a ``DataError`` itself.
        Whatever else ``prepare()`` raises.
    """
    try:
        task.prepare()
    except OSError as exc:
        cache = getattr(task, "directory", None)
        raise DataError(describe_os_error(exc, Path(cache) if cache else None)) from None
