"""Which rank caused a failure, and in what words.

When one rank fails, its peers fail a moment later with a disconnection: the effect, not the
cause. Both launchers read each rank's OWN error file (``logs/rank<N>.error.json``) and pick the
rank to name with :func:`first_failure` (a rank that failed without one on a full or read-only
run directory is given that cause, :func:`storage_cause`); :func:`write_stop_record` marks a
clean stop after a checkpoint. The order of precedence and how a traceback's error line is found:
docs/design/elastic-recovery.md, "Which rank caused a failure".
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence

from hetseq_hpc.env.rank_guard import PEER_MARKERS, is_peer_error
from hetseq_hpc.errors import EXIT_CODES, Preempted, RankFenced, StorageError
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import filesystem_problem, storage_message
from hetseq_hpc.train.metrics import read_metrics

#: rank 0's record of a clean stop after a checkpoint in a SLURM job (relative to the run dir)
STOP_RECORD = RunDir.STOP_RECORD
#: a rank whose clock jumped this many seconds between two ticks was stopped (SIGSTOP, a frozen
#: node): peers time out after cluster.collective_timeout_s >= 10 s, so a stop that makes them
#: fail is longer than this
STOP_GAP_S = 5.0
#: a Python exception line: ``pkg.module.NameError: message`` at column 0
_EXC_LINE = re.compile(
    r"[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Preempted|Failure)"
    r"(?::.*)?\Z"
)


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


def storage_cause(
    run_dir: RunDir, codes: Mapping[int, int], errors: Mapping[int, Optional[Dict]]
) -> Dict[int, Optional[Dict]]:
    """``errors`` with a cause for each rank that exited with an error (code > 0) but left no
    error file, when the run directory's filesystem is full or read-only (``os.statvfs``,
    :func:`hetseq_hpc.rundir.storage.filesystem_problem`): such a rank could not write the
    file either, and a write is what failed it. Its error (``type`` StorageError) is genuine:
    it is blamed before the peers that only lost it."""
    out = dict(errors)
    missing = [r for r, c in codes.items() if c is not None and c > 0 and not errors.get(r)]
    problem = filesystem_problem(run_dir) if missing else None
    if problem:
        for rank in missing:
            out[rank] = {
                "type": StorageError.__name__,
                "message": storage_message(problem, run_dir),
                "peer": False,
            }
    return out


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


def first_failure(
    codes: Mapping[int, int],
    errors: Mapping[int, Optional[Dict]],
    stopped: Iterable[int] = (),
    silent: Iterable[int] = (),
) -> int:
    """The rank to blame (local launcher and SLURM).

    Args:
        codes: rank -> exit code observed BEFORE the launcher stopped anyone (negative = killed
            by that signal); ranks still running are absent. SLURM gives none: ``{}``.
        errors: rank -> its error (:func:`read_error_file`, or one built from a traceback:
            ``type``, ``message``, optional ``time`` and ``peer``), or None.
        stopped: ranks found stopped (SIGSTOP, Ctrl-Z) while the others failed.
        silent: ranks that left neither a result nor an error of their own while others
            failed (SLURM: killed by a signal, or stopped); ranked with the killed ones.

    Returns:
        the first rank with a genuine error (by the error's time; of ranks that raised the
        same error, as every rank does for a task's contract or data, the lowest), else the first rank killed
        by a foreign signal or silent, else a stopped rank, else the first peer disconnection,
        else the lowest failed rank.

    Raises:
        ValueError: no rank failed.
    """
    stopped, silent = set(stopped), set(silent)
    failed = sorted(
        set(r for r, c in codes.items() if c not in (None, 0))
        | set(r for r, e in errors.items() if e)
        | stopped
        | silent
    )
    if not failed:
        raise ValueError("no rank failed")

    def line(err: Dict) -> str:
        return f"{err.get('type')}: {err.get('message')}"

    first_seen: Dict[str, float] = {}  # the same error on several ranks: its earliest time
    for err in errors.values():
        if err:
            when = float(err.get("time", float("inf")))
            first_seen[line(err)] = min(when, first_seen.get(line(err), when))

    def order(rank: int) -> tuple:
        err = errors.get(rank)
        when = float(err.get("time", float("inf"))) if err else float("inf")
        if err and not (err.get("peer") or is_peer_error(line(err))):
            return (0, first_seen[line(err)], rank)  # ties: the lowest rank with that error
        if codes.get(rank, 0) < 0 or (rank in silent and not err):
            return (1, 0.0, rank)
        if rank in stopped or (err and float(err.get("stopped_s") or 0) > 0):
            return (2, 0.0, rank)
        return (3 if err else 4, when, rank)

    return min(failed, key=order)


class StopWatch:
    """Notices that this process was stopped (SIGSTOP, Ctrl-Z, a frozen node): a daemon thread
    ticks every ``tick_s``; a tick that comes ``gap_s`` late means every thread of the process
    stood still that long. :attr:`stopped_s` is the longest such gap (0.0: never stopped).

    A stopped SLURM rank cannot be seen from the launcher's node, and when Slurm ends the step
    it continues the rank, which then fails like its peers with a disconnection; its error
    file's ``stopped_s`` (:func:`note_stopped`) tells the launcher which rank they waited for.
    """

    def __init__(self, gap_s: float = STOP_GAP_S, tick_s: float = 0.5, clock: Any = time.monotonic):
        self.gap_s, self.tick_s = gap_s, tick_s
        self.stopped_s = 0.0
        self._clock = clock
        self._done = threading.Event()

    def check(self, last: float) -> float:
        """One tick: record the gap since ``last`` if it is a stop; returns the new tick time."""
        now = self._clock()
        if now - last - self.tick_s >= self.gap_s:
            self.stopped_s = max(self.stopped_s, now - last - self.tick_s)
        return now

    def start(self) -> StopWatch:
        """Start the daemon thread; returns self."""

        def run() -> None:
            last = self._clock()
            while not self._done.wait(self.tick_s):
                last = self.check(last)

        threading.Thread(target=run, name="hetseq-stop-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        """End the thread (within one tick); :attr:`stopped_s` keeps its value."""
        self._done.set()


def note_stopped(path: Path, stopped_s: float) -> None:
    """Add ``stopped_s`` (seconds this rank stood still, :class:`StopWatch`) to its error file
    ``path`` (:func:`hetseq_hpc.env.rank_guard.report_failure`). Never raises."""
    data = read_error_file(path)
    if data is None or stopped_s <= 0:
        return
    try:
        atomic_write_json(path, {**data, "stopped_s": round(float(stopped_s), 1)})
    except (OSError, RankFenced):  # a rank the others left out writes nothing
        pass


def write_stop_record(
    run_dir: RunDir,
    job_id: str,
    step: int,
    code: int,
    restarts: int,
    max_requeues: int,
    requeued: bool,
) -> None:
    """Rank 0 of a SLURM job that stopped after writing the checkpoint of ``step`` records it
    in ``<run dir>/logs/stop.json`` (``code``: :mod:`hetseq_hpc.env.preemption`'s TERMINATE or
    REQUEUE; ``requeued``: the job was requeued and will go on by itself). Never raises."""
    try:
        path = run_dir.stop_record
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            path,
            {
                "job_id": str(job_id),
                "step": int(step),
                "code": int(code),
                "restarts": int(restarts),
                "max_requeues": int(max_requeues),
                "requeued": bool(requeued),
                "time": time.time(),
            },
        )
    except OSError:
        pass


def read_stop_record(run_dir: RunDir, job_id: str) -> Optional[Dict[str, Any]]:
    """Job ``job_id``'s stop record (:func:`write_stop_record`), or None if there is none, it
    is unreadable, or it belongs to another job."""
    try:
        data = json.loads(run_dir.stop_record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or str(data.get("job_id")) != str(job_id):
        return None
    return data if isinstance(data.get("step"), int) else None


def signal_reason(code: int, run_dir: RunDir, rank: int, oom: Optional[str] = None) -> str:
    """Words for a rank that died of signal ``-code``. A SIGKILL is called out of memory only
    when ``oom`` says why (:func:`hetseq_hpc.env.memcg.oom_evidence`: the cgroup's OOM-kill count
    rose, or the kernel log names the process), with ``allocation.json``'s memory estimate for
    the rank and the fix; otherwise nobody can tell who sent it, and the words say so."""
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
    if -code != signal.SIGKILL:
        return f"killed by signal {name}"
    if not oom:
        return f"killed by {name} (by a user, the scheduler, or the OOM killer)"
    reason = f"killed by {name}: out of memory (the kernel's OOM killer: {oom})"
    estimate = memory_estimate_gb(run_dir, rank)
    if estimate is not None:
        reason += (
            f"; the rank was planned to use about {estimate:.2f} GiB (allocation.json: "
            "static + activations x micro-batch)"
        )
    return reason + ": lower cluster.memory_budget_gb, shrink task.model or balance.max_micro_batch"


def memory_estimate_gb(run_dir: RunDir, rank: int) -> Optional[float]:
    """GiB rank ``rank`` was planned to hold: calibration ``static_bytes`` + ``activation_bytes_
    per_sample`` x its micro-batch, from ``<run dir>/allocation.json``; None if unknown."""
    try:
        data = json.loads(run_dir.allocation.read_text())
        entry = data["ranks"][rank]
        cal, share = entry["calibration"], entry["share"]
        total = float(cal["static_bytes"]) + float(cal["activation_bytes_per_sample"]) * int(
            share["micro_batch"]
        )
        return total / 2**30
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def survivors_stopped(codes: Mapping[int, int], tolerated: Callable[[int], bool]) -> bool:
    """Whether an elastic run ended with lost ranks (``tolerated`` exit codes: a signal, left
    out) and survivors that stopped after a checkpoint (exit 3: fewer than
    ``trainer.elastic.min_ranks`` left, or the batch no longer fit them), and nothing else."""
    stop = dict(EXIT_CODES)[Preempted]
    return stop in codes.values() and all(tolerated(c) or c == stop for c in codes.values())


def too_few_message(run_dir: RunDir, lost: Sequence[int], reasons: Sequence[str]) -> str:
    """One line for :func:`survivors_stopped`: who was lost and why, why the survivors stopped
    (the membership row's ``stopped``), and the fix."""
    why = "the survivors could not go on"
    try:
        rows = [r for r in read_metrics(run_dir.metrics) if r.get("event") == "membership"]
        why = next((r["stopped"] for r in reversed(rows) if r.get("stopped")), why)
    except Exception:  # no readable metrics: the generic words
        pass
    who = "; ".join(f"rank {r}: {reason}" for r, reason in zip(lost, reasons))
    return (
        f"rank(s) {list(lost)} were lost ({who}); the others stopped after checkpointing their "
        f"last completed step: {why}; resume with trainer.resume=auto (a Slurm job is "
        f"requeued and resumes by itself); see {run_dir.rank_log(lost[0])}"
    )


__all__ = [
    "PEER_MARKERS",
    "STOP_GAP_S",
    "STOP_RECORD",
    "StopWatch",
    "error_line",
    "first_failure",
    "is_peer_error",
    "memory_estimate_gb",
    "note_stopped",
    "pick_failure",
    "read_error_file",
    "read_stop_record",
    "signal_reason",
    "storage_cause",
    "survivors_stopped",
    "too_few_message",
    "write_stop_record",
]
