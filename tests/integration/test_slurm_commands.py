"""Slurm's client commands as the launcher runs them (hetseq_hpc.launch.slurm_commands), with no
Slurm needed: a hostile answer cannot be had from a healthy Slurm, so fake commands stand in
for it (said in each test's name). The same against the real test cluster:
tests/slurm/test_slurm_answers.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.launch.slurm_checks import partition_inventory
from hetseq_hpc.launch.slurm_commands import run_sbatch
from tests.helpers.runs import alive
from tests.helpers.waits import wait_for


def _command(tmp_path: Path, name: str, body: str) -> Path:
    """A ``/bin/sh`` script ``tmp_path/bin/name`` running ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_hung_sbatch_wrapper_faked_is_killed_with_what_it_started(tmp_path):
    """A site's sbatch wrapper that started the real one and waits on it forever: at the
    bound both are killed (killing only the wrapper would leave the child free to submit
    later), and what it printed before is kept."""
    pids = tmp_path / "pids"
    wrapper = _command(
        tmp_path,
        "sbatch",
        f"echo $$ >> {pids}\nsleep 600 &\necho $! >> {pids}\necho started\nwait",
    )
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_sbatch([str(wrapper), "job.sh"], timeout_s=2)
    started = [int(p) for p in pids.read_text().split()]
    try:
        assert len(started) == 2, started
        # killed at once; a loaded machine may take a moment to reap them (init adopts the child)
        wait_for(lambda: not any(alive(p) for p in started), f"processes {started} to be gone")
        assert info.value.output == "started\n"
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_sinfo_bytes_that_are_not_utf8_faked_are_read(tmp_path, monkeypatch):
    """An admin's partition name in bytes that are not UTF-8 (a real one on the test cluster:
    tests/slurm/test_slurm_answers.py): read with a replacement character, not a
    UnicodeDecodeError traceback."""
    _command(
        tmp_path,
        "sinfo",
        r"printf 'a100|n1|gpu:a100:2|4|infinite\nbad\377\376|n4|gpu:v100:2|4|infinite\n'",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    inventory = partition_inventory()
    assert sorted(inventory) == ["a100", "bad\ufffd\ufffd"]
    assert inventory["bad\ufffd\ufffd"]["gres"] == ["gpu:v100:2"]
