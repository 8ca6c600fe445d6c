"""The one per-rank cost model, ``t(m) = a + c * m`` per micro-batch plus a per-step fixed cost
``f``, and the split of a global batch that minimises the predicted step time
(:func:`min_max_split`, exact and deterministic).

Used by the runtime allocation (:func:`hetseq_hpc.balance.allocation.allocate`), the online
re-balancer (:mod:`hetseq_hpc.balance.rebalance`) and the planner
(:mod:`hetseq_hpc.plan.step_time`): ranks that compute from the same gathered floats get the
same split and digest. The model and its sources: docs/design/allocation.md,
"The cost model and the min-max split".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, List, Sequence, Tuple

from hetseq_hpc.errors import AllocationError

#: smallest time per sample a fit may return, seconds (keeps every curve strictly increasing)
MIN_PER_SAMPLE_S = 1e-12
#: bisection rounds of :func:`min_max_split` (enough to reach adjacent floats)
_BISECTION_ROUNDS = 200


@dataclass(frozen=True)
class CostCurve:
    """One rank's cost model (seconds).

    Attributes:
        overhead_s: ``a``, fixed time of one micro-batch, >= 0.
        per_sample_s: ``c``, time per sample, > 0.
        step_fixed_s: ``f``, fixed time per optimizer step outside the micro-batches, >= 0.
    """

    overhead_s: float
    per_sample_s: float
    step_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "per_sample_s", "step_fixed_s"):
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
        """The proportional model of a single rate: ``a = f = 0``, ``c = 1 / samples_per_s``.

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
        """Inverse of :meth:`to_dict` (extra keys are ignored)."""
        return cls(
            float(data["overhead_s"]),
            float(data["per_sample_s"]),
            float(data.get("step_fixed_s", 0.0)),
        )

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)

    def micro_s(self, micro_batch: float) -> float:
        """``t(m) = a + c m``: one forward+backward micro-batch of ``m`` samples."""
        return self.overhead_s + self.per_sample_s * micro_batch

    def compute_s(self, samples: int, accum_steps: int) -> float:
        """``k a + c b``: ``samples`` in ``accum_steps`` micro-batches (no per-step cost)."""
        return accum_steps * self.overhead_s + self.per_sample_s * samples

    def step_s(self, samples: int, cap: int) -> float:
        """``T(b) = k a + c b + f`` with the fewest micro-batches ``k = ceil(b / cap)``."""
        accum = -(-int(samples) // int(cap)) if samples > 0 else 0
        return self.compute_s(samples, accum) + self.step_fixed_s

    def samples_per_s(self, cap: int) -> float:
        """Steady throughput at full micro-batches of ``cap`` (``cap / t(cap)``), per-step cost
        left out."""
        return cap / self.micro_s(cap)

    def scaled(self, factor: float) -> CostCurve:
        """The micro-batch part times ``factor`` (a device that got uniformly faster/slower)."""
        return CostCurve(self.overhead_s * factor, self.per_sample_s * factor, self.step_fixed_s)

    def with_step_fixed(self, step_fixed_s: float) -> CostCurve:
        """The same micro-batch curve with another per-step cost."""
        return CostCurve(self.overhead_s, self.per_sample_s, max(float(step_fixed_s), 0.0))

    def max_samples(self, budget_s: float, cap: int) -> int:
        """Largest ``b >= 0`` with :meth:`step_s` ``(b, cap) <= budget_s``."""
        spare = budget_s - self.step_fixed_s
        if spare < 0:
            return 0
        a, c = self.overhead_s, self.per_sample_s
        if a == 0:
            guess = int(spare / c)
        else:  # b(k) = min(k cap, (spare - k a) / c) peaks where the two meet
            k0 = max(1, int(spare / (c * cap + a)))
            guess = max(max(0, min(k * cap, int((spare - k * a) / c))) for k in (k0, k0 + 1))
        guess = max(0, guess)
        # settle on the exact boundary of step_s (the same float expression every caller uses)
        while self.step_s(guess + 1, cap) <= budget_s:
            guess += 1
        while guess > 0 and self.step_s(guess, cap) > budget_s:
            guess -= 1
        return guess


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


def fit_curve(
    sizes: Sequence[int], times_s: Sequence[float], step_fixed_s: float = 0.0
) -> CostCurve:
    """A :class:`CostCurve` from single micro-batch timings: ``times_s[j]`` seconds for a
    forward+backward of ``sizes[j]`` samples (:func:`fit_compute`)."""
    a, c = fit_compute([(1, m) for m in sizes], times_s)
    return CostCurve(a, c, max(float(step_fixed_s), 0.0))


def fit_residuals(curve: CostCurve, sizes: Sequence[int], times_s: Sequence[float]) -> List[float]:
    """Relative residuals ``measured / t(m) - 1`` of a fit, one per timing."""
    return [t / curve.micro_s(m) - 1.0 for m, t in zip(sizes, times_s)]


def predicted_step_s(
    curves: Sequence[CostCurve], samples: Sequence[int], caps: Sequence[int]
) -> float:
    """``max_i T_i`` of a split (seconds)."""
    return max(curve.step_s(b, cap) for curve, b, cap in zip(curves, samples, caps))


def _count(curves: Sequence[CostCurve], caps: Sequence[int], budget_s: float) -> List[int]:
    return [max(1, curve.max_samples(budget_s, cap)) for curve, cap in zip(curves, caps)]


def min_max_split(curves: Sequence[CostCurve], total: int, caps: Sequence[int]) -> List[int]:
    """Per-rank samples ``b_i >= 1``, ``sum b_i = total``, that minimise ``max_i T_i(b_i)``.

    Water-filling: bisect on the step time ``T`` for the largest budget whose per-rank maxima
    (:meth:`CostCurve.max_samples`) hold fewer than ``total`` samples, then hand out the rest
    one sample at a time to the rank whose next sample ends earliest (ties to the lower rank).
    Each ``T_i`` is increasing in ``b_i``, so this greedy completion is exact. Deterministic.

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
    lo = 0.0
    hi = max(curve.step_s(total, cap) for curve, cap in zip(curves, caps))
    if sum(_count(curves, caps, lo)) < total:
        for _ in range(_BISECTION_ROUNDS):
            mid = lo + (hi - lo) / 2
            if mid <= lo or mid >= hi:
                break
            if sum(_count(curves, caps, mid)) < total:
                lo = mid
            else:
                hi = mid
    counts = _count(curves, caps, lo)
    if sum(counts) > total:  # only when every rank's minimum already fills the batch
        counts = [1] * n
    while sum(counts) < total:
        best = min(range(n), key=lambda i: (curves[i].step_s(counts[i] + 1, caps[i]), i))
        counts[best] += 1
    return counts


def curves_from(items: Iterable[dict]) -> List[CostCurve]:
    """:class:`CostCurve` list from dicts (``allocation.json``'s ``curves``)."""
    return [CostCurve.from_dict(d) for d in items]
