"""Record each Python process's CPU at its exit, for ``scripts/suite_cpu/report.py``.

Not part of the package: put this folder first on ``PYTHONPATH`` with ``HETSEQ_PROC_LOG=FILE``
and every Python process started from there (launchers, forked ranks, Slurm tasks, the
pytest workers) appends one tab-separated line to FILE as its interpreter exits: CPU seconds
(user + system, its own), seconds alive, its name (``/proc/self/comm``), pid, parent pid,
whether it imported torch, the test it ran under (``PYTEST_CURRENT_TEST``) and its first
words. A process that ends with ``os._exit`` or a signal writes nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

_STARTED = time.time()


def _record() -> None:
    """Append this process's line to ``$HETSEQ_PROC_LOG`` (one ``write`` of an O_APPEND file:
    lines of concurrent processes never interleave)."""
    path = os.environ.get("HETSEQ_PROC_LOG")
    if not path:
        return
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        try:
            with open("/proc/self/comm", encoding="utf-8") as fh:
                comm = fh.read().strip()
        except OSError:
            comm = "?"
        words = " ".join(sys.argv[:6])[:300].replace("\n", " ").replace("\t", " ")
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0][:200]
        fields = (
            f"{usage.ru_utime + usage.ru_stime:.2f}",
            f"{time.time() - _STARTED:.2f}",
            comm,
            str(os.getpid()),
            str(os.getppid()),
            "torch" if "torch" in sys.modules else "-",
            test,
            words,
        )
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, ("\t".join(fields) + "\n").encode())
        finally:
            os.close(fd)
    except Exception:  # a recorder must never change how a process ends
        pass


atexit.register(_record)
