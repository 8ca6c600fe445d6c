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
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.balance.allocation import Allocation, RankShare, allocate
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
#: ... or its median over more steps by this many standard errors of such a median (a change
#: also cuts the steps a move is measured on, so it must not be found in noise)
CHANGE_K = 4.0
#: steps at one split (since the last switch, and since a detected change) a decision weighs:
#: a decision that moved nothing keeps its steps, so the evidence for a real change grows
#: until it is clear, even when each window alone is too noisy (a loaded host)
HISTORY_STEPS = 16
#: a rank's measured time per sample at a share at least as large as its current one is
#: remembered this many steps: no move hands it more on a curve faster than that
EVIDENCE_MEMORY_STEPS = 50
#: a rank that gains samples is taken at most this many times cheaper per sample than it was
#: measured (its fixed cost spread over more samples: at most one doubling of its share per
#: move when the fixed cost dominates, no limit when the per-sample cost does)
EXTRAPOLATION = 2.0
#: a measurement's error is taken as that of at most this many steps (a loaded host's noise
#: is not independent from step to step: longer histories are not surer in proportion)
ERROR_STEPS = 10
#: step-to-step changes per rank whose median is its run-long noise
NOISE_POOL = 100


#: two-sided 95 % Student t quantiles over the normal one (1.96), for a window of n steps
#: (n - 1 degrees of freedom): a spread read from 2-5 steps is itself uncertain
_T_INFLATION = {2: 6.5, 3: 2.2, 4: 1.6, 5: 1.4}
#: log ratios beyond this (a stalled step, e^1.5 = 4.5x) count as this in a change point's means
_CLIP_LOG = 1.5


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
        self._diffs: List[List[float]] = [[] for _ in self.caps]  # |log t[i+1] / t[i]|
        self._noise: List[float] = [0.0] * len(self.caps)  # their pooled sigma
        self._raw_diffs: List[List[float]] = [[] for _ in self.caps]  # the same of raw times
        self._raw_noise: List[float] = [0.0] * len(self.caps)
        self._last_move: Optional[Tuple[List[int], List[int]]] = None
        self._last_move_step = 0
        self._follow_up = False  # the last move stopped short of the point estimate
        self._held: List[List[StepStats]] = []  # steps at this split that moved nothing yet
        # per rank: (step, samples, measured compute seconds) of each window, newest last
        self._evidence: List[List[Tuple[int, int, float]]] = [[] for _ in self.caps]
        self._measured: List[Optional[Tuple[int, float]]] = [None] * len(self.caps)

    @property
    def fitted(self) -> List[Optional[CostCurve]]:
        """The current per-rank curves (None before the first window without a prior)."""
        return list(self._curves)

    def record(self, per_rank: List[StepStats]) -> None:
        """Add one step's table (its ``samples``, ``compute_time_s`` and ``tail_time_s``)."""
        self._window.append(per_rank)

    @staticmethod
    def _common_free(
        table: List[List[StepStats]], shares: Sequence[RankShare]
    ) -> List[List[float]]:
        """Each rank's compute times (seconds) over the steps of ``table`` run at ``shares``,
        each step divided by the ranks' common factor that step (the geometric mean over ranks
        of time / the rank's median): a load that slows every rank alike cancels, as it does
        in the split, and what is left is each rank's own noise."""
        rows = [
            row
            for row in table
            if all(r.samples == sh.samples and r.compute_time_s > 0 for r, sh in zip(row, shares))
        ]
        out: List[List[float]] = [[] for _ in shares]
        if not rows:
            return out
        med = [statistics.median(row[r].compute_time_s for row in rows) for r in range(len(out))]
        for row in rows:
            logs = [math.log(row[r].compute_time_s / med[r]) for r in range(len(out))]
            common = math.exp(statistics.fmean(logs)) if len(out) > 1 else 1.0
            for r, times in enumerate(out):
                times.append(row[r].compute_time_s / common)
        return out

    def _note_noise(self, window: List[List[StepStats]], shares: Sequence[RankShare]) -> None:
        """Add the step-to-step changes of a new ``window`` to each rank's pools of the last
        :data:`NOISE_POOL` and set its noises from them (:func:`successive_spread`'s estimate,
        pooled over the run): of its common-free times (:meth:`_common_free`; the floor of a
        measurement's error) and of its raw times (a change's standard error,
        :meth:`_change_steps`); and its dead band's spread (:meth:`band`): the larger of this
        window's estimate and 0.9 x the old one (a cautious upper estimate)."""
        free = self._common_free(window, shares)
        for rank, pool in enumerate(self._raw_diffs):
            steps = [row[rank] for row in window]
            for one, two in itertools.pairwise(steps):
                if one.samples == two.samples and one.compute_time_s > 0 < two.compute_time_s:
                    pool.append(abs(math.log(two.compute_time_s / one.compute_time_s)))
            del pool[:-NOISE_POOL]
            if len(pool) >= RECENT_STEPS:
                self._raw_noise[rank] = 1.4826 * statistics.median(pool) / math.sqrt(2.0)
        for rank, pool in enumerate(self._diffs):
            pool.extend(abs(math.log(b / a)) for a, b in itertools.pairwise(free[rank]))
            del pool[:-NOISE_POOL]
            if len(pool) >= RECENT_STEPS:
                self._noise[rank] = 1.4826 * statistics.median(pool) / math.sqrt(2.0)
            times = [row[rank].compute_time_s for row in window]
            spread = successive_spread(times) if len(times) >= 6 else 0.0
            self._spread[rank] = max(spread, 0.9 * self._spread[rank])

    def _note_errors(self, history: List[List[StepStats]], shares: Sequence[RankShare]) -> None:
        """Each rank's relative error over ``history`` in a split's terms: that of its
        common-free times (:func:`relative_error` of the last :data:`ERROR_STEPS`, its
        run-long noise the floor), times ``sqrt(n / (n - 1))`` for ``n`` ranks (a rank's share
        of the error of its ratio to the others)."""
        free = self._common_free(history, shares)
        n = len(free)
        inflate = math.sqrt(n / (n - 1)) if n > 1 else 1.0
        for rank, times in enumerate(free):
            recent = times[-ERROR_STEPS:]
            # the median of a few steps is not protected from a stall or two by a pooled sigma
            floor = self._noise[rank] * (
                _T_INFLATION.get(len(recent), 1.0) if len(recent) <= RECENT_STEPS else 1.0
            )
            self._errors[rank] = inflate * relative_error(recent, floor)

    def _change_steps(self, rank: int, accum: int, rows: List[StepStats]) -> int:
        """How many of rank ``rank``'s latest ``rows`` (the window since the last decision)
        ran at a changed speed; 0 for none (noise, or a step or two).

        A change of the last ``m`` steps (at least :data:`RECENT_STEPS`) needs each of the
        last :data:`RECENT_STEPS` off the curve by more than ``threshold`` in the same
        direction and the median ratio of the ``m`` beyond :meth:`band`, or beyond
        :data:`CHANGE_K` standard errors of a median of ``m`` steps (the rank's pooled noise
        of raw times, :meth:`_note_noise`) when that is less: a median of more steps is
        surer. Of those,
        the ``m`` that splits the window best: the largest ``|mean after - mean before| x
        sqrt(m n_b / (m + n_b))`` of the log ratios (clipped to +-:data:`_CLIP_LOG`;
        ``before`` = the curve when fewer than :data:`RECENT_STEPS` steps precede)."""
        prior = self._curves[rank]
        if prior is None or len(rows) < RECENT_STEPS:
            return 0
        ratios = [row.compute_time_s / prior.compute_s(row.samples, accum) for row in rows]
        logs = [min(max(math.log(max(r, 1e-12)), -_CLIP_LOG), _CLIP_LOG) for r in ratios]
        least, late = self.threshold, ratios[-RECENT_STEPS:]
        slower, faster = min(late) > 1.0 + least, max(late) < 1.0 - least
        if not (slower or faster):
            return 0
        best, steps = 0.0, 0
        for m in range(RECENT_STEPS, len(ratios) + 1):
            error = 1.2533 * self._raw_noise[rank] / math.sqrt(m)
            band = max(least, min(self.band(rank, least), CHANGE_K * error))
            mid = statistics.median(ratios[-m:])
            if not ((slower and mid > 1.0 + band) or (faster and mid < 1.0 - min(band, 0.9))):
                continue
            before = logs[:-m]
            if len(before) >= RECENT_STEPS:
                level, weight = statistics.fmean(before), m * len(before) / (m + len(before))
            else:
                level, weight = 0.0, float(m)
            score = abs(statistics.fmean(logs[-m:]) - level) * math.sqrt(weight)
            if score > best:
                best, steps = score, m
        return steps

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

        The measurement is the median compute time of ``rows`` (the latest
        :data:`HISTORY_STEPS` steps at this split, also of windows that moved nothing; the
        SAME steps for every rank, so a neighbour that slows all ranks alike moves no
        sample); when some rank's speed changed (``changed``, :meth:`_change_steps` of any
        rank) they are the steps after the change alone, and the older windows' points are
        forgotten."""
        samples = rows[0].samples
        tail = statistics.median(getattr(row, "tail_time_s", 0.0) for row in rows)
        prior = self._curves[rank]
        if prior is None:
            measured = statistics.median(row.compute_time_s for row in rows)
            self._measured[rank] = (samples, measured)
            self._points[rank] = [(accum, samples, measured)]
            return CostCurve(0.0, measured / max(samples, 1), tail)
        ratios = [row.compute_time_s / prior.compute_s(row.samples, accum) for row in rows]
        measured = statistics.median(row.compute_time_s for row in rows)
        self._measured[rank] = (samples, measured)
        ratio = statistics.median(ratios)
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

    def _remember(self, rank: int, step: int) -> None:
        """Keep rank ``rank``'s latest measurement (:data:`EVIDENCE_MEMORY_STEPS`): it
        supersedes older ones at a share no larger."""
        measured = self._measured[rank]
        if measured is None:
            return
        samples, seconds = measured
        kept = [
            (s, b, t)
            for s, b, t in self._evidence[rank]
            if b > samples and step - s <= EVIDENCE_MEMORY_STEPS
        ]
        self._evidence[rank] = [*kept, (step, samples, seconds)]

    def measured_rate(self, rank: int, samples: int, step: int) -> float:
        """Slowest measured time per sample (seconds) of rank ``rank`` at ``samples`` or more
        within :data:`EVIDENCE_MEMORY_STEPS` of ``step``, over :data:`EXTRAPOLATION` (0.0
        when none): what a curve may not undercut beyond the sizes it was measured at."""
        return max(
            (
                t / b / EXTRAPOLATION
                for s, b, t in self._evidence[rank]
                if b >= samples and b > 0 and step - s <= EVIDENCE_MEMORY_STEPS
            ),
            default=0.0,
        )

    @staticmethod
    def bounded(curve: CostCurve, rate_s: float) -> CostCurve:
        """``curve`` made at least proportional, ``t(m) >= rate_s x m``: a fixed cost measured
        at a few samples does not make the rank's extra samples cheap (a line through a
        point with ``a >= 0`` lies below the proportional one beyond it). The same curve
        when ``rate_s`` is at most its slope; ``max(rate_s m, a + c m)`` without a host
        floor; with one, its device slope raised to ``rate_s``."""
        if rate_s <= curve.per_sample_s:
            return curve
        if curve.host_s == 0:
            return CostCurve(0.0, rate_s, curve.step_fixed_s, curve.overhead_s, curve.per_sample_s)
        return replace(curve, per_sample_s=rate_s)

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
        # a rank that would gain samples is not taken faster per sample than it was measured
        # at its share (or a larger one, lately): no jump on an extrapolated fixed cost
        curves = [
            self.bounded(curve, self.measured_rate(rank, c, step)) if d > 0 else curve
            for rank, (curve, c, d) in enumerate(zip(curves, current, direction))
        ]
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
        self._note_noise(window, allocation.shares)
        # the steps of earlier windows at this split that moved nothing still count (a
        # change's evidence grows step by step); a speed change forgets the steps before it
        history = [*self._held, *window][-HISTORY_STEPS:]
        mine = [
            [row[rank] for row in window if row[rank].samples == share.samples]
            for rank, share in enumerate(shares)
        ]
        since = [
            m
            for rank, (share, rows) in enumerate(zip(shares, mine))
            if (m := self._change_steps(rank, share.accum_steps, rows))
        ]
        changed = bool(since)
        if changed:  # a speed change: every rank measured over the same steps after it
            history = window[-min(since) :]
        self._held = history
        for rank, share in enumerate(shares):
            rows = [row[rank] for row in history if row[rank].samples == share.samples]
            if rows:
                self._curves[rank] = self._refit(rank, share.accum_steps, rows, changed)
                self._remember(rank, step)
        self._note_errors(history, shares)
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
        self._held = []
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
