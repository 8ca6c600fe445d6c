"""Online re-balancing with the allocation's own cost model, refitted from measured step times.

Every ``trainer.rebalance_interval`` steps (``trainer.rebalance_every``; by default 10 for a
measured split, never for a forced ``trainer.allocation``) all ranks hold the same table of
per-rank timings (the loop's per-step all-gather of
:class:`~hetseq_hpc.distributed.rendezvous.StepStats`), so every rank computes the same decision at the same
step without another message. For each rank, over the steps since the last decision (the first
step after a switch is left out: new shapes warm up; fewer than :data:`RECENT_STEPS` of them
decide nothing and keep accumulating):

* its cost curve (:class:`~hetseq_hpc.balance.curves.CostCurve`, the calibration's fit as a prior)
  is refitted from the measured forward+backward time of its micro-batches
  (``compute_time_s`` of ``accum`` micro-batches holding ``samples``, median over the window):
  when each of the window's last :data:`RECENT_STEPS` steps is off the prediction by more than
  ``threshold`` in the same direction the device changed speed (or the prior was wrong), and
  the curve is rescaled by their median ratio, forgetting older windows -- a change a few steps
  old is seen, one noisy step is not; otherwise the window's point joins the earlier ones and,
  once two splits different enough were seen, ``a`` and ``c`` are refitted by least squares
  (:func:`~hetseq_hpc.balance.curves.fit_compute`);
* its per-step fixed cost ``f`` is the median of its measured ``tail_time_s`` (optimizer step,
  clipping, logging: the local work between two steps);
* the global batch is re-split by :func:`~hetseq_hpc.balance.curves.min_max_split` and the split is
  taken only if it cuts the predicted step time by at least half of ``threshold`` (hysteresis).

Between two decisions, :meth:`Rebalancer.speed_changed` looks at every step: when each of some
rank's last :data:`RECENT_STEPS` steps (since the last switch) is off its curve by more than
:data:`URGENT_FACTOR` x ``threshold`` in the same direction, the decision is taken at once
instead of at the next interval (every rank sees the same table, so all decide at the same step).
A sudden speed change is therefore corrected a few steps after it, in one move to the
refitted optimum, not by moving a sample at a time (LBB, J. Supercomputing 2024, moves single
samples inside its dead band). The global batch, which samples form it and the loss
normalisation do not change, so the update is still exactly one step on the whole global batch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.balance.allocation import Allocation, allocate
from hetseq_hpc.balance.curves import CostCurve, fit_compute, min_max_split, predicted_step_s
from hetseq_hpc.distributed.rendezvous import StepStats

#: the latest steps of a window whose median compute time is the window's measurement
RECENT_STEPS = 3
#: a speed change decided between two intervals must be this many times ``threshold`` off
#: (three consecutive steps beyond twice the dead band are rare for noise, certain for a change)
URGENT_FACTOR = 2.0
#: design points (one per window) kept per rank for the two-parameter refit
MAX_POINTS = 4
#: two splits are "different enough" for a refit of a and c when their (micro-batches, samples)
#: vectors differ in direction by this share
MIN_SPREAD = 0.15


def _spread(designs: Sequence[Tuple[float, float]]) -> float:
    """Largest ``|k1 b2 - k2 b1| / (k1 b2 + k2 b1)`` over pairs of designs (0 = parallel)."""
    best = 0.0
    for i, (k1, b1) in enumerate(designs):
        for k2, b2 in designs[i + 1:]:
            best = max(best, abs(k1 * b2 - k2 * b1) / (k1 * b2 + k2 * b1))
    return best


@dataclass
class Rebalancer:
    """Decides re-allocations from per-rank timings.

    Args:
        caps: per-rank micro-batch caps (from calibration), kept by every new allocation.
        threshold: relative model error that counts as a speed change, and twice the predicted
            gain a move needs (``trainer.rebalance_threshold``).
        curves: per-rank cost curves from calibration (the prior); None = start from the first
            window's time per sample (``a = 0``).
    """

    caps: Sequence[int]
    threshold: float = 0.1
    curves: Optional[Sequence[CostCurve]] = None
    decisions: List[Dict[str, object]] = field(default_factory=list)
    _window: List[List[StepStats]] = field(default_factory=list)
    _points: List[List[Tuple[int, int, float]]] = field(default_factory=list)
    _skip_rows: int = 0

    def __post_init__(self) -> None:
        self._curves: List[Optional[CostCurve]] = (
            list(self.curves) if self.curves is not None else [None] * len(self.caps))
        self._points = [[] for _ in self.caps]

    @property
    def fitted(self) -> List[Optional[CostCurve]]:
        """The current per-rank curves (None before the first window without a prior)."""
        return list(self._curves)

    def record(self, per_rank: List[StepStats]) -> None:
        """Add one step's table (its ``samples``, ``compute_time_s`` and ``tail_time_s``)."""
        self._window.append(per_rank)

    def _refit(self, rank: int, accum: int, rows: List[StepStats]) -> CostCurve:
        """Rank ``rank``'s curve after a window of ``rows`` run as ``accum`` micro-batches.

        The window's measurement is the median compute time of all its steps; only when every
        one of its last :data:`RECENT_STEPS` steps is off the prior by more than ``threshold``
        in the same direction (a speed change, not a noisy step or two) is it the median of
        those steps alone, and the older windows are forgotten."""
        samples = rows[0].samples
        recent = rows[-RECENT_STEPS:]  # a change inside the window shows in its last steps
        tail = statistics.median(getattr(row, "tail_time_s", 0.0) for row in rows)
        prior = self._curves[rank]
        if prior is None:
            measured = statistics.median(row.compute_time_s for row in rows)
            self._points[rank] = [(accum, samples, measured)]
            return CostCurve(0.0, measured / max(samples, 1), tail)
        ratios = [row.compute_time_s / prior.compute_s(row.samples, accum) for row in rows]
        late = ratios[-len(recent):]
        changed = len(late) == RECENT_STEPS and (min(late) > 1.0 + self.threshold
                                                 or max(late) < 1.0 - self.threshold)
        used = recent if changed else rows
        measured = statistics.median(row.compute_time_s for row in used)
        ratio = statistics.median(late if changed else ratios)
        points = [] if changed else [p for p in self._points[rank]
                                     if (p[0], p[1]) != (accum, samples)]
        points = [*points, (accum, samples, measured)][-MAX_POINTS:]
        self._points[rank] = points
        designs = [(k, b) for k, b, _ in points]
        if len(points) >= 2 and _spread(designs) >= MIN_SPREAD:
            a, c = fit_compute(designs, [t for _, _, t in points])
            return CostCurve(a, c, tail)
        return prior.scaled(ratio).with_step_fixed(tail)

    def speed_changed(self, allocation: Allocation) -> bool:
        """True when some rank's last :data:`RECENT_STEPS` recorded steps of ``allocation``
        (after the switch to it) all ran more than ``URGENT_FACTOR x threshold`` slower, or all
        faster, than its current curve predicts: decide now, not at the next interval. False
        before every rank has a curve. Pure function of the recorded tables."""
        window = self._window[self._skip_rows:]
        if len(window) < RECENT_STEPS or any(c is None for c in self._curves):
            return False
        band = URGENT_FACTOR * self.threshold
        for rank, share in enumerate(allocation.shares):
            rows = [row[rank] for row in window[-RECENT_STEPS:]]
            if any(row.samples != share.samples for row in rows):
                continue
            predicted = self._curves[rank].compute_s(share.samples, share.accum_steps)
            ratios = [row.compute_time_s / predicted for row in rows]
            if min(ratios) > 1.0 + band or max(ratios) < 1.0 - band:
                return True
        return False

    def observe(self, step: int, allocation: Allocation,
                per_rank: Optional[List[StepStats]] = None) -> Optional[Allocation]:
        """Decide after ``step``; returns the allocation for step ``step + 1`` if it changes.

        ``per_rank`` (this step's table) is recorded first when given. A window of fewer than
        :data:`RECENT_STEPS` steps (since the last decision, the first step after a switch not
        counted) decides nothing and is kept for the next call.
        """
        if per_rank is not None:
            self.record(per_rank)
        if len(self._window) - self._skip_rows < RECENT_STEPS:
            # an interval that falls one or two steps after an early decision: the median of
            # so few steps is one noisy step (measured: a 291 ms outlier among ~190 ms steps
            # moved a good 25/7 split to 27/5); the window keeps filling until the next interval
            return None
        window, self._window = self._window[self._skip_rows:], []
        self._skip_rows = 0
        shares = allocation.shares
        for rank, share in enumerate(shares):
            rows = [row[rank] for row in window if row[rank].samples == share.samples]
            if rows:
                self._curves[rank] = self._refit(rank, share.accum_steps, rows)
        if any(c is None for c in self._curves):
            return None
        curves: List[CostCurve] = list(self._curves)
        busy = [statistics.median(row[r].compute_time_s + getattr(row[r], "tail_time_s", 0.0)
                                  for row in window) for r in range(len(shares))]
        mean = sum(busy) / len(busy)
        straggle = (max(busy) - min(busy)) / mean if mean > 0 else 0.0
        best = min_max_split(curves, allocation.global_batch_size, list(self.caps))
        if best == allocation.samples:
            return None
        now = predicted_step_s(curves, allocation.samples, self.caps)
        then = predicted_step_s(curves, best, self.caps)
        gain = (now - then) / now if now > 0 else 0.0
        if gain < self.threshold / 4:  # noise: not even worth a record
            return None
        taken = gain >= self.threshold / 2
        self.decisions.append({"step": step, "straggle": straggle, "gain": gain,
                               "from": allocation.samples, "to": best, "taken": taken})
        if not taken:
            return None
        self._skip_rows = 1
        return allocate([c.samples_per_s(cap) for c, cap in zip(curves, self.caps)],
                        allocation.global_batch_size, list(self.caps), forced=best,
                        source="rebalanced", step=step + 1, curves=curves)
