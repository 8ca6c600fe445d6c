"""How long a rank's start-up phases take (``scripts/bench_startup.py`` reads them).

The worker marks the end of each phase; rank 0 logs the figures and records them in
``allocation.json`` under ``startup``: ``process_start`` (epoch seconds the rank's process
started, from ``/proc/self/stat``; None elsewhere), ``phases_s`` (``imports``: process start to
the worker's entry -- interpreter, imports, unpickling; then ``probe``, ``rendezvous``, ``data``,
``model``, ``calibration``, ``allocation``) and ``allocated`` (epoch seconds at the end).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

#: modules every rank needs that take about a second to import: ``torch._dynamo`` (and sympy
#: under it), which torch.optim imports on the optimizer's first ``add_param_group`` -- for
#: every task, the models themselves are plain torch
BACKGROUND_IMPORTS: Tuple[str, ...] = ("torch._dynamo",)


def process_start_epoch(pid: str = "self") -> Optional[float]:
    """Epoch seconds at which process ``pid`` started (Linux ``/proc``), else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime_s = float(fh.read().split()[0])
        started_after_boot_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime_s + started_after_boot_s


class PhaseClock:
    """Wall-clock seconds of consecutive phases, the first from the process start."""

    def __init__(self) -> None:
        self.process_start = process_start_epoch()
        self._last = time.time()
        self.phases_s: Dict[str, float] = {}
        if self.process_start is not None:
            self.phases_s["imports"] = round(self._last - self.process_start, 3)

    def mark(self, phase: str) -> None:
        """End ``phase`` now (seconds since the previous mark)."""
        now = time.time()
        self.phases_s[phase] = round(now - self._last, 3)
        self._last = now

    def to_dict(self) -> Dict[str, Any]:
        """``{"process_start", "phases_s", "allocated"}`` for ``allocation.json``."""
        return {
            "process_start": self.process_start,
            "phases_s": dict(self.phases_s),
            "allocated": self._last,
        }

    def log(self) -> None:
        """One log line with every phase."""
        log.info(
            "start-up phases: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.phases_s.items())
        )


def prefetch_imports(names: Sequence[str]) -> Optional[threading.Thread]:
    """Import ``names`` in a daemon thread, so that slow imports run while the rank waits for
    its peers (rendezvous, rank 0's data preparation) instead of after. The caller must
    ``join()`` the thread before it touches these modules itself (a module half-imported by
    another thread is not safe to use); an error here is ignored (the real import raises it
    where it happens). Returns the thread (None if nothing to import)."""
    if not names:
        return None

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # the real import reports it
                return

    thread = threading.Thread(target=run, name="hetseq-prefetch-imports", daemon=True)
    thread.start()
    return thread
