"""The run's picture as a matplotlib Figure, from ``metrics.jsonl`` step rows
(:func:`hetseq_hpc.report.plots.step_rows`), so tests can look at its axes.

Four panels over the optimizer step, sharing the step axis:

1. **loss**: training loss per step, validation loss where it was measured;
2. **throughput**: samples per second of the whole job;
3. **share of the global batch**: each rank's samples / the global batch;
4. **step time per rank**: each rank's compute time per step.

Every re-allocation is a dotted vertical line on every panel (on the share panel only when
there are more than :data:`MANY_MOVES`), numbered at the top of the share panel (numbers too
close to the previous one are left out; the legend's title says how many). A
few slow steps do not squash a panel: its y-axis ends above the largest point that is not a
spike (a point far above its neighbours in its own series; a slow level that lasts is kept),
and the clipped points sit on the top edge as triangles, counted in the panel's corner (no
count when nothing is clipped). Resumes and stops are lines on every panel; they and the
checkpoints are markers on the loss panel (:data:`EVENT_STYLES`). A rank whose share equals a
lower rank's is dashed and marked, its legend entry naming that rank. Legends: on the right.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

#: panel titles, top to bottom (tests look for them)
TITLES = ("loss", "throughput", "share of the global batch", "step time per rank")
#: a point more than SPIKE_FACTOR x the median of its neighbours (SPIKE_WINDOW each side, in
#: its own series) is a spike: it does not set the panel's y-limit
SPIKE_FACTOR = 3.0
SPIKE_WINDOW = 3
#: more re-allocations than this: their lines only on the share panel
MANY_MOVES = 20
#: more ranks than this: one colour and one legend entry per partition
MANY_RANKS = 12
#: a rank whose share equals that of n lower ranks (at some steps) is drawn with the n-th
#: style and marker
OVERLAP_STYLES = ("--", ":", "-.")
OVERLAP_MARKERS = ("o", "s", "^", "D")
#: run events (:mod:`hetseq_hpc.rundir.events`) on the plot: kind -> (legend label, colour,
#: vertical line style on every panel or None, marker on the loss panel, its height there as
#: a fraction of the panel)
EVENT_STYLES = {
    "resume": ("resumed from a checkpoint", "C4", "-", ">", 0.90),
    "stop": ("stopped (Ctrl-C, SIGTERM, preemption)", "k", "-.", "X", 0.95),
    "checkpoint": ("checkpoint", "0.4", None, "v", 1.0),
}


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _spikes(series: Sequence[float]) -> List[bool]:
    """For each point: is it a spike (:data:`SPIKE_FACTOR` x its neighbours' median)? A level
    that lasts several steps (a slow rank before re-balancing) is no spike."""
    flags = []
    for i, value in enumerate(series):
        window = sorted(
            v for v in series[max(0, i - SPIKE_WINDOW) : i + SPIKE_WINDOW + 1] if v == v
        )
        median = window[len(window) // 2] if window else math.nan
        flags.append(value == value and median > 0 and value > SPIKE_FACTOR * median)
    return flags


def robust_top(series: Sequence[Sequence[float]]) -> Optional[float]:
    """The y-limit that keeps a few slow steps from squashing a panel: 1.15 x the largest
    point that is not a spike (:func:`_spikes`), or None when there is no spike."""
    kept, spiked = [], False
    for values in series:
        for value, spike in zip(values, _spikes(values)):
            spiked = spiked or spike
            if value == value and not spike:
                kept.append(value)
    return 1.15 * max(kept) if spiked and kept and max(kept) > 0 else None


def _clip(ax, xs: List[List[float]], ys: List[List[float]], colours: List[str]) -> None:
    """Apply :func:`robust_top` to a panel; mark and count what it cuts off."""
    values = [v for series in ys for v in series]
    top = robust_top(ys)
    if top is None:
        peak = max((v for v in values if v == v), default=0.0)
        ax.set_ylim(0, 1.1 * peak if peak > 0 else 1.0)
        return
    ax.set_ylim(0, top)
    hidden = 0
    for x, y, colour in zip(xs, ys, colours):
        cut = [(a, b) for a, b in zip(x, y) if b == b and b > top]
        hidden += len(cut)
        if cut:
            ax.plot(
                [a for a, _ in cut],
                [top] * len(cut),
                ls="none",
                marker="^",
                ms=5,
                color=colour,
                clip_on=False,
            )
    if not hidden:  # the spikes fit under the top: nothing to count
        return
    ax.text(
        0.99,
        0.97,
        f"{hidden} point(s) above {top:.3g} not shown to scale (^)",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=7,
        color="0.3",
        bbox={"fc": "white", "ec": "none", "alpha": 0.7},
    )


def rank_label(rank: dict) -> str:
    where = rank.get("partition") or rank.get("device") or ""
    if rank.get("partition") and rank.get("device"):
        where = f"{rank['partition']}, {rank['device']}"
    return f"rank {rank['rank']} ({where})" if where else f"rank {rank['rank']}"


def _series(rows: List[dict]) -> Dict[int, Dict[str, list]]:
    series: Dict[int, Dict[str, list]] = {}
    for row in rows:
        total = sum(_num(r.get("samples")) for r in row["ranks"])
        for rank in row["ranks"]:
            s = series.setdefault(
                int(rank["rank"]),
                {
                    "step": [],
                    "time": [],
                    "share": [],
                    "label": rank_label(rank),
                    "group": str(rank.get("partition") or "ranks"),
                },
            )
            s["step"].append(row["step"])
            time_s = rank.get("compute_time_s", rank.get("step_time_s"))
            s["time"].append(_num(time_s))
            s["share"].append(_num(rank.get("samples")) / total if total > 0 else math.nan)
    return series


def _mark_moves(axes, share_ax, moves: List[dict], first: float, last: float) -> None:
    """Dotted lines on every panel; numbers on the share panel, skipping crowded ones."""
    span = max(last - first, 1.0)
    previous = -math.inf
    lined = axes if len(moves) <= MANY_MOVES else [share_ax]  # else the lines hide the data
    for number, move in enumerate(moves, 1):
        at = move["at_step"]
        for ax in lined:
            ax.axvline(
                at,
                color="0.35",
                ls=":",
                lw=0.9,
                label="re-allocation" if ax is share_ax and number == 1 else None,
            )
        if at - previous >= 0.03 * span:
            share_ax.annotate(
                str(number),
                (at, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -2),
                textcoords="offset points",
                ha="left",
                va="top",
                fontsize=7,
                color="0.25",
                bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 0.5},
            )
            previous = at


def _overlaps(series: Dict[int, Dict[str, list]]) -> Dict[int, List[Tuple[int, int]]]:
    """For each rank: ``(lower rank, steps)`` for every lower rank whose share equals its own
    at ``steps`` > 0 of the logged steps (its line would hide that one there)."""
    shares = {r: dict(zip(s["step"], s["share"])) for r, s in series.items()}
    out: Dict[int, List[Tuple[int, int]]] = {}
    for rank in sorted(series):
        out[rank] = []
        for lower in sorted(r for r in series if r < rank):
            same = sum(
                1 for step, v in shares[rank].items() if v == v and shares[lower].get(step) == v
            )
            if same:
                out[rank].append((lower, same))
    return out


def _overlap_note(series: Dict[str, list], overlaps: List[Tuple[int, int]]) -> str:
    """`` (same share as rank 0)``, or ``... at 20 of 40 steps`` where they part."""
    logged = sum(1 for v in series["share"] if v == v)
    parts = [
        f"rank {r}" + ("" if same == logged else f" at {same} of {logged} steps")
        for r, same in overlaps
    ]
    return f" (same share as {', '.join(parts)})"


def _mark_events(axes, loss_ax, marks: Sequence[Tuple[str, int]]) -> None:
    """Each run event of :data:`EVENT_STYLES`: a vertical line on every panel (resumes,
    stops) and a marker on the loss panel's top edge, one legend entry per kind."""
    for kind, (label, colour, style, marker, height) in EVENT_STYLES.items():
        at = sorted({step for k, step in marks if k == kind})
        if not at:
            continue
        if style is not None:
            for ax in axes:
                for step in at:
                    ax.axvline(step, color=colour, ls=style, lw=1.3, alpha=0.85, zorder=3)
        loss_ax.plot(
            at,
            [height] * len(at),
            ls="none",
            marker=marker,
            ms=7,
            color=colour,
            transform=loss_ax.get_xaxis_transform(),
            clip_on=False,
            zorder=4,
            label=f"{label} ({len(at)})" if kind == "checkpoint" else label,
        )


def build_figure(
    rows: List[dict],
    title: str = "",
    lost_at: Sequence[int] = (),
    marks: Sequence[Tuple[str, int]] = (),
    joined_at: Sequence[int] = (),
):
    """The four-panel Figure (:data:`TITLES`) of checked step rows, with a dashed red line at
    each step in ``lost_at`` (a rank lost and the run gone on without it), a dash-dotted
    green one at each step in ``joined_at`` (a replacement rank joined) and the run's
    events ``marks`` (``(kind, step)``, kinds of :data:`EVENT_STYLES`: resumes and stops as
    lines on every panel, all as markers on the loss panel, in its legend). A rank whose share
    equals a lower rank's (at some or all steps) is drawn dashed or dotted with markers, and
    its legend entry names the rank(s) it overlaps and at how many steps. The caller saves and closes the Figure. Needs
    matplotlib with a non-interactive backend selected."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = _series(rows)
    steps = [row["step"] for row in rows]
    moves = [
        r["reallocation"]
        for r in rows
        if isinstance(r.get("reallocation"), dict) and r["reallocation"].get("at_step") is not None
    ]
    fig, axes = plt.subplots(
        4, 1, sharex=True, figsize=(11, 10), gridspec_kw={"height_ratios": [3, 2, 2.5, 2.5]}
    )
    loss_ax, speed_ax, share_ax, time_ax = axes
    for ax, name in zip(axes, TITLES):
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(alpha=0.3)

    loss_ax.plot(
        steps, [_num(r.get("loss")) for r in rows], lw=1.2, color="C0", label="training loss"
    )
    val = [(r["step"], _num(r["val_loss"])) for r in rows if r.get("val_loss") is not None]
    if val:
        loss_ax.plot(
            [s for s, _ in val],
            [v for _, v in val],
            "o-",
            ms=4,
            lw=1.2,
            color="C3",
            label="validation loss",
        )
    loss_ax.set_ylabel("loss")

    speed = [_num(r.get("samples_per_s")) for r in rows]
    speed_ax.plot(steps, speed, lw=1.0, color="C2", label="samples/s")
    _clip(speed_ax, [steps], [speed], ["C2"])
    speed_ax.set_ylabel("samples/s")

    many = len(series) > MANY_RANKS
    overlaps = {} if many else _overlaps(series)
    colours: Dict[str, str] = {}
    used: List[str] = []
    for i, rank in enumerate(sorted(series)):
        s = series[rank]
        label, colour, alpha = s["label"], f"C{i % 10}", 1.0
        style: Dict[str, object] = {"ls": "-"}
        if many:
            label = None if s["group"] in colours else s["group"]
            colour = colours.setdefault(s["group"], f"C{len(colours) % 10}")
            alpha = 0.5
        elif overlaps[rank]:  # drawn over a lower rank's line: dashed, marked, named
            n = len(overlaps[rank])
            style = {
                "ls": OVERLAP_STYLES[(n - 1) % len(OVERLAP_STYLES)],
                "marker": OVERLAP_MARKERS[(n - 1) % len(OVERLAP_MARKERS)],
                "markevery": max(1, len(s["step"]) // 12),
                "ms": 4,
            }
            label += _overlap_note(s, overlaps[rank])
        used.append(colour)
        share_ax.step(
            s["step"],
            s["share"],
            where="post",
            lw=1.4,
            color=colour,
            alpha=alpha,
            label=label,
            **style,
        )
        time_ax.plot(s["step"], s["time"], lw=1.0, color=colour, alpha=alpha, label=label, **style)
    share_ax.set_ylim(0, 1)
    share_ax.set_ylabel("share")
    ordered = [series[r] for r in sorted(series)]
    _clip(time_ax, [s["step"] for s in ordered], [s["time"] for s in ordered], used)
    time_ax.set_ylabel("compute s/step")
    time_ax.set_xlabel("optimizer step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _mark_moves(axes, share_ax, moves, min(steps), max(steps))
    for number, at in enumerate(lost_at):
        for ax in axes:
            ax.axvline(
                at,
                color="C3",
                ls="--",
                lw=1.0,
                label="lost rank(s)" if ax is loss_ax and number == 0 else None,
            )
    for number, at in enumerate(joined_at):
        for ax in axes:
            ax.axvline(
                at,
                color="C2",
                ls="-.",
                lw=1.0,
                label="rank(s) joined" if ax is loss_ax and number == 0 else None,
            )
    _mark_events(axes, loss_ax, marks)

    for ax in (loss_ax, share_ax):
        if ax.get_legend_handles_labels()[0]:
            label_moves = ax is share_ax and moves
            ax.legend(
                fontsize=8,
                loc="upper left",
                bbox_to_anchor=(1.01, 1.0),
                frameon=False,
                title=f"{len(moves)} re-allocation(s)" if label_moves else None,
                title_fontsize=8,
            )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


__all__ = [
    "EVENT_STYLES",
    "SPIKE_FACTOR",
    "SPIKE_WINDOW",
    "TITLES",
    "build_figure",
    "rank_label",
    "robust_top",
]
