"""Pictures of a run: per-rank step time and samples per step, from ``metrics.jsonl``.

``hetseq-hpc report RUN_DIR [--out FILE]`` (or ``python -m hetseq_hpc.report``) writes
``RUN_DIR/ranks.png`` (or FILE):
two stacked panels sharing the step axis, per-rank compute time per step (s) and per-rank
samples per step, one line per rank; a dashed vertical line marks every re-allocation at the
step it takes effect (``reallocation.at_step``). :func:`text_summary` gives the run in a few
lines (``hetseq-hpc report`` prints it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Union

from hetseq_hpc.errors import HetseqError
from hetseq_hpc.train.metrics import METRICS_NAME, read_metrics


def step_rows(run_dir: Union[str, Path]) -> List[dict]:
    """Rows of ``<run_dir>/metrics.jsonl`` that carry per-rank figures.

    Raises:
        HetseqError: the file is missing, unreadable or has no per-rank rows (one line).
    """
    rows = [r for r in read_metrics(run_dir) if r.get("ranks")]
    if not rows:
        raise HetseqError(f"{Path(run_dir) / METRICS_NAME} has no step rows: train at least one "
                          "step first")
    return rows


def _label(rank: dict) -> str:
    where = rank.get("partition") or rank.get("device") or ""
    device = rank.get("device") or ""
    if rank.get("partition") and device:
        where = f"{rank['partition']}, {device}"
    return f"rank {rank['rank']} ({where})" if where else f"rank {rank['rank']}"


def plot_run(run_dir: Union[str, Path], out_path: Optional[Union[str, Path]] = None) -> Path:
    """Plot per-rank compute time and samples per step; returns the PNG's path.

    Args:
        run_dir: run directory holding ``metrics.jsonl``.
        out_path: PNG to write (default ``<run_dir>/ranks.png``).

    Raises:
        HetseqError: ``metrics.jsonl`` is missing or empty.
    """
    rows = step_rows(run_dir)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: Dict[int, Dict[str, list]] = {}
    labels: Dict[int, str] = {}
    partitions: Dict[int, str] = {}
    for row in rows:
        for rank in row["ranks"]:
            s = series.setdefault(int(rank["rank"]), {"step": [], "time": [], "samples": []})
            s["step"].append(row["step"])
            s["time"].append(rank.get("compute_time_s", rank.get("step_time_s")))
            s["samples"].append(rank.get("samples"))
            labels.setdefault(int(rank["rank"]), _label(rank))
            partitions.setdefault(int(rank["rank"]), str(rank.get("partition") or "ranks"))
    moves = [r["reallocation"] for r in rows if isinstance(r.get("reallocation"), dict)]

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5),
                                      gridspec_kw={"height_ratios": [3, 2]})
    many = len(series) > 12  # then one colour and one legend entry per partition
    colours: Dict[str, str] = {}
    for rank in sorted(series):
        s = series[rank]
        style = {}
        label = labels[rank]
        if many:
            group = partitions[rank]
            label = None if group in colours else group
            colours.setdefault(group, f"C{len(colours) % 10}")
            style = {"color": colours[group], "alpha": 0.5}
        top.plot(s["step"], s["time"], lw=1.2, label=label, **style)
        bottom.step(s["step"], s["samples"], where="post", lw=1.5, **style)
    for move in moves:
        at = move.get("at_step")
        if at is None:
            continue
        for ax in (top, bottom):
            ax.axvline(at, color="0.3", ls="--", lw=1)
        text = f"re-allocation at step {at}"
        if len(move.get("to") or []) <= 4:
            text += f"\n{move.get('from')} -> {move.get('to')}"
        top.annotate(text, (at, 1.0),
                     xycoords=("data", "axes fraction"), xytext=(4, -4),
                     textcoords="offset points", va="top", fontsize=8, color="0.2",
                     bbox={"fc": "white", "ec": "none", "alpha": 0.8})
    top.set_ylabel("compute time per step (s)")
    peak = max((t for s in series.values() for t in s["time"] if t is not None), default=0)
    top.set_ylim(0, 1.2 * peak if peak > 0 else 1)  # room for the re-allocation labels
    top.set_title(f"per-rank step time and share: {Path(run_dir).resolve().name}")
    top.legend(fontsize=8, loc="lower left", ncol=2 if len(series) > 4 and not many else 1)
    bottom.set_ylabel("samples per step")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_path) if out_path else Path(run_dir) / "ranks.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _median(values: List[float]) -> Optional[float]:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    return values[len(values) // 2] if values else None


def text_summary(run_dir: Union[str, Path]) -> str:
    """A few lines about a run from its ``metrics.jsonl``: steps, first and last loss,
    validation, median samples/s and straggle, re-allocations, and per rank (from the last
    step) its device, micro-batch x accumulation, samples and median compute time.

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
        f"  loss {first.get('loss', float('nan')):.4f} -> {last.get('loss', float('nan')):.4f}",
    ]
    if vals:
        lines.append(f"  validation loss {vals[0]['val_loss']:.4f} (step {vals[0]['step']}) -> "
                     f"{vals[-1]['val_loss']:.4f} (step {vals[-1]['step']})")
    speed = _median([r.get("samples_per_s") for r in rows])
    straggle = _median([r.get("straggle") for r in rows])
    if speed is not None:
        lines.append(f"  median {speed:.1f} samples/s, straggle {straggle or 0.0:.3f} "
                     "((max - min) / mean per-rank compute time)")
    for move in moves:
        lines.append(f"  re-allocation at step {move.get('at_step')}: {move.get('from')} -> "
                     f"{move.get('to')}")
    for rank in last["ranks"]:
        times = [r2.get("compute_time_s") for row in rows for r2 in row["ranks"]
                 if r2.get("rank") == rank["rank"]]
        median = _median(times)
        lines.append(f"  {_label(rank)}: {rank.get('micro_batch')} x {rank.get('accum_steps')} "
                     f"= {rank.get('samples')} samples/step, median compute "
                     + (f"{median:.3f} s" if median is not None else "n/a"))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hetseq_hpc.report RUN_DIR [--out FILE]``; exit 0, or 1 with a one-line error."""
    parser = argparse.ArgumentParser(prog="python -m hetseq_hpc.report",
                                     description="Plot per-rank step times of a run.")
    parser.add_argument("run_dir", help="run directory with metrics.jsonl")
    parser.add_argument("--out", help="PNG to write (default RUN_DIR/ranks.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except HetseqError as exc:
        print(f"hetseq-report: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
