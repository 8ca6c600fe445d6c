"""The one per-rank cost model, ``t(m) = a + max(c m, h + g m)`` per micro-batch (a line when
the host floor ``h`` is 0) plus a per-step fixed cost ``f``, and the split of a global batch that minimises the predicted step time
(:func:`min_max_split`, exact and deterministic).

Used by the runtime allocation (:func:`hetseq_hpc.balance.allocation.allocate`), the online
re-balancer (:mod:`hetseq_hpc.balance.rebalance`) and the planner
(:mod:`hetseq_hpc.plan.step_time`): ranks that compute from the same gathered floats get the
same split and digest. The model and its sources: docs/design/allocation.md,
"The cost model and the min-max split".
"""

from __future__ import annotations

import heapq
import math
import struct
from dataclasses import asdict, dataclass, replace
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from hetseq_hpc.errors import AllocationError

#: smallest time per sample a fit may return, seconds (keeps every curve strictly increasing)
MIN_PER_SAMPLE_S = 1e-12
#: bisection rounds of :func:`min_max_split` (enough to reach adjacent floats)
_BISECTION_ROUNDS = 200
#: up to this many ranks :func:`min_max_split` works per rank in Python, above it with numpy
#: on every rank at once (the same split either way: tests/unit/test_allocation_scale.py)
_FEW_RANKS = 16


@dataclass(frozen=True)
class CostCurve:
    """One rank's cost model (seconds): a micro-batch of ``m`` samples takes
    ``t(m) = a + max(c m, h + g m)``, i.e. ``data(m) + max(host, device(m))`` with
    ``data(m) = a + g m``, ``host = h`` (the host's time to issue the passes, which overlaps
    the device's work) and ``device(m) = (c - g) m``. With ``h = g = 0`` (a CPU, where host and
    device are the same thing) it is the line ``a + c m``.

    Attributes:
        overhead_s: ``a``, fixed time of one micro-batch, >= 0.
        per_sample_s: ``c``, time per sample once the device bounds the pass, > 0.
        step_fixed_s: ``f``, fixed time per optimizer step outside the micro-batches, >= 0.
        host_s: ``h``, the host floor of one micro-batch above ``a``, >= 0 (0 = no floor).
        host_per_sample_s: ``g``, time per sample while the host bounds the pass, >= 0.
    """

    overhead_s: float
    per_sample_s: float
    step_fixed_s: float = 0.0
    host_s: float = 0.0
    host_per_sample_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "per_sample_s", "step_fixed_s", "host_s", "host_per_sample_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise AllocationError(
                    f"cost curve {name}={value} is invalid: re-run the "
                    "calibration (every figure must be finite and >= 0)"
                )
        if self.per_sample_s <= 0:
            raise AllocationError(
                f"cost curve per_sample_s={self.per_sample_s} is invalid: it "
                "must be > 0; re-run the calibration"
            )

    @classmethod
    def from_throughput(cls, samples_per_s: float) -> CostCurve:
        """The proportional model of a single rate: ``a = f = h = 0``, ``c = 1 / samples_per_s``.

        Raises:
            AllocationError: the rate is not a positive finite number.
        """
        if not (samples_per_s > 0 and math.isfinite(samples_per_s)):
            raise AllocationError(
                f"throughput {samples_per_s} is invalid: every rank must measure > 0 samples/s"
            )
        return cls(0.0, 1.0 / float(samples_per_s), 0.0)

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        """Inverse of :meth:`to_dict` (extra keys are ignored; no host floor when absent)."""
        return cls(
            float(data["overhead_s"]),
            float(data["per_sample_s"]),
            float(data.get("step_fixed_s", 0.0)),
            float(data.get("host_s", 0.0)),
            float(data.get("host_per_sample_s", 0.0)),
        )

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)

    @property
    def host_bound_below(self) -> float:
        """Micro-batch size below which the host bounds a pass (``h / (c - g)``; 0 without a
        floor, infinite when the device never catches up)."""
        if self.host_s == 0:
            return 0.0
        gap = self.per_sample_s - self.host_per_sample_s
        return self.host_s / gap if gap > 0 else math.inf

    def micro_s(self, micro_batch: float) -> float:
        """``t(m) = a + max(c m, h + g m)``: one forward+backward micro-batch of ``m``
        samples."""
        return self.overhead_s + max(
            self.per_sample_s * micro_batch, self.host_s + self.host_per_sample_s * micro_batch
        )

    def compute_s(self, samples: int, accum_steps: int) -> float:
        """``k a + max(c b, k h + g b)``: ``samples`` in ``accum_steps`` micro-batches of
        (near-)equal size (no per-step cost); ``k a + c b`` without a host floor."""
        return accum_steps * self.overhead_s + max(
            self.per_sample_s * samples,
            accum_steps * self.host_s + self.host_per_sample_s * samples,
        )

    def step_s(self, samples: int, cap: int) -> float:
        """``T(b) = compute_s(b, k) + f`` with the fewest micro-batches ``k = ceil(b / cap)``
        (non-decreasing in ``b``)."""
        accum = -(-int(samples) // int(cap)) if samples > 0 else 0
        return self.compute_s(samples, accum) + self.step_fixed_s

    def samples_per_s(self, cap: int) -> float:
        """Steady throughput at full micro-batches of ``cap`` (``cap / t(cap)``), per-step cost
        left out."""
        return cap / self.micro_s(cap)

    def scaled(self, factor: float) -> CostCurve:
        """The micro-batch part times ``factor`` (a device that got uniformly faster/slower)."""
        return replace(
            self,
            overhead_s=self.overhead_s * factor,
            per_sample_s=self.per_sample_s * factor,
            host_s=self.host_s * factor,
            host_per_sample_s=self.host_per_sample_s * factor,
        )

    def with_step_fixed(self, step_fixed_s: float) -> CostCurve:
        """The same micro-batch curve with another per-step cost."""
        return replace(self, step_fixed_s=max(float(step_fixed_s), 0.0))

    def max_samples(self, budget_s: float, cap: int, limit: Optional[int] = None) -> int:
        """Largest ``b >= 0`` with :meth:`step_s` ``(b, cap) <= budget_s``; with ``limit``, at
        most ``limit`` (the guess is clipped first, as :class:`_Ranks` does for every rank)."""
        spare = budget_s - self.step_fixed_s
        if spare < 0:
            return 0
        a, c, h, g = self.overhead_s, self.per_sample_s, self.host_s, self.host_per_sample_s
        if a == 0 and h == 0:
            guess = int(spare / c)
        else:  # b(k) = min(k cap, b_device(k), b_host(k)) peaks where they meet
            k0 = max(1, int(spare / self.micro_s(cap)))
            guess = max(
                max(0, min(k * cap, int((spare - k * a) / c), _host_room(spare, k, a, h, g)))
                for k in (k0, k0 + 1)
            )
        guess = max(0, guess) if limit is None else min(max(0, guess), limit)
        # settle on the exact boundary of step_s (the same float expression every caller uses)
        while (limit is None or guess < limit) and self.step_s(guess + 1, cap) <= budget_s:
            guess += 1
        while guess > 0 and self.step_s(guess, cap) > budget_s:
            guess -= 1
        return guess


def _host_room(spare: float, k: int, a: float, h: float, g: float) -> int:
    """Most samples ``b`` with ``k (a + h) + g b <= spare`` (the host branch of
    :meth:`CostCurve.compute_s`), a large number when ``g = 0`` and the floor fits."""
    room = spare - k * (a + h)
    if room < 0:
        return -1
    return int(room / g) if g > 0 else 2**62


def fit_compute(
    designs: Sequence[Tuple[float, float]], times_s: Sequence[float]
) -> Tuple[float, float]:
    """Least-squares ``(a, c)`` of ``time = k a + b c`` over observations ``(k, b) -> time``
    (``k`` micro-batches holding ``b`` samples; one micro-batch of ``m`` is ``(1, m)``).

    ``a`` is kept >= 0: when the unconstrained fit gives ``a < 0`` (one size only, or noise that
    tilts the line), ``c`` is refitted through the origin (``a = 0``). ``c`` is at least
    :data:`MIN_PER_SAMPLE_S`.

    Raises:
        AllocationError: no observation, mismatched lengths, or a time that is not positive.
    """
    if not designs or len(designs) != len(times_s):
        raise AllocationError(
            f"{len(times_s)} timings for {len(designs)} designs: give one "
            "timing per (micro-batches, samples) pair, at least one"
        )
    for t in times_s:
        if not (t > 0 and math.isfinite(t)):
            raise AllocationError(f"a measured time of {t} s is invalid: re-run the calibration")
    skk = sum(k * k for k, _ in designs)
    sbb = sum(b * b for _, b in designs)
    skb = sum(k * b for k, b in designs)
    sky = sum(k * y for (k, _), y in zip(designs, times_s))
    sby = sum(b * y for (_, b), y in zip(designs, times_s))
    det = skk * sbb - skb * skb
    if det > 1e-9 * skk * sbb:
        a = (sbb * sky - skb * sby) / det
        c = (skk * sby - skb * sky) / det
        if a >= 0 and c > 0:
            return a, c
    return 0.0, max(sby / sbb, MIN_PER_SAMPLE_S)


#: a host floor is fitted only when the line misses some timing by more than this share ...
FLOOR_MIN_MISS = 0.05
#: ... and the floor's worst miss is at most this share of the line's (a floor that only
#: trims noise is not one: on a CPU the line stays)
FLOOR_GAIN = 0.5
#: floors whose worst misses are within this of the best count as equally good; of those the
#: one with the most host-bound sizes wins (its device line comes from the largest sizes)
FLOOR_TIE = 0.01


def fit_curve(
    sizes: Sequence[int], times_s: Sequence[float], step_fixed_s: float = 0.0
) -> CostCurve:
    """A :class:`CostCurve` from single micro-batch timings: ``times_s[j]`` seconds for a
    forward+backward of ``sizes[j]`` samples.

    The line ``a + c m`` (:func:`fit_compute`) unless a host floor fits clearly better: with
    at least three distinct sizes, each split of the sizes into a host-bound low end and a
    device-bound high end (one or more each) is tried -- ``a, c`` fitted on the high end
    (``a = 0`` for a single size), ``a + h + g m`` on the low end (``g`` in ``[0, c)``;
    ``g = 0`` for a single size) -- and
    the one with the smallest worst relative miss is taken (within :data:`FLOOR_TIE`, the one
    with the most host-bound sizes) when the line misses some timing by more than
    :data:`FLOOR_MIN_MISS` and the floor's worst miss is at most :data:`FLOOR_GAIN` times
    the line's. Timings of one size are averaged first.

    Raises:
        AllocationError: as :func:`fit_compute`.
    """
    step_fixed = max(float(step_fixed_s), 0.0)
    a, c = fit_compute([(1, m) for m in sizes], times_s)
    line = CostCurve(a, c, step_fixed)
    by_size: dict = {}
    for m, t in zip(sizes, times_s):
        by_size.setdefault(int(m), []).append(float(t))
    ms = sorted(by_size)
    ts = [sum(by_size[m]) / len(by_size[m]) for m in ms]
    if len(ms) < 3:
        return line
    line_miss = _worst_miss(line, ms, ts)
    if line_miss <= FLOOR_MIN_MISS:
        return line
    floors = []
    for j in range(1, len(ms)):
        floor = _floor_fit(ms[:j], ts[:j], ms[j:], ts[j:], step_fixed)
        if floor is not None:
            floors.append((_worst_miss(floor, ms, ts), floor))
    if not floors:
        return line
    least = min(miss for miss, _ in floors)
    if least > FLOOR_GAIN * line_miss:
        return line
    return [floor for miss, floor in floors if miss <= least + FLOOR_TIE][-1]


def _worst_miss(curve: CostCurve, sizes: Sequence[int], times_s: Sequence[float]) -> float:
    """Largest ``|measured / t(m) - 1|`` over the timings."""
    return max(abs(t / curve.micro_s(m) - 1.0) for m, t in zip(sizes, times_s))


def _floor_fit(
    low: Sequence[int],
    low_s: Sequence[float],
    high: Sequence[int],
    high_s: Sequence[float],
    step_fixed_s: float,
) -> CostCurve | None:
    """The host-floor curve with ``low`` host-bound and ``high`` device-bound (None when the
    sizes do not support one: no floor above the device line, or a host slope >= ``c``)."""
    if len(high) == 1:  # a and c are not separable: all fixed time is the host's (a = 0)
        a, c = 0.0, max(high_s[0] / high[0], MIN_PER_SAMPLE_S)
    else:
        a, c = fit_compute([(1, m) for m in high], high_s)
    if len(low) == 1:
        g, lift = 0.0, low_s[0]
    else:
        g, lift = _line(low, low_s)
        if g < 0:
            g, lift = 0.0, sum(low_s) / len(low_s)
    h = lift - a
    if h <= 0 or g >= c:
        return None
    return CostCurve(a, c, step_fixed_s, h, max(g, MIN_PER_SAMPLE_S))


def _line(xs: Sequence[int], ys: Sequence[float]) -> Tuple[float, float]:
    """Unconstrained least-squares ``(slope, intercept)`` of ``y = intercept + slope x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


def fit_residuals(curve: CostCurve, sizes: Sequence[int], times_s: Sequence[float]) -> List[float]:
    """Relative residuals ``measured / t(m) - 1`` of a fit, one per timing."""
    return [t / curve.micro_s(m) - 1.0 for m, t in zip(sizes, times_s)]


def predicted_step_s(
    curves: Sequence[CostCurve], samples: Sequence[int], caps: Sequence[int]
) -> float:
    """``max_i T_i`` of a split (seconds)."""
    return max(curve.step_s(b, cap) for curve, b, cap in zip(curves, samples, caps))


class _Ranks:
    """The cost curves and caps of a world as float64/int64 arrays, ``(world_size,)`` each: the
    per-rank step times and sample counts of :class:`CostCurve` for every rank at once, with the
    same IEEE operations in the same order as :meth:`CostCurve.step_s` (so the same floats)."""

    def __init__(self, curves: Sequence[CostCurve], caps: Sequence[int]) -> None:
        n = len(curves)
        self.a = np.fromiter((c.overhead_s for c in curves), np.float64, n)
        self.c = np.fromiter((c.per_sample_s for c in curves), np.float64, n)
        self.f = np.fromiter((c.step_fixed_s for c in curves), np.float64, n)
        self.h = np.fromiter((c.host_s for c in curves), np.float64, n)
        self.g = np.fromiter((c.host_per_sample_s for c in curves), np.float64, n)
        self.cap = np.fromiter((int(cap) for cap in caps), np.int64, n)

    def step_s(self, samples: np.ndarray) -> np.ndarray:
        """:meth:`CostCurve.step_s` of ``samples`` (int64, >= 0) per rank, seconds."""
        accum = -(-samples // self.cap)
        return (
            accum * self.a + np.maximum(self.c * samples, accum * self.h + self.g * samples)
        ) + self.f

    def within(self, budget_s: float, limit: int) -> np.ndarray:
        """Per rank ``min(limit, CostCurve.max_samples(budget_s, cap))`` (int64): the same
        guess as :meth:`CostCurve.max_samples`, settled on the exact boundary of
        :meth:`step_s` the same way, every rank at once."""
        a, c, h, g, cap = self.a, self.c, self.h, self.g, self.cap
        spare = budget_s - self.f
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            full = a + np.maximum(c * cap, h + g * cap)  # t(cap)
            k0 = np.maximum(1.0, np.floor(spare / full))

            def room(k: np.ndarray) -> np.ndarray:
                host = spare - k * (a + h)
                fits = np.where(g > 0, np.floor(host / g), float(limit))
                return np.minimum(
                    np.minimum(k * cap, np.floor((spare - k * a) / c)),
                    np.where(host < 0, -1.0, fits),
                )

            meet = np.maximum(room(k0), room(k0 + 1))
            guess = np.where((a == 0) & (h == 0), np.floor(spare / c), meet)
        guess = np.where(spare < 0, 0.0, np.clip(np.nan_to_num(guess), 0, limit))
        got = guess.astype(np.int64)
        while True:  # the guess is off by a sample or two at most: settle it
            up = (got < limit) & (self.step_s(got + 1) <= budget_s)
            if not up.any():
                break
            got += up
        while True:
            down = (got > 0) & (self.step_s(got) > budget_s)
            if not down.any():
                break
            got -= down
        return got


def min_max_split(curves: Sequence[CostCurve], total: int, caps: Sequence[int]) -> List[int]:
    """Per-rank samples ``b_i >= 1``, ``sum b_i = total``, that minimise ``max_i T_i(b_i)``.

    Every rank's first sample is its own; the other ``total - n`` samples are the ``total - n``
    earliest-ending ones over all ranks: rank ``i``'s ``b``-th sample ends at ``T_i(b)``
    (:meth:`CostCurve.step_s`), ordered by that time, ties to the lower rank. Each ``T_i`` is
    non-decreasing in ``b``, so this water-filling is exact. Found in O(n log n): a bisection on
    the step time (:data:`_BISECTION_ROUNDS` at most, every rank at once) for a budget whose
    per-rank maxima (:meth:`CostCurve.max_samples`) hold fewer than ``total`` samples and at
    most ``n`` fewer than the next budget tried, then a heap hands out the rest one sample at
    a time to the rank whose next sample ends earliest. Deterministic: the same floats give
    the same split on every rank (docs/design/control-plane-scale.md).

    Raises:
        AllocationError: sizes disagree, ``total`` is smaller than the number of ranks, or a cap
            is below 1.
    """
    n = len(curves)
    if n == 0:
        raise AllocationError("no ranks to allocate to")
    if len(caps) != n:
        raise AllocationError(f"{n} cost curves for {len(caps)} ranks")
    if total < n:
        raise AllocationError(
            f"global batch {total} is smaller than {n} ranks x 1 sample(s): "
            "raise trainer.global_batch_size or use fewer ranks"
        )
    for rank, cap in enumerate(caps):
        if cap < 1:
            raise AllocationError(f"rank {rank} has a micro-batch cap of {cap}: it must be >= 1")
    if total == n:
        return [1] * n
    if n <= _FEW_RANKS:
        return _few_ranks_split(curves, total, caps)
    ranks = _Ranks(curves, caps)
    # bisect on the bits of the (non-negative) budget: adjacent floats in <= 64 rounds
    lo, lo_counts = 0, np.ones(n, np.int64)  # budget 0: no sample ends by then
    # by this budget the slowest rank alone holds the whole batch
    hi = _budget_bits(float(ranks.step_s(np.full(n, total, np.int64)).max()))
    left = total - n
    for _ in range(_BISECTION_ROUNDS):
        if hi - lo <= 1 or left <= n:
            break
        mid = lo + (hi - lo) // 2
        counts = np.maximum(ranks.within(_bits_budget(mid), total), 1)
        got = int(counts.sum())
        if got < total:
            lo, lo_counts, left = mid, counts, total - got
        else:
            hi = mid
    return _hand_out(curves, caps, lo_counts.tolist(), ranks.step_s(lo_counts + 1).tolist(), left)


def _few_ranks_split(curves: Sequence[CostCurve], total: int, caps: Sequence[int]) -> List[int]:
    """:func:`min_max_split` (checked arguments, ``total > n``) one rank at a time in Python:
    the same bisection, budgets and heap, so the same split; :meth:`CostCurve.max_samples`
    with ``limit`` and :meth:`CostCurve.step_s` are what :class:`_Ranks` computes for every
    rank at once. At a few ranks numpy's cost per call (~0.2 ms a bisection round) was most of
    a re-balancing decision's host time."""
    n = len(curves)
    pairs = list(zip(curves, caps))
    lo, lo_counts = 0, [1] * n
    hi = _budget_bits(max(curve.step_s(total, cap) for curve, cap in pairs))
    left = total - n
    for _ in range(_BISECTION_ROUNDS):
        if hi - lo <= 1 or left <= n:
            break
        mid = lo + (hi - lo) // 2
        budget = _bits_budget(mid)
        counts = [max(curve.max_samples(budget, cap, total), 1) for curve, cap in pairs]
        got = sum(counts)
        if got < total:
            lo, lo_counts, left = mid, counts, total - got
        else:
            hi = mid
    ends = [curve.step_s(b + 1, cap) for (curve, cap), b in zip(pairs, lo_counts)]
    return _hand_out(curves, caps, list(lo_counts), ends, left)


def _hand_out(
    curves: Sequence[CostCurve],
    caps: Sequence[int],
    counts: List[int],
    next_ends_s: List[float],
    left: int,
) -> List[int]:
    """:func:`min_max_split`'s last ``left`` samples, one at a time, each to the rank whose
    next sample ends earliest (``next_ends_s[i]``: rank ``i``'s step time at ``counts[i] + 1``
    samples; ties to the lower rank). Returns ``counts``, raised in place."""
    heap = list(zip(next_ends_s, range(len(counts))))
    heapq.heapify(heap)
    for _ in range(left):
        _, best = heapq.heappop(heap)
        counts[best] += 1
        heapq.heappush(heap, (curves[best].step_s(counts[best] + 1, caps[best]), best))
    return counts


def _budget_bits(budget_s: float) -> int:
    """The IEEE bits of a non-negative float as an integer (ordered like the floats)."""
    return struct.unpack("<q", struct.pack("<d", budget_s))[0]


def _bits_budget(bits: int) -> float:
    """Inverse of :func:`_budget_bits`."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def curves_from(items: Iterable[dict]) -> List[CostCurve]:
    """:class:`CostCurve` list from dicts (``allocation.json``'s ``curves``)."""
    return [CostCurve.from_dict(d) for d in items]
