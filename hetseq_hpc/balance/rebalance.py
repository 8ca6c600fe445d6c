"""Online re-balancing with the allocation's own cost model, refitted from measured step times,
that tells noise from a real speed change by the measurements' own uncertainty.

:class:`Rebalancer` decides every ``balance.rebalance_every`` steps (or at once when a rank is
clearly off its curve, :meth:`Rebalancer.speed_changed`) from the per-step timings every rank
holds, so all ranks take the same decision at the same step without another message. The
global batch and its exact semantics never change. How curves are refitted, how a move is
sized by a confidence bound and when it is taken: docs/design/allocation.md,
"Online re-balancing".
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
#: a move is sized by the one-sided confidence bound of the rates at this many standard errors
#: (about 98 % one-sided for a normal error): what the measurements support, not the point
#: estimate alone
CONFIDENCE_Z = 2.0
#: a move back toward the split the last move left needs this many times the evidence
REVERSAL_FACTOR = 2.0
#: a move further in the direction of the last one (a change still being caught up with) needs
#: this share of the evidence
CONTINUATION_FACTOR = 0.7
#: ... while that move is at most this many steps old (after that the split has settled)
REVERSAL_MEMORY_STEPS = 100
#: a window is measured over at least this much busy time; shorter steps are timed over more
#: steps (a 1 ms step is mostly timer and scheduler noise)
MIN_WINDOW_S = 0.25
#: after a move that stopped short, the next decision comes after this many measured steps
FOLLOW_UP_STEPS = 5
#: relative standard error assumed for a rank whose window has a single step
UNKNOWN_ERROR = 0.5
#: a speed change must be off the curve by this many times the rank's measured step-to-step
#: noise (:func:`successive_spread`), in each of :data:`RECENT_STEPS` steps: on a loaded host
#: the dead band widens with the noise, and a change far beyond it (2x) still counts
NOISE_K = 3.0


#: two-sided 95 % Student t quantiles over the normal one (1.96), for a window of n steps
#: (n - 1 degrees of freedom): a spread read from 2-5 steps is itself uncertain
_T_INFLATION = {2: 6.5, 3: 2.2, 4: 1.6, 5: 1.4}


def relative_spread(times_s: Sequence[float]) -> float:
    """Step-to-step relative spread (a sigma) of ``times_s``: ``1.4826 x MAD / median`` from 6
    steps on (robust to a stalled step), the standard deviation of ``log t`` below that
    (inflated by the Student t quantile: few steps understate a spread);
    :data:`UNKNOWN_ERROR` for fewer than two times."""
    times = [float(t) for t in times_s if t > 0]
    n = len(times)
    if n < 2:
        return UNKNOWN_ERROR
    if n >= 6:
        med = statistics.median(times)
        return 1.4826 * statistics.median(abs(t - med) for t in times) / med
    return statistics.stdev(math.log(t) for t in times) * _T_INFLATION.get(n, 1.0)


def successive_spread(times_s: Sequence[float]) -> float:
    """Step-to-step relative noise (a sigma) of ``times_s`` that a change of level does not
    inflate: ``1.4826 x median |log(t[i+1] / t[i])| / sqrt(2)`` (a shift from one speed to
    another is one large difference among many small ones); :func:`relative_spread` for
    fewer than 6 times."""
    times = [float(t) for t in times_s if t > 0]
    if len(times) < 6:
        return relative_spread(times)
    steps = [abs(math.log(b / a)) for a, b in itertools.pairwise(times)]
    return 1.4826 * statistics.median(steps) / math.sqrt(2.0)


def relative_error(times_s: Sequence[float], floor_sigma: float = 0.0) -> float:
    """Relative standard error of the median of ``times_s`` (``sqrt(pi/2) sigma / sqrt(n)``,
    the median's efficiency on normal noise), with sigma at least ``floor_sigma`` (the rank's
    spread seen over the run so far: three quiet steps do not prove a quiet device)."""
    n = len([t for t in times_s if t > 0])
    if n < 2:
        return UNKNOWN_ERROR
    sigma = max(relative_spread(times_s), floor_sigma)
    return 1.2533 * sigma / math.sqrt(n)


def _spread(designs: Sequence[Tuple[float, float]]) -> float:
    """Largest ``|k1 b2 - k2 b1| / (k1 b2 + k2 b1)`` over pairs of designs (0 = parallel)."""
    best = 0.0
    for i, (k1, b1) in enumerate(designs):
        for k2, b2 in designs[i + 1 :]:
            best = max(best, abs(k1 * b2 - k2 * b1) / (k1 * b2 + k2 * b1))
    return best


@dataclass
class Rebalancer:
    """Decides re-allocations from per-rank timings.

    Args:
        caps: per-rank micro-batch caps (from calibration), kept by every new allocation.
        threshold: relative model error that counts as a speed change, and twice the predicted
            gain a move needs (``balance.rebalance_threshold``).
        curves: per-rank cost curves from calibration (the prior); None = start from the first
            window's time per sample (``a = 0``).
    """

    caps: Sequence[int]
    threshold: float = 0.1
    curves: Optional[Sequence[CostCurve]] = None
    decisions: List[Dict[str, Any]] = field(default_factory=list)
    _window: List[List[StepStats]] = field(default_factory=list)
    _points: List[List[Tuple[int, int, float]]] = field(default_factory=list)
    _skip_rows: int = 0

    def __post_init__(self) -> None:
        self._curves: List[Optional[CostCurve]] = (
            list(self.curves) if self.curves is not None else [None] * len(self.caps)
        )
        self._points = [[] for _ in self.caps]
        self._errors: List[float] = [UNKNOWN_ERROR] * len(self.caps)
        self._spread: List[float] = [0.0] * len(self.caps)  # each rank's step-to-step sigma
        self._last_move: Optional[Tuple[List[int], List[int]]] = None
        self._last_move_step = 0
        self._follow_up = False  # the last move stopped short of the point estimate

    @property
    def fitted(self) -> List[Optional[CostCurve]]:
        """The current per-rank curves (None before the first window without a prior)."""
        return list(self._curves)

    def record(self, per_rank: List[StepStats]) -> None:
        """Add one step's table (its ``samples``, ``compute_time_s`` and ``tail_time_s``)."""
        self._window.append(per_rank)

    def _note_error(
        self, rank: int, rows: List[StepStats], used: Optional[List[StepStats]] = None
    ) -> None:
        """Update rank ``rank``'s run-long spread from a window's ``rows`` (the larger of the
        old value and this window's, decaying slowly), and the relative error of the
        measurement taken from ``used`` (default all ``rows``)."""
        times_s = [row.compute_time_s for row in rows]
        spread = successive_spread(times_s) if len(rows) >= 6 else 0.0
        self._spread[rank] = max(spread, 0.9 * self._spread[rank])
        times = [row.compute_time_s for row in (rows if used is None else used)]
        self._errors[rank] = relative_error(times, self._spread[rank])

    def _changed(self, rank: int, accum: int, rows: List[StepStats]) -> bool:
        """Whether every one of rank ``rank``'s last :data:`RECENT_STEPS` steps in ``rows`` is
        off its curve by more than ``threshold`` in the same direction (a speed change, not a
        noisy step or two)."""
        prior = self._curves[rank]
        late = rows[-RECENT_STEPS:]
        if prior is None or len(late) < RECENT_STEPS:
            return False
        ratios = [row.compute_time_s / prior.compute_s(row.samples, accum) for row in late]
        return self._off(rank, ratios, self.threshold)

    def _off(self, rank: int, ratios: Sequence[float], least: float) -> bool:
        """Whether ``ratios`` (measured / predicted, the latest steps) show a speed change:
        every one off by more than ``least`` in the same direction, and their median by more
        than :meth:`band` (a change must persist and stand out of the rank's noise)."""
        band = self.band(rank, least)
        mid = statistics.median(ratios)
        slower = min(ratios) > 1.0 + least and mid > 1.0 + band
        return slower or (max(ratios) < 1.0 - least and mid < 1.0 - min(band, 0.9))

    def band(self, rank: int, least: float) -> float:
        """Relative dead band of rank ``rank``: ``least``, widened to :data:`NOISE_K` times
        the rank's step-to-step noise seen over the run (a loaded host's spread is not a
        speed change)."""
        return max(least, NOISE_K * self._spread[rank])

    def _refit(self, rank: int, accum: int, rows: List[StepStats], changed: bool) -> CostCurve:
        """Rank ``rank``'s curve after a window of ``rows`` run as ``accum`` micro-batches.

        The window's measurement is the median compute time of all its steps; when some rank's
        speed changed (``changed``, :meth:`_changed` of any rank: the SAME steps for every
        rank, so a neighbour that slows all ranks alike moves no sample) it is the median of
        the last :data:`RECENT_STEPS` steps alone, and the older windows are forgotten."""
        samples = rows[0].samples
        recent = rows[-RECENT_STEPS:]  # a change inside the window shows in its last steps
        tail = statistics.median(getattr(row, "tail_time_s", 0.0) for row in rows)
        prior = self._curves[rank]
        if prior is None:
            measured = statistics.median(row.compute_time_s for row in rows)
            self._note_error(rank, rows)
            self._points[rank] = [(accum, samples, measured)]
            return CostCurve(0.0, measured / max(samples, 1), tail)
        ratios = [row.compute_time_s / prior.compute_s(row.samples, accum) for row in rows]
        late = ratios[-len(recent) :]
        changed = changed and len(recent) == RECENT_STEPS
        used = recent if changed else rows
        measured = statistics.median(row.compute_time_s for row in used)
        self._note_error(rank, rows, used)
        ratio = statistics.median(late if changed else ratios)
        points = (
            [] if changed else [p for p in self._points[rank] if (p[0], p[1]) != (accum, samples)]
        )
        points = [*points, (accum, samples, measured)][-MAX_POINTS:]
        self._points[rank] = points
        designs = [(k, b) for k, b, _ in points]
        if prior.host_s == 0 and len(points) >= 2 and _spread(designs) >= MIN_SPREAD:
            a, c = fit_compute(designs, [t for _, _, t in points])
            return CostCurve(a, c, tail)
        return prior.scaled(ratio).with_step_fixed(tail)

    def _supported_move(
        self, curves: List[CostCurve], current: List[int], best: List[int], step: int
    ) -> Tuple[List[int], bool, float]:
        """The split the measurements support with confidence, whether the move reverses the
        last one, and the gain of that split at the unfavourable end of the intervals.

        Each rank's curve is moved to the unfavourable end of its confidence interval
        (:data:`CONFIDENCE_Z` standard errors of its window's median, :func:`relative_error`;
        :data:`REVERSAL_FACTOR` times that for a move back toward the split the last move
        left, within :data:`REVERSAL_MEMORY_STEPS`): a rank that would gain samples is taken as slower, one that would lose samples
        as faster. The min-max split of those curves is the move the evidence supports: the
        point estimate's move when the window is steady, a smaller one (or none) when it is
        noisy, so no rank's share drops below what its curve supports with confidence."""
        direction = [b - c for b, c in zip(best, current)]
        last = self._last_move
        recent = last is not None and step - self._last_move_step <= REVERSAL_MEMORY_STEPS
        agreement = (
            sum(d * (to - frm) for d, frm, to in zip(direction, *last))
            if recent and last is not None
            else 0
        )
        reversal = agreement < 0
        # the split follows the RATIO of the moving ranks' rates, whose relative error is the
        # root sum of squares of theirs: each moves by its share of that bound
        moving = sum(1 for d in direction if d) or 1
        factor = REVERSAL_FACTOR if reversal else CONTINUATION_FACTOR if agreement > 0 else 1.0
        z = CONFIDENCE_Z * factor / math.sqrt(moving)
        cautious = [
            curve.scaled(1.0 + z * err)
            if d > 0
            else curve.scaled(max(1.0 - z * err, 0.1))
            if d < 0
            else curve
            for curve, err, d in zip(curves, self._errors, direction)
        ]
        target = min_max_split(cautious, sum(current), list(self.caps))
        if any(
            (t - c) * d < 0 or (d == 0 and t != c) for t, c, d in zip(target, current, direction)
        ):
            return current, reversal, 0.0  # the cautious optimum points elsewhere: no move
        now = predicted_step_s(cautious, current, self.caps)
        then = predicted_step_s(cautious, target, self.caps)
        return target, reversal, (now - then) / now if now > 0 else 0.0

    def due(self, step: int, every: int, allocation: Allocation) -> bool:
        """Whether to decide after ``step``: every ``every`` steps; at once on a speed change
        (:meth:`speed_changed`); and, after a move that stopped short of the point estimate
        (the evidence then supported only part of it), as soon as the new split has run
        :data:`FOLLOW_UP_STEPS` measured steps. A pure function of the recorded tables: every
        rank gets the same answer."""
        if step % every == 0 or self.speed_changed(allocation):
            return True
        return self._follow_up and len(self._window) - self._skip_rows >= FOLLOW_UP_STEPS

    def speed_changed(self, allocation: Allocation) -> bool:
        """True when some rank's last :data:`RECENT_STEPS` recorded steps of ``allocation``
        (after the switch to it) all ran more than ``URGENT_FACTOR x threshold`` slower, or all
        faster, than its current curve predicts, and their median beyond :data:`NOISE_K` times
        the rank's noise (:meth:`band`): decide now, not at the next interval. False
        before every rank has a curve. Pure function of the recorded tables."""
        window = self._window[self._skip_rows :]
        if len(window) < RECENT_STEPS or any(c is None for c in self._curves):
            return False
        for rank, share in enumerate(allocation.shares):
            rows = [row[rank] for row in window[-RECENT_STEPS:]]
            if any(row.samples != share.samples for row in rows):
                continue
            curve = self._curves[rank]
            if curve is None:  # not reached: every rank has a curve here
                return False
            predicted = curve.compute_s(share.samples, share.accum_steps)
            ratios = [row.compute_time_s / predicted for row in rows]
            if self._off(rank, ratios, URGENT_FACTOR * self.threshold):
                return True
        return False

    def observe(
        self, step: int, allocation: Allocation, per_rank: Optional[List[StepStats]] = None
    ) -> Optional[Allocation]:
        """Decide after ``step``; returns the allocation for step ``step + 1`` if it changes.

        ``per_rank`` (this step's table) is recorded first when given. A window of fewer than
        :data:`RECENT_STEPS` steps (since the last decision, the first step after a switch not
        counted) decides nothing and is kept for the next call.
        """
        if per_rank is not None:
            self.record(per_rank)
        if len(self._window) - self._skip_rows < RECENT_STEPS:
            # an interval that falls one or two steps after an early decision: the median of
            # so few steps is one noisy step; the window keeps filling until the next interval
            return None
        pending = self._window[self._skip_rows :]
        if (
            not self.speed_changed(allocation)
            and sum(
                max(r.compute_time_s + getattr(r, "tail_time_s", 0.0) for r in row)
                for row in pending
            )
            < MIN_WINDOW_S
        ):
            return None  # steps too short to time: measure over more of them
        window, self._window = pending, []
        self._follow_up = False
        self._skip_rows = 0
        shares = allocation.shares
        mine = [
            [row[rank] for row in window if row[rank].samples == share.samples]
            for rank, share in enumerate(shares)
        ]
        changed = any(
            rows and self._changed(rank, shares[rank].accum_steps, rows)
            for rank, rows in enumerate(mine)
        )
        for rank, rows in enumerate(mine):
            if rows:
                self._curves[rank] = self._refit(rank, shares[rank].accum_steps, rows, changed)
        curves = [c for c in self._curves if c is not None]
        if len(curves) < len(self._curves):
            return None
        busy = [
            statistics.median(
                row[r].compute_time_s + getattr(row[r], "tail_time_s", 0.0) for row in window
            )
            for r in range(len(shares))
        ]
        mean = sum(busy) / len(busy)
        straggle = (max(busy) - min(busy)) / mean if mean > 0 else 0.0
        current = list(allocation.samples)
        best = min_max_split(curves, allocation.global_batch_size, list(self.caps))
        if best == current:
            return None
        now = predicted_step_s(curves, current, self.caps)
        gain = (now - predicted_step_s(curves, best, self.caps)) / now if now > 0 else 0.0
        if gain < self.threshold / 4:  # noise: not even worth a record
            return None
        target, reversal, supported_gain = self._supported_move(curves, current, best, step)
        taken = target != current and supported_gain >= self.threshold / 4
        self.decisions.append(
            {
                "step": step,
                "straggle": straggle,
                "gain": gain,
                "from": current,
                "to": target if taken else best,
                "best": best,
                "supported_gain": supported_gain,
                "reversal": reversal,
                "errors": [round(e, 4) for e in self._errors],
                "taken": taken,
            }
        )
        if not taken:
            return None
        self._follow_up = target != best  # more steps will narrow the interval: look again soon
        best = target
        self._last_move, self._last_move_step = (current, list(best)), step
        self._skip_rows = 1
        return allocate(
            [c.samples_per_s(cap) for c, cap in zip(curves, self.caps)],
            allocation.global_batch_size,
            list(self.caps),
            forced=best,
            source="rebalanced",
            step=step + 1,
            curves=curves,
        )
