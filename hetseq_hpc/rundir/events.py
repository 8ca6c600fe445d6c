"""``events.jsonl``: what happened to a run besides its steps, one JSON object a line, in order.

Rank 0 and the local launcher append (:func:`append_event`); ``hetseq-hpc report`` reads them
(:func:`read_events`) to mark them on the plot and list them::

    {"event": "start", "step": 0, "archived": "previous/<id>" or null}   a run at step 0
    {"event": "resume", "step": 40, "checkpoint": "...", "world_size": 2, "allocation": [...]}
    {"event": "checkpoint", "step": 50}                            written after the save
    {"event": "stop", "step": 50, "code": 1, "reason": "..."}      after its checkpoint
    {"event": "stopped_by", "cause": "Ctrl-C (SIGINT)"}    the local launcher, after the ranks

Every row also has ``time`` (seconds since the epoch) and, where known, ``run_id``. Nothing is
dropped on resume (``metrics.jsonl`` drops its rows after the checkpoint); the current run's
rows are those from its ``start`` on. A lost rank's ``membership`` rows stay in
``metrics.jsonl``. An append never fails a run: a write error is one warning.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict, List, Tuple

from hetseq_hpc.files.fence import check_write, stamp
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)

#: the kinds of event rows this module's writers use (``report`` knows each)
KINDS = ("start", "resume", "checkpoint", "stop", "stopped_by")


def append_event(run_dir: RunDir, event: str, **fields: Any) -> None:
    """Append ``{"event": event, **fields, "time": now}`` to ``<run_dir>/events.jsonl``.

    One ``write`` of one line in append mode (lines from rank 0 and the launcher do not
    interleave). An ``OSError`` (a full disk, a read-only run directory) or a value JSON
    cannot hold is one warning, and the run goes on; a rank left out by the others raises
    ``RankFenced`` and writes nothing (:mod:`hetseq_hpc.files.fence`; the row carries its
    writer's ``written_by`` otherwise).
    """
    path = run_dir.events
    check_write(path)
    try:
        row = {"event": event, **fields, "time": round(time.time(), 3), **stamp()}
        line = json.dumps(row) + "\n"
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("could not record the %s event in %s (%s)", event, path, exc)


def read_events(run_dir: RunDir) -> Tuple[List[Dict[str, Any]], int]:
    """``(events, damaged)``: the rows of ``<run_dir>/events.jsonl`` that are JSON objects with
    a known ``event`` kind (:data:`KINDS`) and a whole ``step`` >= 0 (``stopped_by`` rows
    have none), in file order, and how many lines were skipped (damaged, cut off, or of an
    unknown kind). A missing or unreadable file is ``([], 0)``: events only annotate a run."""
    path = run_dir.events
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return [], 0
    events: List[Dict[str, Any]] = []
    damaged = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            damaged += 1
            continue
        step = row.get("step") if isinstance(row, dict) else None
        step_ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
        if not isinstance(row, dict) or row.get("event") not in KINDS:
            damaged += 1
        elif step_ok or (row["event"] == "stopped_by" and step is None):
            events.append(row)
        else:
            damaged += 1
    return events, damaged


__all__ = ["KINDS", "append_event", "read_events"]
