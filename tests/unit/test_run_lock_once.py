"""Issue 40: the run lock is taken once per process, so the command line holds it before
Hydra writes anything, the local launcher hands that same lock to its ranks and the SLURM
launcher lets it go before submitting; another open file of it is still refused. (A second run
turned away for real: tests/integration/test_run_turned_away.py.)"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from hetseq_hpc.errors import LaunchError
from hetseq_hpc.rundir.lock import acquire, let_go, lock_run_dir
from hetseq_hpc.rundir.paths import RunDir


def test_the_run_lock_is_taken_once_per_process_and_let_go_by_the_launcher(tmp_path):
    def free() -> bool:  # another open file of the lock, as another run would try it
        fd = os.open(tmp_path / ".hetseq.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            assert exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            return False
        finally:
            os.close(fd)

    held = acquire(RunDir(tmp_path))  # the command line, before Hydra
    with lock_run_dir(RunDir(tmp_path)) as again:  # the launcher: the same lock, not a refusal
        assert (again.fd, again.owned) == (held.fd, False)
    assert not free(), "the launcher's exit must not release the command line's lock"
    let_go(RunDir(tmp_path))  # the SLURM launcher, before submitting
    assert held.fd == -1 and free()
    held.release()  # the command line's own release after that: harmless
    with lock_run_dir(RunDir(tmp_path)) as fresh:
        assert fresh.owned and not free()
    assert free()


def test_a_lock_held_elsewhere_is_still_refused(tmp_path):
    fd = os.open(tmp_path / ".hetseq.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: another run
    try:
        with pytest.raises(LaunchError, match="is in use by another run"):
            acquire(RunDir(tmp_path))
    finally:
        os.close(fd)
