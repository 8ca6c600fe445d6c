"""Time to result: which mix of the configured partitions finishes first (``plan.when``).

:func:`candidate_mixes` lists the mixes, :func:`predict_mix` plans each and predicts its run
time (start-up + steps x step + checkpoints), Slurm's ``sbatch --test-only`` (passed in by the
caller: the planner never imports a launcher) says when it would start, and :func:`rank_mixes`
returns the :class:`WhenTable` sorted by expected finish, whose :meth:`WhenTable.pick` is what
``cluster.choose`` submits. Rendering: :mod:`hetseq_hpc.plan.when_table`. The formula and why
the time limit asked is the mix's own: docs/design/planner.md, "Time to result".
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.errors import ConfigError, HetseqError

#: checkpoint bytes per parameter: the fp32 weights (4) and AdamW's two fp32 moments
#: ``exp_avg``/``exp_avg_sq`` (8) (torch.optim.AdamW's state)
CHECKPOINT_BYTES_PER_PARAM = 12
#: ``sbatch --test-only`` asks for the predicted run time plus this share of it ...
TIME_MARGIN = 0.25
#: ... and at least this many seconds more (the spec model's held-out errors reach tens of
#: per cent, docs/planner-accuracy.md; start-up on a cold node varies by minutes)
TIME_MARGIN_MIN_S = 300.0


def asked_time_min(run_s: float, limit_min: int) -> int:
    """The time limit, minutes, a mix is asked about with ``sbatch --test-only``:
    ``ceil((run_s + max(TIME_MARGIN x run_s, TIME_MARGIN_MIN_S)) / 60)``, at least 1 and at
    most ``limit_min`` (``cluster.timeout_min``, which the job is submitted with).

    Slurm's backfill scheduler starts a job early only where its time limit fits before the
    next reserved start (https://slurm.schedmd.com/sched_config.html#OPT_bf_window, "backfill"),
    so the limit asked about decides the estimate.
    """
    wanted = run_s + max(TIME_MARGIN * run_s, TIME_MARGIN_MIN_S)
    return int(max(1, min(int(limit_min), math.ceil(wanted / 60.0))))


@dataclass(frozen=True)
class StartEstimate:
    """When Slurm expects a job to start, from ``sbatch --test-only``.

    Attributes:
        start_epoch: expected start, seconds since the epoch; None when Slurm gave no time.
        detail: what Slurm said (nodes, processors), or why there is no estimate.
        refused: sbatch refused the job (it cannot run as asked): not a candidate.
    """

    start_epoch: Optional[float]
    detail: str
    refused: bool = False


@dataclass
class MixRow:
    """One candidate mix and its predicted time to result. Times in seconds."""

    mix: Dict[str, int]  # partition key -> nodes, in het-component order
    ranks: int = 0
    gpus: int = 0  # GPUs the job holds (CPU-only partitions: one per rank)
    steps: int = 0
    step_s: float = 0.0  # predicted step time (balanced split)
    startup_s: float = 0.0
    checkpoint_s: float = 0.0
    over_limit: bool = False  # the predicted run is longer than cluster.timeout_min: not picked
    asked_min: int = 0  # time limit (minutes) sbatch --test-only was asked with (asked_time_min)
    problem: str = ""  # why it cannot run (the planner or sbatch refused it); '' = it can
    start: Optional[StartEstimate] = None

    @property
    def label(self) -> str:
        """``a100:1+v100:2`` (partition key:nodes, in het-component order)."""
        return "+".join(f"{k}:{n}" for k, n in self.mix.items())

    @property
    def run_s(self) -> float:
        """Predicted run time: start-up + steps x step time + checkpoint writes."""
        return self.startup_s + self.steps * self.step_s + self.checkpoint_s

    @property
    def gpu_hours(self) -> float:
        """GPUs held x predicted run time, in hours."""
        return self.gpus * self.run_s / 3600.0

    @property
    def start_epoch(self) -> Optional[float]:
        """Slurm's expected start (epoch seconds), or None."""
        return None if self.start is None else self.start.start_epoch

    @property
    def finish_epoch(self) -> Optional[float]:
        """Expected start + predicted run time (epoch seconds); None without a start estimate."""
        start = self.start_epoch
        return None if start is None or self.problem else start + self.run_s


@dataclass
class WhenTable:
    """The candidate mixes of one run, sorted by expected finish (:func:`rank_mixes`)."""

    rows: List[MixRow]
    now: float  # epoch seconds when Slurm was asked
    note: str  # how the mixes were enumerated (and thinned)
    source: str = ""  # where the throughputs came from (the planner's source line)
    #: partition key -> why it cannot run; in no mix (``plan --when`` only: ``cluster.choose``
    #: refuses such a cluster)
    left_out: Dict[str, str] = field(default_factory=dict)

    @property
    def estimated(self) -> List[MixRow]:
        """Rows that can run and have a start estimate, by expected finish."""
        return [r for r in self.rows if not r.problem and r.finish_epoch is not None]

    def pick(self, choose: str) -> MixRow:
        """The row ``cluster.choose`` names: ``finish_first`` = earliest expected finish
        (GPU-hours break ties); ``cheapest`` = fewest GPU-hours among the mixes that can run
        (expected finish breaks ties; a mix without an estimate sorts last there).

        A mix predicted to run longer than ``cluster.timeout_min`` is never picked (it would
        hit the limit and wait in the queue again for its requeue).

        Raises:
            ConfigError: no mix can run, every one runs past ``cluster.timeout_min``, or
                (finish_first) Slurm gave no start estimate for any.
        """
        runnable = [r for r in self.rows if not r.problem]
        if not runnable:
            first = self.rows[0].problem if self.rows else "no mixes"
            raise ConfigError(
                f"cluster.choose={choose}: no mix of the partitions can run (first: "
                f"{first}): fix that, or set cluster.choose=none"
            )
        fits = [r for r in runnable if not r.over_limit]
        if not fits:
            short = min(runnable, key=lambda r: r.run_s)
            raise ConfigError(
                f"cluster.choose={choose}: every mix is predicted to run longer than "
                f"cluster.timeout_min (the shortest, {short.label}, {short.run_s / 60:.0f} min): "
                "raise cluster.timeout_min, lower trainer.max_steps, or set cluster.choose=none"
            )
        runnable = fits
        if choose == "cheapest":
            return min(
                runnable,
                key=lambda r: (
                    round(r.gpu_hours, 9),
                    r.finish_epoch is None,
                    r.finish_epoch or 0.0,
                ),
            )
        if choose != "finish_first":
            raise ConfigError(f"cluster.choose={choose!r} is unknown: use finish_first or cheapest")
        estimated = [r for r in self.estimated if not r.over_limit]
        if not estimated:
            raise ConfigError(
                "cluster.choose=finish_first: Slurm gave no start estimate for any mix "
                f"({runnable[0].start.detail if runnable[0].start else 'not asked'}): ask the "
                "admins for SchedulerType=sched/backfill, or use cluster.choose=cheapest or none"
            )
        return min(estimated, key=lambda r: (r.finish_epoch, r.gpu_hours))


# ------------------------------------------------------------------------------ the mixes
def _thin(nodes: int, level: int) -> List[int]:
    """Node counts tried for a partition of ``nodes`` nodes: level 0 all of 1..nodes; 1 powers
    of two and ``nodes``; 2 half and all; 3 all only."""
    if level == 0:
        return list(range(1, nodes + 1))
    if level == 1:
        return sorted({2**i for i in range(nodes.bit_length()) if 2**i <= nodes} | {nodes})
    if level == 2:
        return sorted({max(1, nodes // 2), nodes})
    return [nodes]


_LEVELS = (
    "every node count",
    "node counts thinned to powers of two and the configured count",
    "node counts thinned to half and all of the configured count",
    "each partition in or out at its configured node count",
)


def candidate_mixes(partitions: Dict[str, int], max_mixes: int) -> Tuple[List[Dict[str, int]], str]:
    """Mixes of ``partitions`` (key -> configured nodes): each partition out or in with a node
    count from 1 up to its configured one, at least one partition in. Above ``max_mixes`` the
    node counts are thinned (powers of two, then half/all, then in/out only) and, if still too
    many, the mixes with the most nodes are kept.

    Returns:
        ``(mixes, note)``: mixes in het-component order (largest first), and one line saying
        how many of how many possible mixes are listed and how they were thinned.
    """
    keys = list(partitions)
    possible = math.prod(n + 1 for n in partitions.values()) - 1
    for level in range(len(_LEVELS)):
        choices = [[0, *_thin(partitions[k], level)] for k in keys]
        count = math.prod(len(c) for c in choices) - 1
        if count <= max_mixes:
            break
    how = _LEVELS[level]
    mixes = [
        {k: n for k, n in zip(keys, combo) if n}
        for combo in itertools.product(*choices)
        if any(combo)
    ]
    mixes.sort(key=lambda m: (-sum(m.values()), [-m.get(k, 0) for k in keys]))
    cut = len(mixes) > max_mixes
    mixes = mixes[:max_mixes]
    note = f"{len(mixes)} of {possible} possible mix(es): {how}"
    if cut:
        note += f", then the {max_mixes} with the most nodes"
    if len(mixes) < possible:
        note += f" (plan.max_mixes={max_mixes}; raise it to see more)"
    return mixes, note


def restrict_run(run, mix: Dict[str, int]):
    """``run`` with its cluster restricted to ``mix`` (partition key -> nodes; the others left
    out), ``cluster.choose=none`` and the per-partition precision of the kept partitions only:
    the configuration the launcher submits when ``mix`` is chosen.

    Raises:
        ConfigError: a key of ``mix`` is not a configured partition, or the restricted run
            fails the cross-group checks (:func:`hetseq_hpc.config.validate_run_config`).
    """
    from hetseq_hpc.config import validate_run_config

    parts = run.cluster.partitions
    unknown = [k for k in mix if k not in parts]
    if unknown:
        raise ConfigError(
            f"mix names {', '.join(unknown)}, not a partition of the cluster: use "
            f"{', '.join(parts)}"
        )
    cluster = replace(
        run.cluster,
        choose="none",
        partitions={k: replace(p, nodes=int(mix[k])) for k, p in parts.items() if mix.get(k)},
    )
    precision = replace(
        run.precision,
        partitions={k: v for k, v in run.precision.partitions.items() if k in cluster.partitions},
    )
    restricted = replace(run, cluster=cluster, precision=precision)
    validate_run_config(restricted)
    return restricted


def predict_mix(run, mix: Dict[str, int]) -> Tuple[MixRow, object, str]:
    """Plan ``run`` restricted to ``mix`` and predict its run time (no start estimate yet).

    Returns:
        ``(row, restricted run, the planner's throughput source line)``; the row's ``problem``
        says why the mix cannot run (the restricted run is then None, the source '').
    """
    from hetseq_hpc.plan.planner import make_plan

    row = MixRow(
        mix=dict(mix), steps=int(run.trainer.max_steps), startup_s=float(run.plan.startup_s)
    )
    try:
        restricted = restrict_run(run, mix)
        plan = make_plan(restricted)
    except HetseqError as exc:
        row.problem = f"cannot run: {exc}"
        return row, None, ""
    cluster = restricted.cluster
    row.ranks = cluster.world_size
    row.gpus = sum(
        p.nodes * (p.gpus_per_node if p.gpu_type else p.ranks_per_node_effective)
        for p in cluster.partitions.values()
    )
    row.step_s = float(plan.prediction.balanced.step_s)
    every = int(run.trainer.checkpoint_every)
    writes = (row.steps // every if every else 0) + (0 if every and row.steps % every == 0 else 1)
    row.checkpoint_s = (
        writes
        * plan.model.param_count
        * CHECKPOINT_BYTES_PER_PARAM
        / (run.plan.checkpoint_gb_s * 1e9)
    )
    row.over_limit = row.run_s > cluster.timeout_min * 60
    return row, restricted, plan.source


def _order(row: MixRow) -> tuple:
    """Sort key: estimated finishes first (earliest first), then mixes without an estimate
    (shortest run first), then mixes predicted to run past ``cluster.timeout_min`` (never
    picked), then mixes that cannot run."""
    if row.problem:
        return (3, 0.0, 0.0, row.label)
    over = 2 if row.over_limit else 0
    if row.finish_epoch is None:
        return (over, 1, row.run_s, row.label)
    return (over, 0, row.finish_epoch, row.gpu_hours)


def check_when_cluster(run) -> None:
    """``plan.when`` and ``cluster.choose`` need a SLURM cluster with partitions.

    Raises:
        ConfigError: ``run.cluster`` is local (one line naming it and the fix).
    """
    if run.cluster.is_local or not getattr(run.cluster, "partitions", None):
        raise ConfigError(
            "plan.when compares mixes of SLURM partitions but this cluster is "
            f"{run.cluster.name!r}: pick a SLURM cluster, e.g. cluster=mixed"
        )


def rank_mixes(
    run,
    estimate_start: Callable[[object], StartEstimate],
    now: Optional[float] = None,
    mixes: Optional[Sequence[Dict[str, int]]] = None,
    left_out: Optional[Dict[str, str]] = None,
) -> Tuple[WhenTable, Dict[str, object]]:
    """Plan every candidate mix of ``run`` (a validated SLURM RunConfig), ask
    ``estimate_start(restricted cluster)`` when each would start, and sort by expected finish.

    Args:
        run: the RunConfig; ``run.plan`` holds ``startup_s``, ``checkpoint_gb_s``, ``max_mixes``.
        estimate_start: Slurm's start estimate for a cluster config (never submits); it is
            given the mix's cluster with ``timeout_min`` = :func:`asked_time_min` of the mix.
        now: epoch seconds of the question (default: now); a start before it counts as now.
        mixes: the mixes to rank (default :func:`candidate_mixes` of the configured partitions).
        left_out: partition key -> why it cannot run (``plan --when`` on a cluster where it
            does not exist or does not fit): no default mix includes it, and the table's note
            names it with the reason.

    Returns:
        ``(table, runs)``: the table, and label -> restricted RunConfig of each mix that can run.

    Raises:
        ConfigError: ``run`` is not a SLURM cluster.
    """
    check_when_cluster(run)
    left_out = dict(left_out or {})
    configured = {k: int(p.nodes) for k, p in run.cluster.partitions.items() if k not in left_out}
    note = f"{len(mixes)} given mix(es)" if mixes is not None else ""
    if mixes is None:
        mixes, note = candidate_mixes(configured, run.plan.max_mixes)
    for key, why in left_out.items():
        note += f"; left out partition {key}: {why}"
    rows: List[MixRow] = []
    runs: Dict[str, object] = {}
    planned = [predict_mix(run, mix) for mix in mixes]  # the model is measured once
    source = next((s for _, _, s in planned if s), "")
    asked = time.time() if now is None else now
    for row, restricted, _ in planned:
        if restricted is not None:
            row.asked_min = asked_time_min(row.run_s, restricted.cluster.timeout_min)
            start = estimate_start(replace(restricted.cluster, timeout_min=row.asked_min))
            if start.start_epoch is not None and start.start_epoch < asked:
                start = replace(start, start_epoch=asked)
            row.start = start
            if start.refused:
                row.problem = f"sbatch refused it: {start.detail}"
            else:
                runs[row.label] = restricted
        rows.append(row)
    rows.sort(key=_order)
    return WhenTable(rows, asked, note, source, left_out), runs
