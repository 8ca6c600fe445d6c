"""What happened to a run besides its steps, for the report: resumes, stops, checkpoints and
a start over an earlier run, from ``events.jsonl`` (:mod:`hetseq_hpc.rundir.events`), as
marks for the plot and lines for the text summary. Lost ranks (``membership`` rows of ``metrics.jsonl``) are
listed by :func:`hetseq_hpc.report.plots.text_summary` itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple, Union

from hetseq_hpc.rundir.events import read_events
from hetseq_hpc.rundir.paths import RunDir

#: at most this many checkpoint steps are listed one by one (then the first and last few)
LISTED_CHECKPOINTS = 8


@dataclass
class Timeline:
    """A run's events, ready to draw and list.

    Attributes:
        marks: ``(kind, step)`` of every resume, stop and checkpoint, in order (kinds of
            :data:`hetseq_hpc.report.figure.EVENT_STYLES`).
        lines: the text summary's lines, each starting with two spaces.
    """

    marks: List[Tuple[str, int]] = field(default_factory=list)
    lines: List[str] = field(default_factory=list)


def _steps_text(steps: List[int]) -> str:
    if len(steps) <= LISTED_CHECKPOINTS:
        return ", ".join(map(str, steps))
    head, tail = steps[:3], steps[-3:]
    return f"{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))}"


def _stop_line(event: Dict, cause: str) -> str:
    why = f"by {cause} to the launcher" if cause else f"({event.get('reason') or 'a stop request'})"
    return f"  stopped after step {event['step']} {why}, after its checkpoint"


def _resume_line(event: Dict) -> str:
    where = f" from {event['checkpoint']}" if event.get("checkpoint") else ""
    line = f"  resumed at step {event['step']}{where}"
    if event.get("world_size") is not None:
        line += f" on {event['world_size']} rank(s), allocation {event.get('allocation')}"
    if event.get("refused"):
        line += f" (newer checkpoint(s) refused: {', '.join(map(str, event['refused']))})"
    return line


def run_timeline(run_dir: Union[str, Path]) -> Timeline:
    """The :class:`Timeline` of ``run_dir``'s ``events.jsonl`` (empty when there is none),
    from the current run's ``start`` row on (rows before it belong to an earlier run, or to
    one stopped before its first step).

    The local launcher's ``stopped_by`` row (Ctrl-C, SIGTERM to it; written once the ranks
    ended) names the cause of the ``stop`` row just before it; one with no stop before it
    (the ranks ended before a step's checkpoint) is listed alone. A checkpoint recorded before
    a resume from an earlier step is left out (that attempt's later steps were trained again).
    """
    folder = Path(run_dir)
    events, damaged = read_events(
        RunDir(folder.parent if folder.name.endswith(".jsonl") else folder)
    )
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    events = events[starts[-1] :] if starts else events
    out = Timeline()
    checkpoints: Dict[int, None] = {}
    previous: Dict = {}  # the row before
    for event in events:
        kind, step = event["event"], event.get("step")
        if kind == "stopped_by":
            cause = str(event.get("cause") or "a stop request")
            if previous.get("event") == "stop":
                out.lines[-1] = _stop_line(previous, cause)
            else:
                out.lines.append(f"  stopped by {cause} to the launcher before a checkpoint")
        elif kind == "stop":
            out.marks.append(("stop", step))
            out.lines.append(_stop_line(event, ""))
        elif kind == "resume":
            checkpoints = {s: None for s in checkpoints if s <= step}
            out.marks.append(("resume", step))
            out.lines.append(_resume_line(event))
        elif kind == "checkpoint":
            checkpoints[step] = None
        elif kind == "start" and event.get("archived"):
            out.lines.append(
                f"  started as a new run; the earlier run's records are in {event['archived']}"
            )
        previous = event
    saved = sorted(checkpoints)
    out.marks += [("checkpoint", s) for s in saved]
    if saved:
        out.lines.append(f"  checkpoints at step(s) {_steps_text(saved)} ({len(saved)} in all)")
    if damaged:
        out.lines.append(f"  ({damaged} damaged line(s) of events.jsonl skipped)")
    return out


__all__ = ["LISTED_CHECKPOINTS", "Timeline", "run_timeline"]
