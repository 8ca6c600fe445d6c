"""Waiting in a test for a real event: a file appears, a process reaches a state, a log line is
written, a job ends. No test sleeps for time: each waits here on what it needs, and the timeout
of every wait is a guard against hangs, not a speed check (a loaded machine only waits longer).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar, Union

T = TypeVar("T")

#: the default bound of a wait (s): a guard against hangs, not a speed check
GUARD_S = 300.0


def output_tail(proc: subprocess.Popen, output: Optional[Path] = None, chars: int = 3000) -> str:
    """The last ``chars`` characters of what the ended ``proc`` wrote to stderr: its pipe
    (text or bytes), or the file ``output`` it wrote to instead; '' when neither is there."""
    if output is not None:
        try:
            return Path(output).read_text(errors="replace")[-chars:]
        except OSError:
            return ""
    try:
        _, err = proc.communicate(timeout=60)
    except (ValueError, OSError, subprocess.TimeoutExpired):  # pipes closed, or still running
        return ""
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    return (err or "")[-chars:]


def _said(what: Union[str, Callable[[], str]]) -> str:
    return what() if callable(what) else what


def wait_for(
    predicate: Callable[[], T],
    what: Union[str, Callable[[], str]],
    timeout_s: float = GUARD_S,
    proc: Optional[subprocess.Popen] = None,
    output: Optional[Path] = None,
    poll_s: float = 0.1,
) -> T:
    """Look at ``predicate()`` every ``poll_s`` seconds until it returns something true, and
    return that.

    The event is what the predicate observes; ``timeout_s`` is a guard against hangs, not a
    speed check: no test relies on it to pass, a loaded machine only waits longer.

    Args:
        predicate: the event, observed (it may act too, e.g. poke a pending Slurm job).
        what: the event in words, for the failure ("step 10 in /tmp/run"); or a function
            that says it then (with what was seen by then).
        timeout_s: seconds to wait at most.
        proc: the process that makes the event happen: the wait ends as soon as it exits
            without it (the predicate is looked at once more), with its exit code and the tail
            of its stderr.
        output: the file ``proc``'s stderr goes to when it is not a pipe, for that tail.
        poll_s: seconds between looks (with ``proc``: or until it exits).

    Raises:
        AssertionError: ``proc`` ended first, or ``timeout_s`` passed, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = predicate()  # it may have come just before the end
            if value:
                return value
            raise AssertionError(
                f"{_said(what)}: the process ended first (exit {proc.returncode})\n"
                f"{output_tail(proc, output)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{_said(what)}: not within {timeout_s:.0f} s (a guard against hangs)"
            )
        if proc is None:
            time.sleep(poll_s)
        else:
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
