"""A full or read-only run directory in words (:mod:`hetseq_hpc.rundir.storage`): the errno
found through an error's causes (also inside DCP's CheckpointException, a BaseException), and
``os.statvfs`` of a real filesystem. (Real full and read-only mounts:
tests/integration/test_full_run_dir.py.)"""

from __future__ import annotations

import errno
import os

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from hetseq_hpc.errors import CheckpointError, StorageError, exit_code
from hetseq_hpc.rundir.storage import (
    filesystem_problem,
    mount_point,
    reported,
    storage_error,
    write_problem,
)


def _raised_from(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit __context__ is the point
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on {m}"),
        (errno.EFBIG, "no space left on {m}"),
        (errno.EDQUOT, "no space left on {m} (disk quota exceeded)"),
        (errno.EROFS, "{m} is read-only"),
    ],
)
def test_the_errno_is_found_behind_a_serializer_error(tmp_path, code, words):
    """torch's serializer raises a RuntimeError while the OSError is its context."""
    exc = _raised_from(OSError(code, os.strerror(code)), RuntimeError("unexpected pos 704 vs 598"))
    assert write_problem(exc, tmp_path) == words.format(m=mount_point(tmp_path))


def test_the_errno_is_found_in_a_dcp_failure_of_another_rank(tmp_path):
    failure = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (failure, None)})
    assert write_problem(exc, tmp_path) == f"no space left on {mount_point(tmp_path)}"


def test_other_errors_are_not_called_a_full_disk(tmp_path):
    assert write_problem(OSError(errno.EIO, "Input/output error"), tmp_path) is None
    assert write_problem(RuntimeError("boom"), tmp_path) is None
    assert storage_error(tmp_path, ValueError("x")) is None


def test_storage_error_is_one_line_with_the_file_and_the_continue_command(tmp_path):
    written = tmp_path / "run" / "summary.json"
    exc = OSError(errno.ENOSPC, "No space left on device", str(written))
    error = storage_error(tmp_path / "run", exc)
    assert isinstance(error, StorageError) and exit_code(error) == 1
    text = str(error)
    assert "\n" not in text
    assert text == (
        f"no space left on {mount_point(tmp_path)} (run directory {tmp_path / 'run'}; writing "
        f"{written}): free space or move hydra.run.dir, then continue with hetseq-hpc "
        f"hydra.run.dir={tmp_path / 'run'} trainer.resume=auto"
    )


def test_reported_keeps_errors_already_in_words(tmp_path):
    said = CheckpointError("no space left on /x (writing checkpoint ...): free space")
    assert reported(said, tmp_path) is said
    other = RuntimeError("a bug")
    assert reported(other, tmp_path) is other
    full = OSError(errno.ENOSPC, "No space left on device")
    assert isinstance(reported(full, tmp_path), StorageError)


def test_filesystem_problem_asks_the_real_filesystem(tmp_path):
    assert filesystem_problem(tmp_path) is None
    assert filesystem_problem(tmp_path / "not" / "yet") is None  # its existing ancestor
    # more room wanted than any disk has: full by statvfs's own figures
    assert filesystem_problem(tmp_path, min_free=1 << 62) == (
        f"no space left on {mount_point(tmp_path)}"
    )
    assert filesystem_problem("/proc", min_free=1 << 62) is None  # no blocks: not a disk
