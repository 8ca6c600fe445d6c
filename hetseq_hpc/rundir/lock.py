"""One run at a time per run directory: an exclusive lock on ``<run dir>/.hetseq.lock``.

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on an open file:

* it dies with its holder: the kernel drops it when the last descriptor of that open file is
  closed, which includes the holder being killed (SIGKILL, OOM) -- no stale lock to clean;
* it survives NFS: Linux >= 2.6.12 emulates ``flock`` on NFS with POSIX byte-range locks
  that the server arbitrates, so a run on another node sees it (mounts with ``local_lock=all``
  or ``nolock`` opt out; a crashed NFS client's lock is freed when its lease expires);
* it belongs to the open file, not the process: a child that inherits the descriptor holds
  the same lock, so a launcher passes it to its ranks and neither blocks the other.

Who takes it: the command line, before Hydra writes ``.hydra/`` or anything else is written
(a run turned away writes nothing); in this process it is taken once and held
(:func:`acquire` again gives the held lock), so the local launcher hands it to its ranks
(:meth:`RunLock.child_env` + ``pass_fds``) and the SLURM launcher lets it go (:func:`let_go`)
before submitting; in a SLURM job rank 0 takes it (:func:`claim_run_dir`). The file stays; it
holds the holder's ``pid=... host=...`` for the message of the run turned away.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional

from hetseq_hpc.errors import LaunchError
from hetseq_hpc.rundir.paths import RunDir

LOCK_NAME = RunDir.LOCK_NAME
#: environment variable through which a launcher hands its locked descriptor to the ranks
FD_ENV = "HETSEQ_RUN_LOCK_FD"


@dataclass
class RunLock:
    """A held run-directory lock.

    Attributes:
        path: the lock file, ``<run dir>/.hetseq.lock``.
        fd: the descriptor holding the lock (inheritable: pass it with ``pass_fds``).
        owned: whether this process took the lock (and releases it), or inherited it.
    """

    path: Path
    fd: int
    owned: bool = True

    def child_env(self) -> Dict[str, str]:
        """Environment for a child started with ``pass_fds=(lock.fd,)``: it then holds the same
        lock and :func:`claim_run_dir` there does not try to take it again."""
        return {FD_ENV: str(self.fd)}

    def release(self) -> None:
        """Unlock and close (only if this process took the lock; safe to call twice)."""
        if self.owned and self.fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            for key in [k for k, held in _HELD.items() if held is self]:
                del _HELD[key]
        self.fd = -1


#: the run directories whose lock this process took and holds (resolved path -> lock)
_HELD: Dict[Path, RunLock] = {}


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return f" (held by {text})" if text else ""


def acquire(run_dir: RunDir) -> RunLock:
    """Take the lock of ``run_dir`` without waiting. When this process holds it already, the
    held lock is given (``owned=False``: releasing it leaves it held).

    Raises:
        LaunchError: another run holds it (the message names the run dir, the holder's pid and
            host, and the fix), or the lock file cannot be created.
    """
    held = _HELD.get(run_dir.root.resolve())
    if held is not None and held.fd >= 0:
        return RunLock(path=held.path, fd=held.fd, owned=False)
    path = run_dir.lock
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise LaunchError(
            f"cannot create the run lock {str(path)!r} ({exc.strerror}): make "
            "hydra.run.dir writable or choose another one"
        ) from None
    os.set_inheritable(fd, True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LaunchError(
                f"cannot lock the run directory {str(run_dir)!r} ({exc.strerror}): "
                "use a run directory on a filesystem with locking"
            ) from None
        raise LaunchError(
            f"run directory {str(run_dir)!r} is in use by another run{_holder(path)}: wait for "
            "it to end, or choose another hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode())
    lock = RunLock(path=path, fd=fd)
    _HELD[run_dir.root.resolve()] = lock
    return lock


def let_go(run_dir: RunDir) -> None:
    """Release this process's lock of ``run_dir``, whoever here took it (the command line or a
    launcher): the SLURM launcher hands the run directory to the job's rank 0 this way."""
    held = _HELD.get(run_dir.root.resolve())
    if held is not None:
        held.release()


@contextlib.contextmanager
def lock_run_dir(run_dir: RunDir) -> Iterator[RunLock]:
    """Hold the lock of ``run_dir`` for the ``with`` block (see :func:`acquire` for errors)."""
    lock = acquire(run_dir)
    try:
        yield lock
    finally:
        lock.release()


def _inherited(run_dir: RunDir, env: Mapping[str, str]) -> Optional[RunLock]:
    """The launcher's lock of ``run_dir`` passed down as descriptor ``$HETSEQ_RUN_LOCK_FD``,
    if that descriptor is open, is that lock file, and holds the lock (re-locking the same
    open file succeeds; another open file would be refused)."""
    value = env.get(FD_ENV, "")
    if not value.isdigit():
        return None
    fd, path = int(value), run_dir.lock
    try:
        mine, there = os.fstat(fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return RunLock(path=path, fd=fd, owned=False)


@contextlib.contextmanager
def claim_run_dir(
    run_dir: RunDir, is_master: bool, env: Optional[Mapping[str, str]] = None
) -> Iterator[Optional[RunLock]]:
    """A rank's part of the run-directory lock, for the ``with`` block.

    Yields the inherited lock when the launcher passed one (every rank), else the lock
    taken by rank 0 (``is_master``), else None (other ranks: rank 0 speaks for the job).

    Raises:
        LaunchError: on rank 0, another run holds the run directory.
    """
    env = os.environ if env is None else env
    inherited = _inherited(run_dir, env)
    if inherited is not None or not is_master:
        yield inherited
        return
    with lock_run_dir(run_dir) as lock:
        yield lock
