"""The write fence of a rank: every write into the run directory asks it first.

A rank of an elastic job (``trainer.elastic``) installs one check (:func:`install`; the worker
does, with :class:`~hetseq_hpc.distributed.fence.GenerationFence`): it raises
:class:`~hetseq_hpc.errors.RankFenced` when the others re-formed the world without this rank,
or when the job's store cannot confirm that they have not. The writers of the run directory
call :func:`check_write` (atomic writes, ``metrics.jsonl``, ``events.jsonl``, checkpoints and
their shards) or :func:`may_write` (the rank's log file: never raises) before they write, so a
rank that was partitioned away writes nothing once it was left out. Without an installed
check (one rank, no job store, the launcher) every write goes through. :func:`stamp` is what a
written row or checkpoint carries: the writer's original rank and generation.
Why, and the window that remains: docs/design/elastic-recovery.md, "Fencing a left-out rank".
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Optional, Tuple, Union

from hetseq_hpc.errors import HetseqError, RankFenced

#: a check: ``check(ask)`` returns when this rank may write, else raises ``RankFenced``;
#: ``ask=False`` lets it answer from a recent confirmation (a lease) instead of the store
Check = Callable[[bool], None]
#: the writer's identity in a stamp: ``{"rank": original rank, "generation": n}``
Identity = Callable[[], Dict[str, int]]
PathLike = Union[str, "os.PathLike[str]"]

_lock = threading.Lock()
#: (run directory with a trailing separator, check, identity), or None
_installed: Optional[Tuple[str, Check, Identity]] = None
_inside = threading.local()  # a check in progress on this thread


def install(root: PathLike, check: Check, identity: Identity) -> None:
    """Guard every later write under ``root`` (the run directory) with ``check``; ``identity``
    names the writer in :func:`stamp`. Replaces an earlier installation."""
    global _installed
    with _lock:
        _installed = (os.path.join(os.path.abspath(root), ""), check, identity)


def uninstall() -> None:
    """Remove the installed check (writes go through unchecked again)."""
    global _installed
    with _lock:
        _installed = None


def _guarded(path: PathLike) -> Optional[Tuple[str, Check, Identity]]:
    current = _installed
    if current is None:
        return None
    where = os.path.abspath(path)
    if where != current[0].rstrip(os.sep) and not where.startswith(current[0]):
        return None  # outside the run directory (a task cache, a port file)
    return current


def check_write(path: PathLike, ask: bool = True) -> None:
    """Return when this process may write ``path`` now.

    Args:
        path: the file or folder about to be written (or removed, or renamed).
        ask: ask the job's store (a row, a checkpoint); False: a recent confirmation will do.

    Raises:
        RankFenced: ``path`` is in the run directory and this rank is not (or cannot be
            confirmed to be) in the job's current world; nothing may be written.
    """
    current = _guarded(path)
    if current is None:
        return
    if getattr(_inside, "active", False):  # the check's own log lines never reach the file
        raise RankFenced("a write during the fence's own check is refused")
    _inside.active = True
    try:
        current[1](ask)
    finally:
        _inside.active = False


def may_write(path: PathLike) -> bool:
    """Whether a log line may be appended to ``path`` now (:func:`check_write` with a lease;
    never raises)."""
    try:
        check_write(path, ask=False)
    except HetseqError:
        return False
    return True


def stamp() -> Dict[str, Dict[str, int]]:
    """``{"written_by": {"rank": r, "generation": g}}`` to merge into a row or record this
    rank writes (its original rank, its world's generation), or ``{}`` without a fence."""
    current = _installed
    return {} if current is None else {"written_by": dict(current[2]())}


__all__ = ["Check", "Identity", "check_write", "install", "may_write", "stamp", "uninstall"]
