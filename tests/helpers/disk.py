"""Filling a real (tmpfs) filesystem to its last byte, and running the CLI on it in the
background."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

from tests.helpers.runs import start_hetseq

#: the name of the file that fills a disk (at its mount point, outside the run directory)
FILLER = "filler"


def fill(mount: Path) -> Path:
    """Write ``<mount>/filler`` until the filesystem answers ENOSPC, in shrinking chunks (the
    last one byte), so that not even a page is left; returns the file. Anything written at the
    same time by others (a run) may take part of the room first."""
    path = Path(mount) / FILLER
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return path


def start_cli(run_dir: Path, token_cache: Path, *overrides: str) -> subprocess.Popen:
    """``python -m hetseq_hpc OVERRIDES hydra.run.dir=RUN_DIR`` in the background (text pipes)."""
    return start_hetseq(*overrides, f"hydra.run.dir={run_dir}", token_cache=token_cache)
