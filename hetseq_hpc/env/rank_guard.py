"""The rank's side of failure reporting and of dying with its launcher.

* :func:`report_failure`: a failed rank writes ``logs/rank<N>.error.json`` (type, one-line
  message, time, and whether it only saw a peer disconnect) for the launcher to pick the cause
  (:mod:`hetseq_hpc.launch.failures`). A genuine error's traceback goes to the console and the
  rank's log; a peer disconnection's traceback goes to the log only, with one warning line on
  the console.
* :func:`watch_launcher`: the last resort when the local launcher is SIGKILLed. The rank also
  gets a parent-death SIGHUP (``prctl``), which makes it checkpoint after its current step; if
  it is still alive :data:`ORPHAN_GRACE_S` after its launcher died (stuck in a collective or a
  rendezvous), the watchdog ends the process.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import List, Optional

from hetseq_hpc.env.process_end import end_process, exit_now
from hetseq_hpc.errors import HetseqError, RankFenced
from hetseq_hpc.files.atomic import atomic_write_json

log = logging.getLogger("hetseq_hpc.worker")

#: environment variable holding the local launcher's pid (set by the launcher for each rank)
LAUNCHER_PID_ENV = "HETSEQ_LAUNCHER_PID"
#: seconds an orphaned rank may live on to finish its step and checkpoint
ORPHAN_GRACE_S = 20.0
#: seconds between the watchdog's checks of the parent pid
WATCH_EVERY_S = 0.5

#: error text of a rank that only saw a peer go away (lower case; matched in the error line)
PEER_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "remote process exited",
    "econnreset",
    "socket closed",
    "timed out waiting",
    "connection refused",
    # gloo, when a collective's timeout closes the pair to a silent peer (seen through a
    # future's callback: "Got the following error when running the callback: ...")
    "timeout caused pair closure",
)


def is_peer_error(text: object) -> bool:
    """True if ``text`` (an error line or ``"Type: message"``) is a peer's disconnection."""
    low = str(text).lower()
    return any(marker in low for marker in PEER_MARKERS)


def _log_to_files_only(level: int, message: str) -> None:
    """Emit ``message`` to the root logger's file handlers only (not the console)."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and level >= handler.level:
            handler.handle(record)


def report_failure(exc: BaseException, rank: int, path: Path) -> str:
    """Log a rank's failure and write its error file ``path``; returns the one-line reason.

    Never raises: a failing report must not hide the failure.
    """
    text = str(exc).strip()
    one_line = text.splitlines()[0] if text else type(exc).__name__
    peer = is_peer_error(f"{type(exc).__name__}: {text}")
    if peer:
        _log_to_files_only(logging.ERROR, f"rank {rank} failed:\n{traceback.format_exc()}")
        log.warning(
            "rank %d stopped: a peer disconnected (%s: %s); traceback in this rank's log",
            rank,
            type(exc).__name__,
            one_line,
        )
    else:
        if not isinstance(exc, HetseqError):
            log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        log.error("rank %d: %s: %s", rank, type(exc).__name__, one_line)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            path,
            {
                "rank": rank,
                "type": type(exc).__name__,
                "message": one_line,
                "time": time.time(),
                "peer": peer,
            },
        )
    except (OSError, RankFenced):  # a rank the others left out writes no error file
        pass
    return one_line


def watch_launcher(env=None, grace_s: float = ORPHAN_GRACE_S) -> Optional[threading.Thread]:
    """Start a daemon thread that ends this process ``grace_s`` after its launcher (the pid in
    ``$HETSEQ_LAUNCHER_PID``) is gone; None when not started by the local launcher."""
    env = os.environ if env is None else env
    value = env.get(LAUNCHER_PID_ENV, "")
    if not value.isdigit():
        return None
    launcher = int(value)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_EVERY_S)
        log.warning("the launcher (pid %d) is gone: stopping within %.0f s", launcher, grace_s)
        time.sleep(grace_s)
        log.error("still running %.0f s after the launcher died: exiting", grace_s)
        logging.shutdown()
        os._exit(143)

    thread = threading.Thread(target=watch, name="hetseq-launcher-watch", daemon=True)
    thread.start()
    return thread


#: the errors of a failed or left-out rank, or of one stopped after a lost rank (its broken
#: world's DDP reducer is still referenced), kept referenced until the process ends: freeing
#: their tracebacks would free the training objects, and a DDP reducer freed while a broken
#: gloo group still runs its comm hook's callback deadlocks (the reducer's destructor joins
#: gloo's thread holding the GIL, and that thread waits for the GIL; seen with a stopped
#: peer: the rank reported its failure and never exited, its watchdog thread stuck too)
FAILED: List[BaseException] = []


#: the script of a Slurm task's job process (``sys.argv[0]``): hetseq_hpc's and submitit's own
SLURM_TASK_SCRIPTS = ("slurm_task.py", "_submit.py")


def exit_process(code: int) -> None:
    """End the worker process with ``code``. A failed or left-out rank, or one stopped after a
    lost rank (an error in :data:`FAILED`), skips the interpreter's teardown (logs flushed
    first, ``os._exit``): a rank that reported its failure but never exits would leave its
    launcher waiting, and one that aborts in it would be reported lost. Any other rank ends
    as a normal exit would, less the teardown of torch's modules
    (:func:`hetseq_hpc.env.process_end.end_process`: threads joined, ``atexit`` handlers run)."""
    if not FAILED:
        end_process(code)
    exit_now(code)


def exit_at_shutdown(error: BaseException, code: int) -> None:
    """For a rank whose entry point is not :func:`exit_process` (submitit's, under Slurm):
    keep ``error`` referenced (:data:`FAILED`) and end the process with ``code`` from an
    ``atexit`` hook, before the interpreter frees the training objects. Only in submitit's
    job process (``python -m hetseq_hpc.launch.slurm_task``, or submitit's own
    ``python -m submitit.core._submit`` of a job submitted before it): called in-process
    elsewhere (a test), it keeps the error and leaves the process alone."""
    FAILED.append(error)
    if os.path.basename(sys.argv[0] if sys.argv else "") not in SLURM_TASK_SCRIPTS:
        return

    def end() -> None:
        exit_now(code)

    atexit.register(end)


__all__ = [
    "FAILED",
    "LAUNCHER_PID_ENV",
    "ORPHAN_GRACE_S",
    "PEER_MARKERS",
    "SLURM_TASK_SCRIPTS",
    "exit_at_shutdown",
    "exit_process",
    "is_peer_error",
    "report_failure",
    "watch_launcher",
]
