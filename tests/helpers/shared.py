"""Expensive reference runs made once per test session and shared by its xdist workers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

#: the marker a finished build leaves in its directory (a build that raised leaves none)
BUILT = ".built"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder of the whole test session: under ``pytest-xdist`` the parent of the
    workers' own folders (``.../pytest-N/popen-gwK`` -> ``.../pytest-N``, one per session, as in
    xdist's docs, "Making session-scoped fixtures execute only once"), else the basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """``build(directory)`` once per session for ``name``: the first worker to ask builds it
    while holding a file lock; the others wait for the lock and get the same directory.

    The result must be read-only for the tests (copy it to change it): tests on other workers
    read it at the same time. A build that raised leaves no :data:`BUILT` marker, so the next
    caller starts again from an empty directory (and reports its own error).

    Args:
        tmp_path_factory: pytest's factory (any scope).
        name: a file name, unique per kind of run (``"elastic-reference"``).
        build: fills the (empty, existing) directory; its exceptions propagate.

    Returns:
        the built directory, ``<session root>/shared/<name>``.
    """
    directory = session_root(tmp_path_factory) / "shared" / name
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        if (directory / BUILT).exists():
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        build(directory)
        (directory / BUILT).touch()
    return directory
