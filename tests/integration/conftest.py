"""Fixtures of the tests that run real processes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers.runs import SMALL_MODEL, hetseq


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
