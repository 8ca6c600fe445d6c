"""A full or read-only run directory, named in one line.

A write that fails on a full filesystem (``ENOSPC``, ``EDQUOT``, ``EFBIG``) or a read-only one
(``EROFS``) says so, with the mount point, the run directory and the fix
(:func:`storage_error`), wherever the write was: a checkpoint, ``metrics.jsonl``, a summary.
Some writers lose the errno (torch's serializer, DCP); :func:`filesystem_problem` then asks the
filesystem itself (``os.statvfs``), as the launcher does for a rank that died without being
able to write its own error file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import List, Optional, Union

from hetseq_hpc.errors import HetseqError, StorageError

PathLike = Union[str, "os.PathLike[str]"]

#: errnos of a write that found no room: no space, over quota, file too large
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: a filesystem with less room than this is full for a run (its config, logs and rows alone
#: are larger; a write that just failed for lack of room leaves less than a page on tmpfs)
MIN_FREE_BYTES = 1 << 20


def mount_point(path: PathLike) -> Path:
    """The mount point of the filesystem that holds ``path`` (or its nearest existing
    ancestor)."""
    path = existing_ancestor(path)
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def existing_ancestor(path: PathLike) -> Path:
    """``path`` made absolute, or its nearest ancestor that exists."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _chain(exc: Optional[BaseException]) -> List[BaseException]:
    """``exc``, its causes and contexts, and the per-rank errors a DCP CheckpointException
    carries (``failures``: rank -> (error, traceback))."""
    seen: List[BaseException] = []
    todo = [exc] if exc is not None else []
    while todo:
        cur = todo.pop()
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        todo += [cur.__cause__, cur.__context__]
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) and v else v for v in failures.values()]
    return [e for e in seen if isinstance(e, BaseException)]


def write_problem(exc: Optional[BaseException], path: PathLike) -> Optional[str]:
    """``"no space left on <mount>"`` or ``"<mount> is read-only"`` when ``exc`` (or an error it
    was raised from) is a full or read-only filesystem's error, else None. ``path`` is where
    the write went (its mount point is named)."""
    codes = {getattr(e, "errno", None) for e in _chain(exc)}
    if errno.EROFS in codes:
        return f"{mount_point(path)} is read-only"
    if codes & SPACE_ERRNOS:
        quota = " (disk quota exceeded)" if errno.EDQUOT in codes else ""
        return f"no space left on {mount_point(path)}{quota}"
    return None


def filesystem_problem(path: PathLike, min_free: int = MIN_FREE_BYTES) -> Optional[str]:
    """``"<mount> is read-only"`` or ``"no space left on <mount>"`` (under ``min_free`` bytes
    free) by ``os.statvfs`` of ``path``'s filesystem, else None (also when it cannot be
    asked)."""
    where = existing_ancestor(path)
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"{mount_point(where)} is read-only"
    if st.f_blocks and st.f_bavail * st.f_frsize < min_free:  # no blocks: procfs, not a disk
        return f"no space left on {mount_point(where)}"
    return None


def fix_for(problem: str, run_dir: PathLike) -> str:
    """How to go on after ``problem`` (:func:`write_problem`) in run directory ``run_dir``."""
    go_on = f"then continue with hetseq-hpc hydra.run.dir={run_dir} trainer.resume=auto"
    if problem.endswith("is read-only"):
        return f"make it writable or copy the run directory elsewhere, {go_on}"
    return f"free space or move hydra.run.dir, {go_on}"


def storage_message(problem: str, run_dir: PathLike, writing: Optional[PathLike] = None) -> str:
    """The one line for ``problem`` in ``run_dir``: the problem, the run directory, what was
    being written, and the fix."""
    what = f"; writing {writing}" if writing else ""
    return f"{problem} (run directory {run_dir}{what}): {fix_for(problem, run_dir)}"


def storage_error(
    run_dir: PathLike, exc: BaseException, writing: Optional[PathLike] = None
) -> Optional[StorageError]:
    """A one-line :class:`~hetseq_hpc.errors.StorageError` for ``exc`` when it (or an error it
    was raised from) is a full or read-only filesystem's error, else None.

    Args:
        run_dir: the run directory.
        exc: the error a write raised.
        writing: the file being written (default: the file name the OSError carries).
    """
    if writing is None:
        writing = next(
            (e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None
        )
    problem = write_problem(exc, writing or run_dir)
    return StorageError(storage_message(problem, run_dir, writing)) if problem else None


def reported(exc: BaseException, run_dir: PathLike) -> BaseException:
    """What a failed rank reports for ``exc``: the one-line :class:`StorageError` when it is a
    full or read-only filesystem's error that no one has put in words yet (not a
    :class:`~hetseq_hpc.errors.HetseqError`), else ``exc`` itself."""
    if isinstance(exc, HetseqError):
        return exc
    return storage_error(run_dir, exc) or exc
