"""Fixtures of the tests that run real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional

import pytest

from hetseq_hpc.launch.template import SERVER_ENV
from tests.helpers.runs import SMALL_MODEL, hetseq

#: seconds the template server may take to import torch on a loaded machine
SERVER_START_S = 300.0


@pytest.fixture(scope="session", autouse=True)
def rank_template_server() -> Iterator[Optional[str]]:
    """One rank-template server per test process (:mod:`hetseq_hpc.launch.template_server`),
    named to every launcher the tests start (``HETSEQ_RANK_TEMPLATE_SERVER``): each local run
    forks its template from it instead of importing torch again (~3-6 CPU-s a run, hundreds
    of runs). A launcher the server refuses starts its own template, as without it.
    ``HETSEQ_TEST_TEMPLATE_SERVER=0`` leaves it out (every run starts its own)."""
    if os.environ.get("HETSEQ_TEST_TEMPLATE_SERVER", "1") == "0" or SERVER_ENV in os.environ:
        yield os.environ.get(SERVER_ENV)
        return
    folder = tempfile.mkdtemp(prefix="hetseq-ts-")  # short: a socket path has <= 107 bytes
    path = os.path.join(folder, "server.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetseq_hpc.launch.template_server", "--socket", path],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = _first_line(proc, SERVER_START_S)
        if not line.startswith("ready"):
            warnings.warn(
                f"the rank template server did not start ({line!r}): runs start their own",
                stacklevel=2,
            )
            yield None
            return
        os.environ[SERVER_ENV] = path
        yield path
    finally:
        os.environ.pop(SERVER_ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` writes on stdout within ``timeout`` s ("" if none)."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


@pytest.fixture
def run_cli(token_cache):
    """``run_cli(run_dir, *overrides, timeout=..., small=True, plot=False) -> CompletedProcess``
    of ``python -m hetseq_hpc`` (:func:`~tests.helpers.runs.hetseq`) with the small model."""

    def _run(run_dir: Path, *overrides: str, timeout: float = 600, small: bool = True, plot=False):
        return hetseq(
            *(SMALL_MODEL if small else []),
            *overrides,
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
            timeout=timeout,
            plot=plot,
        )

    return _run


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size, where=None, readonly=False) -> Path``: a real tmpfs of ``size`` (e.g.
    "2m") mounted on ``where`` (default a new folder under tmp_path); read-only gives EROFS
    even for root. Skips when mounting is not allowed; unmounted after the test."""
    mounts = []

    def _mount(size: str, where: Optional[Path] = None, readonly: bool = False) -> Path:
        where = where or tmp_path / f"tmpfs{len(mounts)}"
        where.mkdir(parents=True)
        options = f"ro,size={size}" if readonly else f"size={size}"
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}")
        mounts.append(where)
        return where

    yield _mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
