"""The planner's cost model: per-rank throughput, ring all-reduce, DDP overlap, predicted step.

All pure functions; units in the names (``_s`` seconds, ``_gbps`` Gbit/s, ``_bytes``).

- per rank either a measured cost curve (a probe's fits: the runtime's own model,
  :class:`hetseq_hpc.balance.curves.CostCurve`) or a throughput_i [samples/s] = datasheet peak
  FLOP/s x MFU / training FLOPs per sample (:func:`datasheet_throughput`), i.e. the curve
  ``a = f = 0, c = 1 / throughput``;
- split = :func:`hetseq_hpc.balance.allocation.allocate` (what every rank computes at run time, with the
  curves when there are any); comparison = :func:`hetseq_hpc.balance.allocation.equal_split`;
- busy_i [s] = k_i a_i + c_i b_i + f_i (:func:`compute_times_s`; samples_i / throughput_i
  without curves);
- step [s] = max_i busy_i + exposed all-reduce (:func:`ddp_exposed_allreduce_s`, or the
  all-reduce x (1 - overlap)), or + the per-step synchronisation a probe run of the same world
  measured (:func:`hetseq_hpc.train.metrics.measured_step_sync`: exposed all-reduce, statistics
  exchange and the jitter of the slowest rank, all in one measured figure);
- ideal [samples/s] = sum_i of each rank's standalone rate on the whole global batch (sum_i
  throughput_i without curves); efficiency = balanced / ideal; speedup = balanced / equal
  split; all-reduce share = exposed all-reduce / step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.balance.allocation import Allocation, allocate, equal_split
from hetseq_hpc.balance.curves import CostCurve
from hetseq_hpc.config.plan import DEFAULT_LATENCY_US, DEFAULT_OVERLAP

#: bytes per parameter / gradient element (fp32 master weights and all-reduced gradients)
#: DDP's default bucket size (``bucket_cap_mb=25``)
DDP_BUCKET_BYTES = 25 * 2**20
#: share of a step's matmul FLOPs in the backward pass (2 of the 3 passes)
BACKWARD_SHARE = 2.0 / 3.0


def datasheet_throughput(peak_tflops: float, mfu: float, flops_per_sample: float) -> float:
    """Samples/s of one device: ``peak_tflops * 1e12 * mfu / flops_per_sample``.

    Args:
        peak_tflops: datasheet peak, TFLOP/s.
        mfu: model FLOPs utilisation, fraction of the peak actually reached, (0, 1].
        flops_per_sample: training FLOPs (forward + backward) of one sample.
    """
    return peak_tflops * 1e12 * mfu / flops_per_sample


def ring_allreduce_s(
    gradient_bytes: float, world_size: int, link_gbps: float, latency_s: float
) -> float:
    """Time of one ring all-reduce, seconds: ``2 (N-1)/N x bytes / (gbps x 1e9 / 8)
    + 2 (N-1) x latency`` (reduce-scatter then all-gather, 2 (N-1) steps of 1/N of the data;
    Thakur et al., IJHPCA 19(1) 2005; Patarasuk & Yuan, JPDC 69(2) 2009). 0 for one rank."""
    n = int(world_size)
    if n <= 1:
        return 0.0
    bandwidth = link_gbps * 1e9 / 8.0  # bytes/s
    return 2.0 * (n - 1) / n * gradient_bytes / bandwidth + 2.0 * (n - 1) * latency_s


def ring_link_gbps(groups: Sequence[Tuple[int, int, float]], network_gbps: float) -> float:
    """The slowest link of the all-reduce ring, Gbit/s: the ring visits the ranks of each node
    in turn, so its hops are links INSIDE a node (each partition's ``intra_gbps``, where a node
    holds more than one rank) and, with more than one node, one hop per node over the network
    (``network_gbps``); every hop carries the same bytes at once, so the slowest bounds the
    ring (Patarasuk & Yuan, JPDC 69(2) 2009, sec. 3; NCCL's rings are built the same way).

    Args:
        groups: per partition ``(nodes, ranks_per_node, intra_gbps)``.
        network_gbps: the network between nodes (``plan.link_gbps``).

    Returns:
        the bottleneck, Gbit/s (``network_gbps`` when there is no link at all: one rank).
    """
    links = [float(intra) for nodes, per_node, intra in groups if nodes >= 1 and per_node > 1]
    if sum(int(nodes) for nodes, _, _ in groups) > 1:
        links.append(float(network_gbps))
    return min(links) if links else float(network_gbps)


def rank_curves(
    throughputs: Sequence[float], curves: Optional[Sequence[CostCurve]] = None
) -> List[CostCurve]:
    """The cost curves, or each throughput's proportional curve (:meth:`CostCurve.from_throughput`)."""
    if curves is not None:
        return list(curves)
    return [CostCurve.from_throughput(t) for t in throughputs]


def compute_times_s(
    allocation: Allocation,
    throughputs: Sequence[float],
    curves: Optional[Sequence[CostCurve]] = None,
) -> Tuple[float, ...]:
    """Per-rank busy time of one step until its gradients are ready, seconds:
    ``k_i a_i + c_i b_i + f_i`` of each rank's cost curve (:mod:`hetseq_hpc.balance.curves`, the
    runtime's model), or ``samples_i / throughput_i`` without curves."""
    return tuple(
        c.compute_s(s.samples, s.accum_steps) + c.step_fixed_s
        for s, c in zip(allocation.shares, rank_curves(throughputs, curves))
    )


@dataclass(frozen=True)
class SplitTime:
    """Predicted timing of one split. Times in seconds, throughput in samples/s."""

    allocation: Allocation
    compute_s: Tuple[float, ...]  # per rank busy time (compute_times_s)
    step_s: float  # max compute + exposed all-reduce
    samples_per_s: float


@dataclass(frozen=True)
class Prediction:
    """Balanced vs equal split vs ideal, for one cluster and global batch."""

    throughputs: Tuple[float, ...]
    global_batch_size: int
    balanced: SplitTime
    equal: SplitTime
    allreduce_s: float  # full ring all-reduce time
    exposed_allreduce_s: float  # what the balanced step waits for after compute
    ideal_samples_per_s: float
    no_overlap_samples_per_s: float = 0.0  # balanced split if nothing overlapped (a lower bound)
    sync_measured: bool = False  # exposed_allreduce_s is a probe's measured per-step sync

    @property
    def world_size(self) -> int:
        """Ranks."""
        return len(self.throughputs)

    @property
    def efficiency(self) -> float:
        """Balanced samples/s over the ideal (sum of standalone throughputs)."""
        return self.balanced.samples_per_s / self.ideal_samples_per_s

    @property
    def efficiency_no_overlap(self) -> float:
        """Efficiency if no all-reduce overlapped compute (a lower bound)."""
        return self.no_overlap_samples_per_s / self.ideal_samples_per_s

    @property
    def speedup_vs_equal(self) -> float:
        """Balanced samples/s over the equal split's."""
        return self.balanced.samples_per_s / self.equal.samples_per_s

    @property
    def allreduce_share(self) -> float:
        """Exposed all-reduce time over the balanced step time."""
        return self.exposed_allreduce_s / self.balanced.step_s

    def headline(self) -> Dict[str, Any]:
        """The figures of the final JSON line."""
        return {
            "predicted_samples_per_s": round(self.balanced.samples_per_s, 3),
            "equal_split_samples_per_s": round(self.equal.samples_per_s, 3),
            "ideal_samples_per_s": round(self.ideal_samples_per_s, 3),
            "efficiency": round(self.efficiency, 4),
            "speedup_vs_equal": round(self.speedup_vs_equal, 4),
            "allreduce_share": round(self.allreduce_share, 4),
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "step_time_s": round(self.balanced.step_s, 6),
            "equal_split_step_time_s": round(self.equal.step_s, 6),
            "allreduce_s": round(self.allreduce_s, 6),
            "efficiency_no_overlap": round(self.efficiency_no_overlap, 4),
            "allocation_source": self.balanced.allocation.source,
            "sync_measured": self.sync_measured,
        }


def ddp_exposed_allreduce_s(
    allocation: Allocation,
    throughputs: Sequence[float],
    allreduce_s: float,
    gradient_bytes: float,
    curves: Optional[Sequence[CostCurve]] = None,
) -> float:
    """All-reduce time left after the last rank's compute, with DDP's bucketed overlap, seconds.

    DDP all-reduces gradients in buckets (``bucket_cap_mb=25``) as the backward pass fills them,
    in reverse layer order, overlapping communication with the rest of the backward (Li et al.,
    "PyTorch Distributed", VLDB 2020, sections 3.2.3-3.2.4). Under gradient accumulation only the
    LAST micro-batch's backward overlaps (``no_sync`` before it). With K buckets: rank i's bucket
    k is ready at ``end_i - (1 - (k+1)/K) x backward_i`` (``backward_i`` = 2/3 of its last
    micro-batch's time); a bucket's ring all-reduce (``allreduce_s / K``, bandwidth-bound) starts
    when every rank has it AND the previous bucket is done. Returns the time from the last rank's
    end of compute to the last bucket's end (one bucket = no overlap). ``curves``: as
    :func:`compute_times_s`.
    """
    if allreduce_s <= 0:
        return 0.0
    k_buckets = max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
    ends = compute_times_s(allocation, throughputs, curves)
    backward = [
        BACKWARD_SHARE * c.micro_s(share.micro_sizes[-1])
        for share, c in zip(allocation.shares, rank_curves(throughputs, curves))
    ]
    per_bucket = allreduce_s / k_buckets
    finish = float("-inf")
    for k in range(k_buckets):
        ready = max(end - (1.0 - (k + 1) / k_buckets) * bw for end, bw in zip(ends, backward))
        finish = max(ready, finish) + per_bucket
    return max(0.0, finish - max(ends))


def _timed(
    allocation: Allocation,
    throughputs: Sequence[float],
    exposed_s: float,
    curves: Optional[Sequence[CostCurve]] = None,
) -> SplitTime:
    compute = compute_times_s(allocation, throughputs, curves)
    step = max(compute) + exposed_s
    return SplitTime(allocation, compute, step, allocation.global_batch_size / step)


def predict(
    throughputs: Sequence[float],
    global_batch_size: int,
    caps: Sequence[int],
    gradient_bytes: float,
    link_gbps: float,
    latency_s: float = DEFAULT_LATENCY_US * 1e-6,
    overlap: Any = DEFAULT_OVERLAP,
    forced: Optional[Sequence[int]] = None,
    curves: Optional[Sequence[CostCurve]] = None,
    measured_sync_s: Optional[float] = None,
) -> Prediction:
    """Predict the balanced split (the runtime's :func:`allocate`), an equal split and the ideal.

    Args:
        throughputs: standalone samples/s per rank.
        global_batch_size: samples per optimizer step.
        caps: micro-batch cap per rank (memory).
        gradient_bytes: bytes all-reduced per step.
        link_gbps: bandwidth of the ring's slowest link, Gbit/s (:func:`ring_link_gbps`).
        latency_s: latency per ring step, seconds.
        overlap: ``"ddp"`` (DDP's bucketed overlap, :func:`ddp_exposed_allreduce_s`) or a fixed
            share of the all-reduce hidden behind compute, [0, 1] (0 = a lower bound).
        forced: ``balance.allocation`` if set (the runtime then uses it).
        curves: per-rank cost curves (a probe's fits); the split, the times and the ideal
            (sum of each rank's rate on the whole global batch alone) then come from them.
        measured_sync_s: a probe's measured per-step synchronisation, seconds (its
            ``measured_step.sync_s``); when given it replaces the all-reduce model's exposed
            time for both splits.

    Raises:
        AllocationError: the batch is smaller than the world, a throughput is not positive ...
    """
    allreduce = ring_allreduce_s(gradient_bytes, len(throughputs), link_gbps, latency_s)
    balanced = allocate(throughputs, global_batch_size, caps, forced=forced, curves=curves)
    equal = equal_split(len(throughputs), global_batch_size, caps)
    ideal = (
        float(sum(throughputs))
        if curves is None
        else sum(
            global_batch_size / c.step_s(global_batch_size, cap) for c, cap in zip(curves, caps)
        )
    )

    def exposed(split: Allocation) -> float:
        if measured_sync_s is not None:
            return float(measured_sync_s)
        if overlap == "ddp":
            return ddp_exposed_allreduce_s(split, throughputs, allreduce, gradient_bytes, curves)
        return allreduce * (1.0 - float(overlap))

    return Prediction(
        throughputs=tuple(float(t) for t in throughputs),
        global_batch_size=int(global_batch_size),
        balanced=_timed(balanced, throughputs, exposed(balanced), curves),
        equal=_timed(equal, throughputs, exposed(equal), curves),
        allreduce_s=allreduce,
        exposed_allreduce_s=exposed(balanced),
        ideal_samples_per_s=ideal,
        no_overlap_samples_per_s=_timed(
            balanced, throughputs, max(allreduce, exposed(balanced)), curves
        ).samples_per_s,
        sync_measured=measured_sync_s is not None,
    )
