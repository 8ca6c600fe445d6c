"""Split the global batch over ranks: per-rank samples, micro-batch and gradient accumulation.

Rank ``i`` processes ``b_i`` samples per optimizer step, ``sum_i b_i = B`` (the global batch),
as ``accum_steps`` micro-batches of at most ``micro_batch`` samples. With measured cost curves
(:mod:`hetseq_hpc.balance.curves`: ``T_i = k_i a_i + c_i b_i + f_i``) ``b_i`` minimises the predicted
step time ``max_i T_i`` exactly; with plain throughputs (samples/s) ``b_i`` is proportional to
them. The micro-batch is capped by the rank's memory, and gradient accumulation makes up the
rest (the memory half of Whale, ATC 2022, and Poplar, AAAI 2025). Proportional rounding uses the
largest-remainder method, so the counts always sum to ``B`` and every rank gets >= 1 sample.

All ranks run the same pure function on the same all-gathered inputs and then compare a
digest of the result (:meth:`Allocation.digest`), so they agree on one allocation.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence, Tuple

from hetseq_hpc.balance.curves import CostCurve, min_max_split
from hetseq_hpc.errors import AllocationError


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the global batch.

    Attributes:
        rank: global rank.
        samples: samples per optimizer step, ``b_i``.
        micro_batch: largest micro-batch (samples per forward/backward pass).
        accum_steps: micro-batches per optimizer step.
        max_micro_batch: the memory cap the micro-batch respects.
    """

    rank: int
    samples: int
    micro_batch: int
    accum_steps: int
    max_micro_batch: int

    @property
    def micro_sizes(self) -> List[int]:
        """Sizes of the ``accum_steps`` micro-batches, as equal as possible, summing to ``samples``
        (e.g. 10 samples, 3 steps -> [4, 3, 3])."""
        base, extra = divmod(self.samples, self.accum_steps)
        return [base + 1] * extra + [base] * (self.accum_steps - extra)


@dataclass(frozen=True)
class Allocation:
    """The agreed split of one global batch.

    Attributes:
        global_batch_size: ``B``.
        shares: one :class:`RankShare` per rank, in rank order.
        source: ``"forced"`` (balance.allocation), ``"cost_curve"`` (calibrated cost curves),
            ``"throughput"`` (proportional to samples/s) or ``"rebalanced"`` (online, from
            measured step times).
        throughputs: the samples/s per rank the split was computed from (empty when forced).
        step: first optimizer step (1-based) that uses this allocation.
        curves: the per-rank cost curves the split was computed from (empty without).
    """

    global_batch_size: int
    shares: Tuple[RankShare, ...]
    source: str
    throughputs: Tuple[float, ...] = field(default_factory=tuple)
    step: int = 1
    curves: Tuple[CostCurve, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        total = sum(s.samples for s in self.shares)
        if total != self.global_batch_size:
            raise AllocationError(
                f"allocation sums to {total} samples, not the global batch {self.global_batch_size}"
            )
        for i, share in enumerate(self.shares):
            if share.rank != i or share.samples < 1 or share.micro_batch < 1:
                raise AllocationError(f"allocation entry {i} is malformed: {share}")
            if share.micro_batch * share.accum_steps < share.samples:
                raise AllocationError(
                    f"rank {i}: {share.accum_steps} x {share.micro_batch} < {share.samples} samples"
                )

    @property
    def samples(self) -> List[int]:
        """``[b_0, b_1, ...]``."""
        return [s.samples for s in self.shares]

    def offsets(self) -> List[int]:
        """Start of each rank's slice in the global batch: ``[0, b_0, b_0 + b_1, ...]``."""
        out, acc = [], 0
        for s in self.shares:
            out.append(acc)
            acc += s.samples
        return out

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        data = asdict(self)
        data["shares"] = [asdict(s) for s in self.shares]
        data["throughputs"] = list(self.throughputs)
        data["curves"] = [c.to_dict() for c in self.curves]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Allocation:
        """Inverse of :meth:`to_dict`."""
        return cls(
            global_batch_size=int(data["global_batch_size"]),
            shares=tuple(RankShare(**s) for s in data["shares"]),
            source=str(data["source"]),
            throughputs=tuple(float(t) for t in data.get("throughputs", ())),
            step=int(data.get("step", 1)),
            curves=tuple(CostCurve.from_dict(c) for c in data.get("curves", ())),
        )

    def digest(self) -> str:
        """SHA-256 of the split itself (samples, micro-batches, accumulation per rank). Ranks
        compare digests to prove they agree."""
        core = [(s.rank, s.samples, s.micro_batch, s.accum_steps) for s in self.shares]
        return hashlib.sha256(json.dumps([self.global_batch_size, core]).encode()).hexdigest()


def proportional_counts(weights: Sequence[float], total: int, minimum: int = 1) -> List[int]:
    """Integers proportional to ``weights`` that sum to ``total``, each >= ``minimum``
    (largest-remainder rounding; ties go to the lower rank, so the result is deterministic).

    Raises:
        AllocationError: ``total < minimum * len(weights)`` or a weight is not positive.
    """
    n = len(weights)
    if n == 0:
        raise AllocationError("no ranks to allocate to")
    if total < minimum * n:
        raise AllocationError(
            f"global batch {total} is smaller than {n} ranks x {minimum} sample(s): raise "
            "trainer.global_batch_size or use fewer ranks"
        )
    for i, w in enumerate(weights):
        if not (w > 0 and math.isfinite(w)):
            raise AllocationError(f"rank {i} has throughput {w}: every rank must measure > 0")
    wsum = float(sum(weights))
    quota = [total * w / wsum for w in weights]
    counts = [max(minimum, math.floor(q)) for q in quota]
    left = total - sum(counts)
    # hand out what is left by largest remainder (ties to the lower rank) ...
    order = sorted(range(n), key=lambda i: (-(quota[i] - counts[i]), i))
    for i in order[: max(left, 0)]:
        counts[i] += 1
    # ... or, if the minimum took too much, take back from ranks furthest above their quota
    # (ties to the higher rank), one sample at a time: a heap of (quota - count, -rank)
    above = [(quota[i] - counts[i], -i) for i in range(n) if counts[i] > minimum]
    heapq.heapify(above)
    while left < 0:
        _, neg = heapq.heappop(above)
        counts[-neg] -= 1
        left += 1
        if counts[-neg] > minimum:
            heapq.heappush(above, (quota[-neg] - counts[-neg], neg))
    return counts


def shares_for(samples: Sequence[int], max_micro: Sequence[int]) -> Tuple[RankShare, ...]:
    """Realise per-rank sample counts as micro-batch x accumulation under each rank's cap.

    ``accum = ceil(b / cap)``, then the micro-batch is evened out to ``ceil(b / accum)``.
    """
    out = []
    for rank, (b, cap) in enumerate(zip(samples, max_micro)):
        if cap < 1:
            raise AllocationError(f"rank {rank} has a micro-batch cap of {cap}: it must be >= 1")
        accum = max(1, math.ceil(b / cap))
        micro = math.ceil(b / accum)
        out.append(
            RankShare(
                rank=rank,
                samples=int(b),
                micro_batch=int(micro),
                accum_steps=int(accum),
                max_micro_batch=int(cap),
            )
        )
    return tuple(out)


def allocate(
    throughputs: Sequence[float],
    global_batch_size: int,
    max_micro_batch: Sequence[int],
    forced: Optional[Sequence[int]] = None,
    source: Optional[str] = None,
    step: int = 1,
    curves: Optional[Sequence[CostCurve]] = None,
) -> Allocation:
    """Compute the allocation every rank agrees on.

    Args:
        throughputs: measured samples/s per rank, ``(world_size,)``.
        global_batch_size: ``B``.
        max_micro_batch: per-rank micro-batch cap from memory (and ``balance.max_micro_batch``).
        forced: per-rank sample counts that override the computed split.
        source: label stored in the result (default ``forced`` / ``cost_curve`` /
            ``throughput``).
        step: first optimizer step that uses the allocation.
        curves: per-rank cost curves; given, the split minimises the predicted step time
            (:func:`hetseq_hpc.balance.curves.min_max_split`) instead of following ``throughputs``.

    Raises:
        AllocationError: sizes disagree, a forced split does not sum to ``B``, or the batch is
            smaller than the world size.
    """
    n = len(max_micro_batch)
    if len(throughputs) != n:
        raise AllocationError(f"{len(throughputs)} throughputs for {n} ranks")
    if forced is not None:
        forced = [int(b) for b in forced]
        if len(forced) != n or sum(forced) != global_batch_size or min(forced) < 1:
            raise AllocationError(
                f"balance.allocation={forced} does not fit {n} ranks and global batch "
                f"{global_batch_size}: give {n} counts >= 1 that sum to {global_batch_size}"
            )
        samples = forced
        label = source or "forced"
    elif curves is not None:
        if len(curves) != n:
            raise AllocationError(f"{len(curves)} cost curves for {n} ranks")
        samples = min_max_split(list(curves), global_batch_size, max_micro_batch)
        label = source or "cost_curve"
    else:
        samples = proportional_counts(throughputs, global_batch_size)
        label = source or "throughput"
    return Allocation(
        global_batch_size=global_batch_size,
        shares=shares_for(samples, max_micro_batch),
        source=label,
        throughputs=tuple(float(t) for t in throughputs),
        step=step,
        curves=tuple(curves or ()),
    )


def equal_split(
    world_size: int, global_batch_size: int, max_micro_batch: Sequence[int]
) -> Allocation:
    """The split everyone else uses: the same share for every rank (remainder to low ranks)."""
    return allocate([1.0] * world_size, global_batch_size, max_micro_batch, source="equal")
