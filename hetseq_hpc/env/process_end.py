"""Ending a process without the interpreter's teardown of its modules: after what a normal exit
shows (:func:`end_process`) or at once (:func:`exit_now`); docs/design/rank-template.md, "The
end of a process"."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` after everything of a normal exit that
    another process or a file can see, then ``os._exit(code)``: as CPython's finalization
    does, first ``threading._shutdown`` (its ``_register_atexit`` hooks, such as
    ``concurrent.futures``' pools, then every non-daemon thread joined), then the ``atexit``
    handlers (``logging.shutdown``, multiprocessing's, ``weakref.finalize``'s, torch's and
    ours), then stdout and stderr flushed. What it skips is the teardown of the modules: every
    object freed one by one, ~1.7 CPU-s in a fresh interpreter that imported
    ``torch._dynamo`` (as any AdamW does) and ~0.6 CPU-s in a rank forked from a template
    (each page it frees is copied first), measured on the 2-core VM (docs/benchmarks.md).
    Files are written and closed by ``with`` blocks and sockets closed by the kernel, so
    nothing depends on that teardown.

    Call it only at a process's end, never in a test's own process. Where CPython's
    ``threading._shutdown`` or ``atexit._run_exitfuncs`` is missing (another interpreter), or
    off the main thread, it is ``sys.exit(code)``.

    Raises:
        SystemExit: only in that fallback.
    """
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if (
        shutdown is None
        or run_exitfuncs is None
        or threading.current_thread() is not threading.main_thread()
    ):
        sys.exit(code)
    shutdown()
    run_exitfuncs()
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End this process with exit status ``code`` at once: the logs flushed and closed
    (``logging.shutdown``), stdout and stderr flushed, then ``os._exit(code)``; no thread
    joined, no ``atexit`` handler run. For a process whose objects can hang in their teardown
    (a failed rank's broken world: :data:`hetseq_hpc.env.rank_guard.FAILED`) or that ran nothing
    but its own code (the rank template)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, replaced or a broken pipe
            pass
    os._exit(code)


__all__ = ["end_process", "exit_now"]
