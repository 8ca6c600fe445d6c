"""Which rank caused a failure, and in what words.

When one rank fails, every peer fails a moment later with a disconnection ("Connection closed by
peer", a reset socket, an aborted NCCL communicator, a collective that timed out): those are the
effect, not the cause. Launchers therefore name the rank whose OWN error is first:

* a genuine error (any error that is not a peer disconnection), earliest first;
* else a rank killed by a signal nobody in hetseq_hpc sent (the kernel's OOM killer, ``kill``);
* else a rank found stopped (SIGSTOP, Ctrl-Z) while its peers timed out waiting for it;
* else the earliest peer disconnection.

The error line of a Python traceback is its last ``module.Name: message`` line, not its last
line: torch's C++ errors append "Exception raised from ..." and frame lines such as
``…ddp_hooks.py(53): <lambda>``, which named the wrong rank with a meaningless line before.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional

#: error text of a rank that only saw a peer go away (lower case; matched in the error line)
PEER_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "nccl communicator was aborted", "remote process exited", "econnreset", "socket closed",
    "timed out waiting", "connection refused",
)
#: a Python exception line: ``pkg.module.NameError: message`` at column 0
_EXC_LINE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Preempted|Failure)"
                       r"(?::.*)?\Z")


def error_line(trace: object) -> str:
    """The exception line of a traceback (its last ``Type: message`` line), else its last line.

    >>> error_line("Traceback ...\\nRuntimeError: boom\\nframe #3: x.py(53): <lambda>")
    'RuntimeError: boom'
    """
    lines = [line.rstrip() for line in str(trace).splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXC_LINE.match(line):
            return line.strip()
    return lines[-1].strip() if lines else "unknown error"


def is_peer_error(text: object) -> bool:
    """True if ``text`` (an error line or ``"Type: message"``) is a peer's disconnection."""
    low = str(text).lower()
    return any(marker in low for marker in PEER_MARKERS)


def pick_failure(errors: Mapping[int, str]) -> int:
    """The rank to blame among ranks that returned a traceback (Slurm results): the lowest rank
    whose error line is not a peer's disconnection, else the lowest rank.

    Raises:
        ValueError: ``errors`` is empty.
    """
    causes = [r for r, trace in errors.items() if not is_peer_error(error_line(trace))]
    return min(causes or errors)


def read_error_file(path: Path) -> Optional[Dict]:
    """A rank's ``logs/rank<N>.error.json`` (``type``, ``message``, ``time``, ``peer``), or None
    if missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) and "message" in data else None
    except (OSError, ValueError):
        return None


def first_failure(codes: Mapping[int, int], errors: Mapping[int, Optional[Dict]],
                  stopped: Iterable[int] = ()) -> int:
    """The rank to blame on the local launcher.

    Args:
        codes: rank -> exit code observed BEFORE the launcher stopped anyone (negative = killed
            by that signal); ranks still running are absent.
        errors: rank -> its error file (:func:`read_error_file`), or None.
        stopped: ranks found stopped (SIGSTOP, Ctrl-Z) while the others failed.

    Returns:
        the first rank with a genuine error (by the error's time), else the first rank killed
        by a foreign signal, else a stopped rank, else the first peer disconnection, else the
        lowest failed rank.

    Raises:
        ValueError: no rank failed.
    """
    stopped = set(stopped)
    failed = sorted(set(r for r, c in codes.items() if c not in (None, 0)) |
                    set(r for r, e in errors.items() if e) | stopped)
    if not failed:
        raise ValueError("no rank failed")

    def order(rank: int) -> tuple:
        err = errors.get(rank)
        when = float(err.get("time", float("inf"))) if err else float("inf")
        if err and not (err.get("peer") or is_peer_error(f"{err.get('type')}: {err['message']}")):
            return (0, when, rank)
        if codes.get(rank, 0) < 0:
            return (1, 0.0, rank)
        if rank in stopped:
            return (2, 0.0, rank)
        return (3 if err else 4, when, rank)

    return min(failed, key=order)


def signal_reason(code: int, run_dir: Path, rank: int) -> str:
    """Words for a rank that died of signal ``-code``; a SIGKILL nobody sent is most likely the
    kernel's OOM killer: say so, with ``allocation.json``'s memory estimate for the rank."""
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
    if -code != signal.SIGKILL:
        return f"killed by signal {name}"
    reason = (f"killed by signal {name}: probably out of memory (the kernel's OOM killer; "
              "dmesg names it)")
    estimate = memory_estimate_gb(run_dir, rank)
    if estimate is not None:
        reason += (f"; the rank was planned to use about {estimate:.2f} GiB (allocation.json: "
                   "static + activations x micro-batch): lower cluster.memory_budget_gb, shrink "
                   "task.model or trainer.max_micro_batch")
    return reason


def memory_estimate_gb(run_dir: Path, rank: int) -> Optional[float]:
    """GiB rank ``rank`` was planned to hold: calibration ``static_bytes`` + ``activation_bytes_
    per_sample`` x its micro-batch, from ``<run dir>/allocation.json``; None if unknown."""
    try:
        data = json.loads((Path(run_dir) / "allocation.json").read_text())
        entry = data["ranks"][rank]
        cal, share = entry["calibration"], entry["share"]
        total = float(cal["static_bytes"]) + float(cal["activation_bytes_per_sample"]) * int(
            share["micro_batch"])
        return total / 2**30
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


__all__ = ["PEER_MARKERS", "error_line", "first_failure", "is_peer_error", "memory_estimate_gb",
           "pick_failure", "read_error_file", "signal_reason"]
