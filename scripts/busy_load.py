"""A loaded host for the benchmarks (``--load N``): N busy-looping processes on the machine's
cores for the whole measured run, and the load average seen meanwhile.

    with BusyLoad(6) as load:
        ...  # the measured run
    load.summary()  # {"busy_loops": 6, "loadavg_1min_mean": ..., "loadavg_1min_max": ...}

The loops are started in their own process group and killed on exit, also when the run
raises (or the benchmark is interrupted: SIGTERM is turned into an exit that unwinds here).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
from types import TracebackType
from typing import List, Optional

LOOP = "while True:\n    pass\n"


class BusyLoad:
    """``n`` busy loops while the ``with`` block runs, the 1-minute load average sampled every
    ``every_s`` seconds meanwhile (``n = 0``: no loops, the load average still sampled)."""

    def __init__(self, n: int, every_s: float = 2.0) -> None:
        if n < 0:
            raise ValueError(f"--load {n}: give 0 or more busy loops")
        self.n, self.every_s = n, every_s
        self.procs: List[subprocess.Popen] = []
        self.samples: List[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._old_term = None

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> BusyLoad:
        self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen([sys.executable, "-c", LOOP], start_new_session=True)
                )
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: Optional[type],
        value: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill the loops (each by its own process group) and stop sampling; idempotent."""
        self._stop.set()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self.procs = []
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def summary(self) -> dict:
        """The loops and the load average seen while they ran (None before two samples)."""
        seen = self.samples
        return {
            "busy_loops": self.n,
            "loadavg_1min_mean": round(statistics.fmean(seen), 2) if seen else None,
            "loadavg_1min_max": round(max(seen), 2) if seen else None,
        }


def _exit_on_term(signum: int, frame: object) -> None:
    """SIGTERM -> SystemExit, so that ``with BusyLoad(...)`` kills its loops on the way out."""
    raise SystemExit(128 + signum)
