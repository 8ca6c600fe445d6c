"""Fixtures of the tests that run real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMALL_MODEL, cli_env


@pytest.fixture
def run_cli(token_cache):
    """``run_cli(run_dir, *overrides, timeout=...) -> CompletedProcess`` of
    ``python -m hetseq_hpc`` with the small model."""

    def _run(run_dir: Path, *overrides: str, timeout: float = 600, small: bool = True):
        cmd = [sys.executable, "-m", "hetseq_hpc", *(SMALL_MODEL if small else []), *overrides,
               f"hydra.run.dir={run_dir}"]
        return subprocess.run(cmd, cwd=REPO, env=cli_env(token_cache), capture_output=True,
                              text=True, timeout=timeout)

    return _run
