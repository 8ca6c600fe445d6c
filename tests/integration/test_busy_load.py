"""The benchmarks' loaded host (scripts/busy_load.py): the busy loops run while the block runs
and are gone after it, also when it raises."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "busy_load.py"


def _busy_load():
    spec = importlib.util.spec_from_file_location("busy_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BusyLoad


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_busy_loops_run_inside_the_block_and_are_killed_when_it_raises():
    BusyLoad = _busy_load()
    with pytest.raises(RuntimeError), BusyLoad(2, every_s=0.05) as load:
        pids = [p.pid for p in load.procs]
        assert len(pids) == 2 and all(p.poll() is None for p in load.procs)
        raise RuntimeError("the measured run failed")
    assert not any(_alive(pid) for pid in pids)  # reaped: no zombie either
    assert load.summary()["busy_loops"] == 2
    with pytest.raises(ValueError, match="--load -1"):
        BusyLoad(-1)
