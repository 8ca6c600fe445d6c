"""A fake monotonic clock for code that takes a clock and a sleep function (or reads
``time.monotonic``): time moves only when the code sleeps, the test advances it, or (with
``tick``) each time the code looks at it, so waits and grace periods pass at once and no test
sleeps for time (as submitit's ``fast_forward_clock``)."""

from __future__ import annotations

from types import ModuleType

import pytest


class FakeClock:
    """A monotonic clock in seconds.

    Args:
        start: the first reading (s).
        tick: seconds added after every reading (0: only ``sleep``/``advance`` move it), for
            loops that poll the clock without sleeping through it.
    """

    def __init__(self, start: float = 1000.0, tick: float = 0.0) -> None:
        self.now = float(start)
        self.tick = float(tick)
        self.slept: list[float] = []

    def __call__(self) -> float:
        reading = self.now
        self.now += self.tick
        return reading

    def sleep(self, seconds: float) -> None:
        """Move on by ``seconds`` at once (recorded in :attr:`slept`)."""
        self.slept.append(float(seconds))
        self.now += max(0.0, float(seconds))

    def advance(self, seconds: float) -> None:
        """Move on by ``seconds`` (the test's own passing of time)."""
        self.now += float(seconds)

    def install(self, monkeypatch: pytest.MonkeyPatch, time_module: ModuleType) -> FakeClock:
        """Make ``time_module.monotonic`` read this clock and ``time_module.sleep`` move it, for
        the test's duration (``time_module`` is the ``time`` module a module under test
        imported, e.g. ``slurm_watch.time``). Returns the clock."""
        monkeypatch.setattr(time_module, "monotonic", self)
        monkeypatch.setattr(time_module, "sleep", self.sleep)
        return self
