"""Pictures of a run, from ``metrics.jsonl``.

``hetseq-hpc report RUN_DIR [--out FILE]`` (or ``python -m hetseq_hpc.report.plots``) writes
``RUN_DIR/ranks.png`` (or FILE), and every run writes it at its end (``trainer.plot``, on by
default): loss and validation loss, throughput, each rank's share of the global batch and
each rank's step time over the optimizer steps, re-allocations, lost ranks, resumes, stops
and checkpoints marked (:func:`hetseq_hpc.report.figure.build_figure`). :func:`text_summary`
gives the run in a few lines (``hetseq-hpc report`` prints it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Union

from hetseq_hpc.errors import ConfigError, HetseqError
from hetseq_hpc.files.user_input import describe, number, output_problem
from hetseq_hpc.report.figure import build_figure, rank_label
from hetseq_hpc.report.timeline import run_timeline
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.metrics import read_metrics

_FIX = "restore the metrics.jsonl a hetseq_hpc run wrote, or delete that row"
#: per-rank figures the report reads: (key, integer)
_RANK_FIGURES = (
    ("micro_batch", True),
    ("accum_steps", True),
    ("samples", True),
    ("step_time_s", False),
    ("compute_time_s", False),
)
#: row figures the report reads (numbers or null)
_ROW_FIGURES = ("loss", "samples_per_s", "straggle", "val_loss")
#: largest magnitude of a plotted or printed figure (keeps axis limits finite)
_MAX_FIGURE = 1e15


def _check_row(row: dict, where: str) -> None:
    """One ``metrics.jsonl`` row as the report reads it (see :func:`step_rows`)."""
    number(row.get("step"), f"{where} step", _FIX, 0, _MAX_FIGURE, integer=True)
    for key in _ROW_FIGURES:
        if row.get(key) is not None:
            number(row[key], f"{where} {key}", _FIX, -_MAX_FIGURE, _MAX_FIGURE)
    ranks = row.get("ranks")
    if not isinstance(ranks, list):
        raise ConfigError(
            f"{where} ranks is {describe(ranks)}, not a list of per-rank objects: {_FIX}"
        )
    for i, rank in enumerate(ranks):
        if not isinstance(rank, dict):
            raise ConfigError(f"{where} ranks[{i}] is {describe(rank)}, not an object: {_FIX}")
        number(rank.get("rank"), f"{where} ranks[{i}].rank", _FIX, 0, 2**31, integer=True)
        for key, integer in _RANK_FIGURES:
            if rank.get(key) is not None:
                number(rank[key], f"{where} ranks[{i}].{key}", _FIX, 0, _MAX_FIGURE, integer)
    move = row.get("reallocation")
    if move is not None and not isinstance(move, dict):
        raise ConfigError(f"{where} reallocation is {describe(move)}, not an object: {_FIX}")
    if move and move.get("to") is not None and not isinstance(move["to"], list):
        raise ConfigError(f"{where} reallocation.to is {describe(move['to'])}, not a list: {_FIX}")
    if move and move.get("at_step") is not None:
        number(move["at_step"], f"{where} reallocation.at_step", _FIX, 0, _MAX_FIGURE, True)


def step_rows(run_dir: Union[str, Path]) -> List[dict]:
    """Rows of ``<run_dir>/metrics.jsonl`` that carry per-rank figures, each checked: ``step``
    a whole number, ``ranks`` a list of objects with a whole ``rank``, every figure the report
    reads a finite number or null, ``reallocation`` an object.

    Raises:
        ConfigError: the file is missing or unreadable (:func:`read_metrics`), or a row has a
            value of the wrong type (one line naming the row and key).
        HetseqError: it has no per-rank rows.
    """
    rows = []
    name = Path(run_dir) if str(run_dir).endswith(".jsonl") else RunDir(run_dir).metrics
    for index, row in enumerate(read_metrics(run_dir), 1):
        if row.get("ranks") is None or row["ranks"] == []:  # not a step row
            continue
        _check_row(row, f"{name} row {index}")
        rows.append(row)
    if not rows:
        raise HetseqError(f"{name} has no step rows: train at least one step first")
    return rows


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _png_target(run_dir: Union[str, Path], out_path: Optional[Union[str, Path]]) -> Path:
    """The file :func:`plot_run` writes, checked before any work.

    Raises:
        ConfigError: it is a directory or not a regular file, cannot be created, or has a
            suffix matplotlib cannot write.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    folder = Path(run_dir).parent if str(run_dir).endswith(".jsonl") else Path(run_dir)
    out = Path(out_path).expanduser() if out_path else RunDir(folder).plot
    shown = f"--out {out}" if out_path else str(out)
    problem = output_problem(out)
    if problem:
        raise ConfigError(f"{shown} {problem}: give a writable file, e.g. --out ranks.png")
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = out.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        raise ConfigError(
            f"{shown}: matplotlib cannot write .{suffix} files: end the name with "
            f"one of {', '.join('.' + f for f in sorted(formats))}"
        )
    return out


def run_figure(run_dir: Union[str, Path], rows: Optional[List[dict]] = None):
    """The run's matplotlib Figure (:func:`hetseq_hpc.report.figure.build_figure`) with its
    lost and joined ranks (``membership`` rows) and events (:func:`run_timeline`); the caller closes it.

    Args:
        run_dir: run directory holding ``metrics.jsonl``.
        rows: its checked step rows (:func:`step_rows`, read here when None).

    Raises:
        ConfigError, HetseqError: as :func:`step_rows`.
    """
    rows = step_rows(run_dir) if rows is None else rows
    events = membership_events(run_dir)
    return build_figure(
        rows,
        f"run {Path(run_dir).resolve().name}: steps {rows[0]['step']}-"
        f"{rows[-1]['step']}, {len(rows[-1]['ranks'])} rank(s)",
        [e["step"] for e in events if not e.get("joined")],
        run_timeline(run_dir).marks,
        [e["step"] for e in events if e.get("joined")],
    )


def plot_run(run_dir: Union[str, Path], out_path: Optional[Union[str, Path]] = None) -> Path:
    """Draw the run's four panels (:func:`hetseq_hpc.report.figure.build_figure`); returns
    the PNG's path.

    Args:
        run_dir: run directory holding ``metrics.jsonl``.
        out_path: PNG to write (default ``ranks.png`` next to ``metrics.jsonl``).

    Raises:
        ConfigError: ``metrics.jsonl`` is not a run's metrics file (:func:`step_rows`), or the
            PNG cannot be written there (checked first; a failing write is one line too).
        HetseqError: ``metrics.jsonl`` has no step rows.
    """
    import matplotlib

    rows = step_rows(run_dir)
    out = _png_target(run_dir, out_path)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = run_figure(run_dir, rows)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise ConfigError(
            f"{out} cannot be written ({exc.strerror or exc}): give a writable "
            "file, e.g. --out ranks.png"
        ) from None
    finally:
        plt.close(fig)
    return out


def _reloaded(reloaded: Any, redone: Any) -> str:
    """The report's note on an FSDP recovery (a membership row's ``reloaded``), or ''."""
    if not isinstance(reloaded, dict):
        return ""
    start = (
        f"reloaded the step-{reloaded.get('step')} checkpoint"
        if reloaded.get("checkpoint")
        else "no checkpoint yet: restarted from the seeded start model"
    )
    return f" (FSDP: {start}, {redone} step(s) trained again)"


def membership_events(run_dir: Union[str, Path]) -> List[dict]:
    """The ``event: membership`` rows of a run (a lost rank survived in-job,
    :mod:`hetseq_hpc.train.recovery.elastic`), in order."""
    return [
        r
        for r in read_metrics(run_dir)
        if r.get("event") == "membership" and isinstance(r.get("step"), int)
    ]


def _median(values: List[float]) -> Optional[float]:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    return values[len(values) // 2] if values else None


def text_summary(run_dir: Union[str, Path]) -> str:
    """A few lines about a run from its ``metrics.jsonl``: steps, first and last loss,
    validation, median samples/s and straggle, re-allocations, resumes, stops and checkpoints
    with their steps (:func:`~hetseq_hpc.report.timeline.run_timeline`), lost ranks, and per
    rank (from the last step) its device, micro-batch x accumulation, samples and median
    compute time.

    Raises:
        HetseqError: ``metrics.jsonl`` is missing or has no step rows.
    """
    rows = step_rows(run_dir)
    first, last = rows[0], rows[-1]
    vals = [r for r in read_metrics(run_dir) if isinstance(r.get("val_loss"), (int, float))]
    moves = [r["reallocation"] for r in rows if isinstance(r.get("reallocation"), dict)]
    lines = [
        f"run {Path(run_dir).resolve()}: steps {first['step']}-{last['step']} "
        f"({len(rows)} logged), {len(last['ranks'])} rank(s), allocation {last.get('allocation')}",
        f"  loss {_fmt(first.get('loss'), '.4f')} -> {_fmt(last.get('loss'), '.4f')}",
    ]
    if vals:
        lines.append(
            f"  validation loss {vals[0]['val_loss']:.4f} (step {vals[0]['step']}) -> "
            f"{vals[-1]['val_loss']:.4f} (step {vals[-1]['step']})"
        )
    speed = _median([r.get("samples_per_s") for r in rows])
    straggle = _median([r.get("straggle") for r in rows])
    if speed is not None:
        lines.append(
            f"  median {speed:.1f} samples/s, straggle {straggle or 0.0:.3f} "
            "((max - min) / mean per-rank compute time)"
        )
    for move in moves:
        lines.append(
            f"  re-allocation at step {move.get('at_step')}: {move.get('from')} -> {move.get('to')}"
        )
    lines += run_timeline(run_dir).lines
    for ev in membership_events(run_dir):
        lost = [x.get("rank") for x in ev.get("lost") or [] if isinstance(x, dict)]
        joined = [x.get("rank") for x in ev.get("joined") or [] if isinstance(x, dict)]
        if joined:  # a replacement joined the running job (trainer.elastic.restarts)
            lines.append(
                f"  rank(s) {joined} joined at step {ev.get('step')}: went on with "
                f"{ev.get('world_size')} rank(s), split {ev.get('split')}, "
                f"{ev.get('join_s')} s from the join request to the first step with it"
            )
            continue
        if ev.get("stopped"):  # too few survivors: they checkpointed and stopped for a requeue
            lines.append(
                f"  lost rank(s) {lost} at step {ev.get('step')}: stopped "
                f"({ev['stopped']}) after a checkpoint, for a requeue"
            )
            continue
        lines.append(
            f"  lost rank(s) {lost} at step {ev.get('step')}: went on with "
            f"{ev.get('world_size')} rank(s), split {ev.get('split')}, "
            f"{ev.get('recovery_s')} s to the next completed step"
            + _reloaded(ev.get("reloaded"), ev.get("steps_redone"))
        )
    for rank in last["ranks"]:
        times = [
            r2.get("compute_time_s")
            for row in rows
            for r2 in row["ranks"]
            if r2.get("rank") == rank["rank"]
        ]
        median = _median(times)
        lines.append(
            f"  {rank_label(rank)}: {rank.get('micro_batch')} x {rank.get('accum_steps')} "
            f"= {rank.get('samples')} samples/step, median compute "
            + (f"{median:.3f} s" if median is not None else "n/a")
        )
    return "\n".join(lines)
