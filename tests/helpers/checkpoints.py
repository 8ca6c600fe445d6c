"""Checkpoint files as an attacker or a fault leaves them: a code-running payload with a
matching checksum, flipped bytes, a corrupt later checkpoint."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path
from typing import Tuple

import torch

from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import checksum_path
from hetseq_hpc.train.checkpoint.manager import CheckpointManager

#: how long a held background write waits for the test's release: a guard against hangs, not a
#: speed check
GUARD_S = 120.0


class Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for any code a file could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_with_checksum(path: Path, obj) -> None:
    """What an attacker with write access does: a torch file plus a matching sidecar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    checksum_path(path).write_text(f"{digest}  {path.name}\n")


def flip_middle(path: Path, n: int = 64) -> bytes:
    """Invert ``n`` bytes in the middle of ``path``; returns the damaged bytes."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))
    return bytes(data)


def small_state(step: int, size: int = 16) -> dict:
    """A checkpoint state of ``step`` with a model of ``size`` floats."""
    return {
        "model": {"w": torch.full((size,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "step": step,
    }


def plant_corrupt(run_dir: Path, source_step: int, step: int) -> bytes:
    """A checkpoint of a later ``step`` whose bytes no longer match its checksum."""
    src, dst = (
        CheckpointManager(RunDir(run_dir)).path(source_step),
        CheckpointManager(RunDir(run_dir)).path(step),
    )
    shutil.copyfile(src, dst)
    shutil.copyfile(checksum_path(src), checksum_path(dst))
    return flip_middle(dst, 32)


def held_write(manager: CheckpointManager, step: int) -> Tuple[threading.Event, threading.Event]:
    """Hold ``manager``'s background write of ``step`` before its record is renamed into place
    (its test-only hook): ``(held, release)`` events; the write goes on once ``release`` is set
    (or fails after :data:`GUARD_S`)."""
    held, release = threading.Event(), threading.Event()

    def hold(at: int) -> None:
        if at == step:
            held.set()
            assert release.wait(GUARD_S), "the test never released the write"

    manager.test_hold = hold
    return held, release
