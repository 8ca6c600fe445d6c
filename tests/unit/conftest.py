"""Fixtures of the in-process tests (the unit tier: bare ``pytest``).

A unit test starts no process: :func:`no_child_processes` fails any test that does, naming the
test's new home (``tests/integration``). Time is injected (:func:`fast_clock`), never slept.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
import torch

from tests.helpers.clock import FakeClock

_WHY = (
    "a unit test starts no process (the unit tier is in-process): move this test to "
    "tests/integration, or fake the command's answer"
)


@pytest.fixture(autouse=True)
def no_child_processes(monkeypatch):
    """Refuse ``subprocess`` children, ``multiprocessing`` processes and ``os.fork`` in unit
    tests: they belong to ``tests/integration`` (the tier a developer does not run between
    edits). Fakes of ``subprocess.run`` that start nothing are fine."""

    def refuse(*args, **kwargs):
        raise AssertionError(_WHY)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture
def fast_clock() -> FakeClock:
    """A :class:`~tests.helpers.clock.FakeClock` (call it to read, ``sleep``, ``advance``) for
    code that takes a clock and a sleep function: time moves only when the code sleeps or the
    test advances it (as submitit's ``fast_forward_clock``)."""
    return FakeClock()


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """A run directory with a ``submitit`` folder for the Slurm watcher's tests; the waiting
    loop's clock is fake (each look at it moves 1 s on, sleeping costs nothing), so grace
    periods pass at once."""
    from hetseq_hpc.launch import slurm_watch

    (tmp_path / "submitit").mkdir()
    FakeClock(start=0.0, tick=1.0).install(monkeypatch, slurm_watch.time)
    return tmp_path


@pytest.fixture(autouse=True)
def one_thread():
    """Every unit test runs its tiny models on one intra-op thread: two threads spin in OpenMP
    on a shared, busy CPU (``pytest -n 2`` on 2 cores: 4 threads) and made a step up to ~100x
    slower (``test_step_syncs``' 4-micro-batch cases: 1.3 s alone, 21 s beside the other
    worker). A test that sets the count itself is left to it; the count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
