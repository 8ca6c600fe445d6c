"""Print a :class:`~hetseq_hpc.plan.when.WhenTable`: one row per candidate mix, sorted by
expected finish, then one JSON line with the same figures (``hetseq-hpc plan --when``).

Columns: ``mix`` (partition key:nodes, het-component order), ``ranks``, ``GPUs`` (GPUs held;
a CPU-only partition counts one per rank), ``step s`` (predicted step time), ``run``
(start-up + steps x step + checkpoint writes, H:MM:SS), ``start`` (Slurm's expected start,
``sbatch --test-only``, local time), ``wait`` (start - now), ``finish`` (start + run),
``GPU-h`` (GPUs x run, hours), ``note`` (why a mix has no estimate or cannot run, a run longer
than ``cluster.timeout_min`` (never picked), the nodes Slurm named and the ``--time`` Slurm was
asked with: the predicted run plus a margin, :func:`hetseq_hpc.plan.when.asked_time_min`).
"""

from __future__ import annotations

import json
import time
from typing import List, Optional

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.plan.when import MixRow, WhenTable

HEADER = (
    "#",
    "mix",
    "ranks",
    "GPUs",
    "step s",
    "run",
    "start (Slurm)",
    "wait",
    "finish",
    "GPU-h",
    "note",
)


def clock(epoch: Optional[float]) -> str:
    """``epoch`` seconds as local ``YYYY-MM-DDTHH:MM:SS`` (Slurm's own format), '-' for None."""
    return "-" if epoch is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


def duration(seconds: Optional[float]) -> str:
    """``seconds`` as ``H:MM:SS`` (``Nd H:MM:SS`` from a day on), '-' for None."""
    if seconds is None:
        return "-"
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def row_note(row: MixRow, timeout_min: Optional[int] = None) -> str:
    """The note of one row: the problem, else the missing estimate, else what Slurm said."""
    if row.problem:
        return row.problem
    parts = []
    if row.start is None:
        parts.append("Slurm not asked")
    elif row.start.start_epoch is None:
        parts.append(f"no start estimate from Slurm ({row.start.detail}): finish unknown")
    elif row.start.detail:
        parts.append(row.start.detail)
    if row.over_limit:
        limit = f"cluster.timeout_min={timeout_min}" if timeout_min else "cluster.timeout_min"
        parts.append(
            f"run longer than {limit}: not picked (it would hit the limit and be "
            "requeued; raise the limit)"
        )
    elif row.asked_min and row.start is not None:
        parts.append(f"asked --time={row.asked_min} min")
    return "; ".join(parts)


def _picks(table: WhenTable) -> dict:
    picks = {}
    for choose in ("finish_first", "cheapest"):
        try:
            picks[choose] = table.pick(choose).label
        except ConfigError:
            picks[choose] = None
    return picks


def render_when(table: WhenTable, run=None) -> str:
    """The table as text (``run``: the RunConfig, for the header's figures).

    Returns:
        header lines, the table, and the picks of ``cluster.choose``.
    """
    lines = [
        f"hetseq-hpc plan --when: {table.note}; Slurm asked at {clock(table.now)} "
        "(sbatch --test-only: nothing submitted)"
    ]
    timeout = None
    if run is not None:
        opts, trainer = run.plan, run.trainer
        timeout = getattr(run.cluster, "timeout_min", None)
        every = trainer.checkpoint_every
        lines.append(
            f"run = start-up {opts.startup_s:g} s (plan.startup_s) + {trainer.max_steps} "
            f"steps (trainer.max_steps) x predicted step + a checkpoint "
            f"{'every ' + str(every) + ' steps and ' if every else ''}at the end at "
            f"{opts.checkpoint_gb_s:g} GB/s (plan.checkpoint_gb_s); finish = Slurm's "
            "expected start + run; GPU-h = GPUs x run"
        )
    if table.source:
        lines.append(f"throughput: {table.source}")
    cells: List[tuple] = []
    for index, row in enumerate(table.rows, 1):
        able = not row.problem
        start = row.start_epoch
        cells.append(
            (
                str(index),
                row.label,
                str(row.ranks) if able else "-",
                str(row.gpus) if able else "-",
                f"{row.step_s:.4g}" if able else "-",
                duration(row.run_s) if able else "-",
                clock(start) if able else "-",
                duration(start - table.now) if able and start is not None else "-",
                clock(row.finish_epoch),
                f"{row.gpu_hours:.3g}" if able else "-",
                row_note(row, timeout),
            )
        )
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(HEADER)
    ]
    lines.append("")
    lines.append("  ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip())
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    lines.append("")
    if not table.estimated and any(not r.problem for r in table.rows):
        lines.append(
            "Slurm gave no start estimate for any mix (SchedulerType=sched/backfill "
            "off, or no estimate in its answer): the rows are by run time alone and "
            "their finish is unknown; nothing is guessed"
        )
    picks = _picks(table)
    if table.left_out:
        drop = " ".join(f"~cluster.partitions.{k}" for k in table.left_out)
        lines.append(
            f"cluster.choose refuses while partition(s) {', '.join(table.left_out)} "
            f"cannot run (fix them, or drop them: {drop}); without them"
        )
    lines.append(
        f"cluster.choose=finish_first would submit: {picks['finish_first'] or 'none (no estimate)'}"
        f"; cluster.choose=cheapest: {picks['cheapest'] or 'none'}"
    )
    return "\n".join(lines)


def when_json(table: WhenTable, run=None) -> str:
    """One JSON line: ``asked_at`` (epoch s), ``mixes`` (per row: ``mix``, ``label``,
    ``ranks``, ``gpus``, ``step_s``, ``run_s``, ``start``/``finish`` epoch s or null,
    ``gpu_hours``, ``note``) in table order, the ``finish_first``/``cheapest`` picks, and
    ``left_out`` (partition key -> why it cannot run; in no mix)."""
    timeout = getattr(run.cluster, "timeout_min", None) if run is not None else None
    mixes = []
    for row in table.rows:
        able = not row.problem
        mixes.append(
            {
                "mix": row.mix,
                "label": row.label,
                "ranks": row.ranks,
                "gpus": row.gpus,
                "step_s": round(row.step_s, 6) if able else None,
                "run_s": round(row.run_s, 3) if able else None,
                "start": row.start_epoch if able else None,
                "finish": row.finish_epoch,
                "gpu_hours": round(row.gpu_hours, 6) if able else None,
                "asked_time_min": row.asked_min or None,
                "over_limit": row.over_limit,
                "note": row_note(row, timeout),
            }
        )
    return json.dumps(
        {
            "asked_at": table.now,
            "note": table.note,
            "mixes": mixes,
            **_picks(table),
            "left_out": table.left_out,
        }
    )
