"""Plan a heterogeneous run before submitting it: predicted split, step time and efficiency.

Usage::

    python -m hetseq_hpc.plan cluster=mixed task=bert [Hydra overrides] [plan.OPTION=VALUE ...]
    python -m hetseq_hpc.plan cluster=local cluster.ranks=3 cluster.speeds=[1,0.5,0.25]

The run configuration is composed and validated exactly as ``python -m hetseq_hpc`` does it
(same ``conf/``, same overrides), but nothing is launched: no process group, no job, no data
preparation. The planner prints, per partition and per rank class (ranks with the same
hardware and the same share), the samples per step, micro-batch x accumulation steps and the
predicted compute time, for the throughput-balanced split the runtime will compute and for an
equal split; then a summary; then ONE final JSON line with the headline figures
(``predicted_samples_per_s``, ``equal_split_samples_per_s``, ``ideal_samples_per_s``,
``efficiency``, ``speedup_vs_equal``, ``allreduce_share``, ``world_size``, ...).

Planner options (stripped from the command line before Hydra sees it, so they never touch
the run schema):

    plan.probe=PATH       allocation.json of an earlier run: use its measured per-rank
                          ``calibration`` (samples/s, memory) instead of the datasheet table.
                          SLURM clusters match ranks to partitions by ``partition`` name, then
                          by ``gres`` = ``gpu_type``; cluster=local matches by rank index.
    plan.link_gbps=100    network bandwidth per rank in Gbit/s for the all-reduce
                          (default 100 = InfiniBand EDR; 20 = loopback on cluster=local).
    plan.latency_us=10    per-message latency of one ring step, microseconds.
    plan.mfu=0.35         model FLOPs utilisation assumed against the datasheet peak, (0, 1].
    plan.overlap=ddp      how much all-reduce hides behind the backward pass: ``ddp`` (default)
                          models DDP's 25 MiB buckets overlapping the last micro-batch's
                          backward (Li et al., VLDB 2020); a number in [0, 1] fixes the hidden
                          share (0 = nothing overlaps, a lower bound, also printed).
    plan.peak=runtime     ``runtime``: the precision the runtime picks (trainer.precision=auto
                          -> bf16 tensor cores on compute capability >= 8.0, fp32 elsewhere);
                          ``tensor``: every GPU at its tensor-core peak (fp16 on V100/T4; what a
                          runtime with fp16 autocast + GradScaler could reach).

Cost model (all pure functions below; units in the names):

- throughput_i [samples/s] = measured (probe), or datasheet peak FLOP/s x MFU / training
  FLOPs per sample (:meth:`BertMaskedLM.flops_per_sample`, 3 x forward matmul FLOPs);
- memory cap_i = :func:`hetseq_hpc.calibrate.memory_cap`, the runtime's formula (memory x 0.9,
  static = 5 x parameter bytes, activation bytes per sample measured once on this CPU in fp32 with the
  saved-tensors hook of :mod:`hetseq_hpc.calibrate`, x its safety margin);
- split = :func:`hetseq_hpc.allocation.allocate` (what every rank computes at run time);
  comparison = :func:`hetseq_hpc.allocation.equal_split`;
- compute_i [s] = samples_i / throughput_i (accumulation overheads ignored);
  step [s] = max_i compute_i + exposed all-reduce (DDP's bucketed overlap by default, see
  :func:`ddp_exposed_allreduce_s`, or all-reduce x (1 - plan.overlap));
- ring all-reduce [s] = 2 (N-1)/N x gradient bytes / bandwidth + 2 (N-1) x latency
  (Thakur, Rabenseifner & Gropp, IJHPCA 2005; Patarasuk & Yuan, JPDC 2009); gradients are
  fp32 (parameters and all-reduced gradients stay fp32 under autocast);
- ideal [samples/s] = sum_i throughput_i (every device busy, no communication);
  efficiency = balanced / ideal; speedup = balanced / equal split;
  all-reduce share = exposed all-reduce / step.

Errors are one line naming the value and the fix, exit code 2.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.allocation import Allocation, allocate, equal_split, micro_batch_cap
from hetseq_hpc.env.hardware import read_meminfo, usable_cores
from hetseq_hpc.errors import AllocationError, ConfigError

#: bytes per parameter / gradient element (fp32 master weights and all-reduced gradients)
PARAM_BYTES = 4
#: defaults of the planner options
DEFAULT_MFU = 0.35
DEFAULT_LINK_GBPS = 100.0  # InfiniBand EDR, 4x 25 Gbit/s
DEFAULT_LOCAL_LINK_GBPS = 20.0  # gloo over loopback TCP on one machine, a rough figure
DEFAULT_LATENCY_US = 10.0
DEFAULT_OVERLAP = "ddp"
#: DDP's default bucket size (``bucket_cap_mb=25``)
DDP_BUCKET_BYTES = 25 * 2**20
#: share of a step's matmul FLOPs in the backward pass (2 of the 3 passes)
BACKWARD_SHARE = 2.0 / 3.0


# --------------------------------------------------------------------------- GPU datasheet table
@dataclass(frozen=True)
class GpuClass:
    """One GPU model from its vendor datasheet (peak figures, not measured).

    Attributes:
        label: display name.
        capability: CUDA compute capability (decides bf16 autocast at run time).
        tensor_tflops: datasheet peak DENSE tensor-core TFLOP/s (no sparsity) in ``tensor_dtype``.
        tensor_dtype: ``bf16`` or ``fp16`` (Volta/Turing have no bf16).
        fp32_tflops: datasheet peak fp32 (non-tensor) TFLOP/s; used when the runtime trains in
            fp32 (PyTorch leaves TF32 matmuls off by default).
        memory_gib: memory per GPU; the nominal "GB" figure, taken as GiB as nvidia-smi shows it.
        source: the datasheet.
    """

    label: str
    capability: Tuple[int, int]
    tensor_tflops: float
    tensor_dtype: str
    fp32_tflops: float
    memory_gib: float
    source: str


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TF dense, FP32 19.5 TF, 40/80 GB"
_V100 = "NVIDIA Tesla V100 datasheet (SXM2): FP16 tensor 125 TF, FP32 15.7 TF, 16/32 GB"
_H100 = "NVIDIA H100 datasheet (SXM5): BF16 989 TF dense (1979 sparse), FP32 67 TF, 80 GB"

#: GRES type (normalised: lower case, no '-', '_', ' ', no 'nvidia', trailing 'gb') -> GPU class.
#: Datasheet PEAK figures: real training reaches a fraction of them (``plan.mfu``).
GPU_TABLE: Dict[str, GpuClass] = {
    "a100": GpuClass("A100 40GB", (8, 0), 312.0, "bf16", 19.5, 40, _A100),
    "a10040": GpuClass("A100 40GB", (8, 0), 312.0, "bf16", 19.5, 40, _A100),
    "a10080": GpuClass("A100 80GB", (8, 0), 312.0, "bf16", 19.5, 80, _A100),
    "v100": GpuClass("V100 16GB", (7, 0), 125.0, "fp16", 15.7, 16, _V100),
    "v10016": GpuClass("V100 16GB", (7, 0), 125.0, "fp16", 15.7, 16, _V100),
    "v10032": GpuClass("V100 32GB", (7, 0), 125.0, "fp16", 15.7, 32, _V100),
    "t4": GpuClass("T4 16GB", (7, 5), 65.0, "fp16", 8.1, 16,
                   "NVIDIA T4 datasheet: mixed-precision FP16 65 TF, FP32 8.1 TF, 16 GB"),
    "a10": GpuClass("A10 24GB", (8, 6), 125.0, "bf16", 31.2, 24,
                    "NVIDIA A10 datasheet: BF16 125 TF dense (250 sparse), FP32 31.2 TF, 24 GB"),
    "l4": GpuClass("L4 24GB", (8, 9), 121.0, "bf16", 30.3, 24,
                   "NVIDIA L4 datasheet: BF16 242 TF with sparsity = 121 dense, FP32 30.3 TF, "
                   "24 GB"),
    "a40": GpuClass("A40 48GB", (8, 6), 149.7, "bf16", 37.4, 48,
                    "NVIDIA A40 datasheet: BF16 149.7 TF dense (299.4 sparse), FP32 37.4 TF, "
                    "48 GB"),
    "rtxa6000": GpuClass("RTX A6000 48GB", (8, 6), 154.8, "bf16", 38.7, 48,
                         "NVIDIA RTX A6000 datasheet: tensor 309.7 TF sparse = 154.8 dense, "
                         "FP32 38.7 TF, 48 GB"),
    "a6000": GpuClass("RTX A6000 48GB", (8, 6), 154.8, "bf16", 38.7, 48,
                      "NVIDIA RTX A6000 datasheet: tensor 309.7 TF sparse = 154.8 dense, "
                      "FP32 38.7 TF, 48 GB"),
    "h100": GpuClass("H100 SXM 80GB", (9, 0), 989.0, "bf16", 67.0, 80, _H100),
    "h100sxm": GpuClass("H100 SXM 80GB", (9, 0), 989.0, "bf16", 67.0, 80, _H100),
    "h10080": GpuClass("H100 SXM 80GB", (9, 0), 989.0, "bf16", 67.0, 80, _H100),
    "h200": GpuClass("H200 141GB", (9, 0), 989.0, "bf16", 67.0, 141,
                     "NVIDIA H200 datasheet: BF16 1979 TF sparse = 989 dense, FP32 67 TF, 141 GB"),
}


def normalise_gpu_type(gpu_type: str) -> str:
    """``"A100_80GB"`` -> ``"a10080"``: lower case, without ``nvidia``, separators and ``gb``."""
    key = "".join(ch for ch in str(gpu_type).lower() if ch.isalnum()).replace("nvidia", "")
    for suffix in ("gb", "g"):
        if key.endswith(suffix) and key[: -len(suffix)][-1:].isdigit():
            key = key[: -len(suffix)]
            break
    return key


def lookup_gpu(gpu_type: str, where: str) -> GpuClass:
    """The datasheet entry of a GRES type.

    Raises:
        ConfigError: the type is not in :data:`GPU_TABLE` (names the known ones).
    """
    entry = GPU_TABLE.get(normalise_gpu_type(gpu_type))
    if entry is None:
        known = ", ".join(sorted(GPU_TABLE))
        raise ConfigError(
            f"{where}={gpu_type!r} is not in the planner's GPU table (known: {known}): use one "
            "of those names, or measure it and pass plan.probe=RUN_DIR/allocation.json"
        )
    return entry


def runtime_precision(gpu: GpuClass, trainer_precision: str, peak: str = "runtime") -> str:
    """The precision a rank on ``gpu`` trains in: ``bf16`` where the runtime enables bf16
    autocast (``trainer.precision`` auto/bf16 and compute capability >= 8.0, see
    ``hetseq_hpc.worker.precision_context``), else ``fp32``; ``peak="tensor"`` assumes the
    tensor-core dtype everywhere (fp16 on Volta/Turing)."""
    if peak == "tensor":
        return gpu.tensor_dtype
    if trainer_precision in ("auto", "bf16") and gpu.capability >= (8, 0):
        return "bf16"
    return "fp32"


def datasheet_throughput(peak_tflops: float, mfu: float, flops_per_sample: float) -> float:
    """Samples/s of one device: ``peak_tflops * 1e12 * mfu / flops_per_sample``.

    Args:
        peak_tflops: datasheet peak, TFLOP/s.
        mfu: model FLOPs utilisation, fraction of the peak actually reached, (0, 1].
        flops_per_sample: training FLOPs (forward + backward) of one sample.
    """
    return peak_tflops * 1e12 * mfu / flops_per_sample


def memory_cap(memory_bytes: float, param_count: int, activation_bytes_per_sample: float,
               limit: Optional[int] = None) -> int:
    """Micro-batch cap of a device with ``memory_bytes`` and ``param_count`` fp32 parameters:
    the runtime's own formula, :func:`hetseq_hpc.calibrate.memory_cap`."""
    from hetseq_hpc.calibrate import memory_cap as runtime_memory_cap

    return runtime_memory_cap(memory_bytes, PARAM_BYTES * param_count,
                              activation_bytes_per_sample, limit)


def ring_allreduce_s(gradient_bytes: float, world_size: int, link_gbps: float,
                     latency_s: float) -> float:
    """Time of one ring all-reduce, seconds: ``2 (N-1)/N x bytes / (gbps x 1e9 / 8)
    + 2 (N-1) x latency`` (reduce-scatter then all-gather, 2 (N-1) steps of 1/N of the data;
    Thakur et al., IJHPCA 19(1) 2005; Patarasuk & Yuan, JPDC 69(2) 2009). 0 for one rank."""
    n = int(world_size)
    if n <= 1:
        return 0.0
    bandwidth = link_gbps * 1e9 / 8.0  # bytes/s
    return 2.0 * (n - 1) / n * gradient_bytes / bandwidth + 2.0 * (n - 1) * latency_s


@dataclass(frozen=True)
class SplitTime:
    """Predicted timing of one split. Times in seconds, throughput in samples/s."""

    allocation: Allocation
    compute_s: Tuple[float, ...]  # per rank, samples_i / throughput_i
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

    @property
    def world_size(self) -> int:
        return len(self.throughputs)

    @property
    def efficiency(self) -> float:
        """Balanced samples/s over the ideal (sum of standalone throughputs)."""
        return self.balanced.samples_per_s / self.ideal_samples_per_s

    @property
    def speedup_vs_equal(self) -> float:
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
            "efficiency_no_overlap": round(self.no_overlap_samples_per_s / self.ideal_samples_per_s, 4),
            "allocation_source": self.balanced.allocation.source,
        }


def ddp_exposed_allreduce_s(allocation: Allocation, throughputs: Sequence[float],
                            allreduce_s: float, gradient_bytes: float) -> float:
    """All-reduce time left after the last rank's compute, with DDP's bucketed overlap, seconds.

    DDP all-reduces gradients in buckets (``bucket_cap_mb=25``) as the backward pass fills them,
    in reverse layer order, overlapping communication with the rest of the backward (Li et al.,
    "PyTorch Distributed", VLDB 2020, sections 3.2.3-3.2.4). Under gradient accumulation only the
    LAST micro-batch's backward overlaps (``no_sync`` before it). With K buckets: rank i's bucket
    k is ready at ``end_i - (1 - (k+1)/K) x backward_i`` (``backward_i`` = 2/3 of its last
    micro-batch's time); a bucket's ring all-reduce (``allreduce_s / K``, bandwidth-bound) starts
    when every rank has it AND the previous bucket is done. Returns the time from the last rank's
    end of compute to the last bucket's end (one bucket = no overlap).
    """
    if allreduce_s <= 0:
        return 0.0
    k_buckets = max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
    ends = [b / t for b, t in zip(allocation.samples, throughputs)]
    backward = [BACKWARD_SHARE * share.micro_sizes[-1] / t
                for share, t in zip(allocation.shares, throughputs)]
    per_bucket = allreduce_s / k_buckets
    finish = float("-inf")
    for k in range(k_buckets):
        ready = max(end - (1.0 - (k + 1) / k_buckets) * bw for end, bw in zip(ends, backward))
        finish = max(ready, finish) + per_bucket
    return max(0.0, finish - max(ends))


def _timed(allocation: Allocation, throughputs: Sequence[float], exposed_s: float) -> SplitTime:
    compute = tuple(b / t for b, t in zip(allocation.samples, throughputs))
    step = max(compute) + exposed_s
    return SplitTime(allocation, compute, step, allocation.global_batch_size / step)


def predict(throughputs: Sequence[float], global_batch_size: int, caps: Sequence[int],
            gradient_bytes: float, link_gbps: float, latency_s: float = DEFAULT_LATENCY_US * 1e-6,
            overlap: Any = DEFAULT_OVERLAP, forced: Optional[Sequence[int]] = None) -> Prediction:
    """Predict the balanced split (the runtime's :func:`allocate`), an equal split and the ideal.

    Args:
        throughputs: standalone samples/s per rank.
        global_batch_size: samples per optimizer step.
        caps: micro-batch cap per rank (memory).
        gradient_bytes: bytes all-reduced per step.
        link_gbps: bandwidth per rank, Gbit/s.
        latency_s: latency per ring step, seconds.
        overlap: ``"ddp"`` (DDP's bucketed overlap, :func:`ddp_exposed_allreduce_s`) or a fixed
            share of the all-reduce hidden behind compute, [0, 1] (0 = a lower bound).
        forced: ``trainer.allocation`` if set (the runtime then uses it).

    Raises:
        AllocationError: the batch is smaller than the world, a throughput is not positive ...
    """
    allreduce = ring_allreduce_s(gradient_bytes, len(throughputs), link_gbps, latency_s)
    balanced = allocate(throughputs, global_batch_size, caps, forced=forced)
    equal = equal_split(len(throughputs), global_batch_size, caps)

    def exposed(split: Allocation) -> float:
        if overlap == "ddp":
            return ddp_exposed_allreduce_s(split, throughputs, allreduce, gradient_bytes)
        return allreduce * (1.0 - float(overlap))

    return Prediction(
        throughputs=tuple(float(t) for t in throughputs),
        global_batch_size=int(global_batch_size),
        balanced=_timed(balanced, throughputs, exposed(balanced)),
        equal=_timed(equal, throughputs, exposed(equal)),
        allreduce_s=allreduce,
        exposed_allreduce_s=exposed(balanced),
        ideal_samples_per_s=float(sum(throughputs)),
        no_overlap_samples_per_s=_timed(balanced, throughputs, allreduce).samples_per_s,
    )


# --------------------------------------------------------------------------- ranks of a cluster
@dataclass(frozen=True)
class PartitionSpec:
    """One partition (het component) as the planner sees it; cluster=local is one of these."""

    key: str  # name in cluster.partitions ("local" for cluster=local)
    partition: str  # Slurm partition name
    gpu_type: Optional[str]
    ranks: int
    memory_budget_gb: Optional[float] = None


@dataclass(frozen=True)
class RankSpec:
    """One rank's planning inputs."""

    rank: int
    partition: str  # PartitionSpec.key
    device: str  # display label, e.g. "A100 40GB bf16"
    samples_per_s: float
    max_micro_batch: int


def _probe_cap(rank: Dict[str, Any], limit: Optional[int], where: str) -> int:
    cal = rank.get("calibration") or {}
    keys = ("memory_budget_bytes", "static_bytes", "activation_bytes_per_sample")
    if all(k in cal for k in keys):
        # memory_budget_bytes already has the headroom applied (hetseq_hpc.calibrate)
        return micro_batch_cap(float(cal["memory_budget_bytes"]), float(cal["static_bytes"]),
                               float(cal["activation_bytes_per_sample"]), limit)
    if "max_micro_batch" in cal:
        cap = int(cal["max_micro_batch"])
        return min(cap, int(limit)) if limit is not None else cap
    raise ConfigError(f"{where} has no calibration memory figures (memory_budget_bytes, "
                      "static_bytes, activation_bytes_per_sample): pass the allocation.json "
                      "written by a hetseq_hpc run")


def _probe_throughput(rank: Dict[str, Any], where: str) -> float:
    try:
        value = float((rank.get("calibration") or {})["samples_per_s"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where} has no calibration.samples_per_s: pass the allocation.json "
                          "written by a hetseq_hpc run") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{where} has calibration.samples_per_s={value}: it must be > 0; "
                          "re-run the probe job")
    return value


def _probe_label(rank: Dict[str, Any]) -> str:
    probe = rank.get("probe") or {}
    if probe.get("kind") == "cuda" and probe.get("name"):
        return f"{str(probe['name']).replace('NVIDIA ', '')} (probe)"
    return f"{rank.get('device') or probe.get('name') or 'device'} (probe)"


def ranks_from_probe(probe: Dict[str, Any], partitions: Sequence[PartitionSpec],
                     by_index: bool = False, limit: Optional[int] = None) -> List[RankSpec]:
    """Planning inputs from an earlier run's ``allocation.json`` (its measured calibrations).

    SLURM partitions take the median samples/s and the smallest memory cap of the probe ranks
    of the same ``partition`` name (else of ``gres`` == ``gpu_type``); with ``by_index``
    (cluster=local) planned rank ``i`` takes probe rank ``i``.

    Raises:
        ConfigError: a partition has no matching probe rank, or the file lacks calibrations.
    """
    probe_ranks = probe.get("ranks")
    if not isinstance(probe_ranks, list) or not probe_ranks:
        raise ConfigError("plan.probe has no 'ranks' list: pass the allocation.json written by "
                          "a hetseq_hpc run")
    out: List[RankSpec] = []
    if by_index:
        total = sum(p.ranks for p in partitions)
        if len(probe_ranks) < total:
            raise ConfigError(f"plan.probe has {len(probe_ranks)} ranks but the plan needs "
                              f"{total}: probe with at least as many ranks, or lower cluster.ranks")
        part = partitions[0]
        for i in range(total):
            where = f"plan.probe rank {i}"
            out.append(RankSpec(i, part.key, _probe_label(probe_ranks[i]),
                                _probe_throughput(probe_ranks[i], where),
                                _probe_cap(probe_ranks[i], limit, where)))
        return out
    for part in partitions:
        matched = [r for r in probe_ranks if r.get("partition") == part.partition]
        if not matched and part.gpu_type:
            matched = [r for r in probe_ranks if r.get("gres") == part.gpu_type]
        if not matched:
            seen = sorted({f"{r.get('partition')}/{r.get('gres')}" for r in probe_ranks})
            raise ConfigError(
                f"plan.probe has no rank of partition {part.partition!r} (gres "
                f"{part.gpu_type!r}; it has partition/gres {', '.join(seen)}): probe a run that "
                "includes that partition, or drop plan.probe to use the datasheet table"
            )
        where = f"plan.probe partition {part.partition!r}"
        throughput = statistics.median(_probe_throughput(r, where) for r in matched)
        cap = min(_probe_cap(r, limit, where) for r in matched)
        label = _probe_label(matched[0])
        for _ in range(part.ranks):
            out.append(RankSpec(len(out), part.key, label, throughput, cap))
    return out


def ranks_from_table(partitions: Sequence[PartitionSpec], flops_per_sample: float,
                     param_count: int, activation_bytes_per_sample: float, mfu: float,
                     trainer_precision: str = "auto", peak: str = "runtime",
                     limit: Optional[int] = None) -> List[RankSpec]:
    """Planning inputs from :data:`GPU_TABLE`: datasheet peak x MFU / FLOPs per sample, and the
    memory cap of the datasheet memory (or the partition's ``memory_budget_gb``).

    Raises:
        ConfigError: a partition has no GPU type, or an unknown one.
    """
    out: List[RankSpec] = []
    for part in partitions:
        where = f"cluster.partitions.{part.key}.gpu_type"
        if not part.gpu_type:
            raise ConfigError(f"{where} is null (CPU-only nodes) and the datasheet table has only "
                              "GPUs: pass plan.probe=RUN_DIR/allocation.json from a run on them")
        gpu = lookup_gpu(part.gpu_type, where)
        precision = runtime_precision(gpu, trainer_precision, peak)
        tflops = gpu.fp32_tflops if precision == "fp32" else gpu.tensor_tflops
        throughput = datasheet_throughput(tflops, mfu, flops_per_sample)
        memory = (part.memory_budget_gb or gpu.memory_gib) * 2**30
        cap = memory_cap(memory, param_count, activation_bytes_per_sample, limit)
        for _ in range(part.ranks):
            out.append(RankSpec(len(out), part.key, f"{gpu.label} {precision}", throughput, cap))
    return out


# --------------------------------------------------------------------------- the model's numbers
@dataclass
class ModelInfo:
    """What the planner needs from the task's real model."""

    param_count: int
    flops_per_sample: float  # training FLOPs of one sample
    activation_bytes_per_sample: float = 0.0  # measured on the CPU (fp32), with safety margin
    cpu_samples_per_s: float = 0.0  # measured on the CPU (cluster=local only)
    vocab_size: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def gradient_bytes(self) -> float:
        return float(self.param_count * PARAM_BYTES)


def _synthetic_batch(n: int, seq_len: int, vocab_size: int, mask_prob: float):
    """``n`` random token rows masked by the task's own :func:`mask_sample`."""
    import numpy as np
    import torch

    from hetseq_hpc.tasks.bert.data import SPECIAL_TOKENS, mask_sample

    rng = np.random.default_rng(0)
    inputs, labels = [], []
    for i in range(n):
        row = rng.integers(len(SPECIAL_TOKENS), vocab_size, size=seq_len)
        x, y = mask_sample(row, vocab_size, mask_prob, 0, 0, "train", i)
        inputs.append(x)
        labels.append(y)
    return {"input_ids": torch.from_numpy(np.stack(inputs)),
            "labels": torch.from_numpy(np.stack(labels))}


def measure_model(task_cfg, need_activations: bool, cpu_calibration: Optional[dict] = None
                  ) -> ModelInfo:
    """Build the task's real model on the CPU (on ``meta`` when nothing is measured) and read
    its parameter count, training FLOPs per sample, and, if asked, the activation bytes of one
    sample (saved-tensors hook, forward passes at batch 1 and 2, x the runtime's safety margin).

    ``cpu_calibration`` = ``{"micro_batch", "steps", "threads", "budget_bytes"}`` instead runs
    :func:`hetseq_hpc.calibrate.calibrate` (timed forward+backward) for cluster=local.
    """
    import torch

    from hetseq_hpc.calibrate import ACTIVATION_SAFETY, saved_tensor_bytes
    from hetseq_hpc.tasks.bert.model import BertMaskedLM

    model_cfg, data_cfg = task_cfg.model, task_cfg.data
    vocab = int(data_cfg.vocab_size)
    seq = int(model_cfg.max_seq_len)
    masked = data_cfg.mask_prob * (seq - 2)  # as BertTask.flops_per_sample
    torch.manual_seed(0)
    if not need_activations and cpu_calibration is None:
        with torch.device("meta"):
            model = BertMaskedLM(model_cfg, vocab)
    else:
        model = BertMaskedLM(model_cfg, vocab)
    info = ModelInfo(param_count=sum(p.numel() for p in model.parameters()),
                     flops_per_sample=float(model.flops_per_sample(seq, masked)), vocab_size=vocab)
    make = lambda n: _synthetic_batch(n, seq, vocab, data_cfg.mask_prob)  # noqa: E731
    if cpu_calibration is not None:
        from hetseq_hpc.calibrate import calibrate

        threads = torch.get_num_threads()
        torch.set_num_threads(int(cpu_calibration["threads"]))
        try:
            cal = calibrate(model, make, torch.device("cpu"), int(cpu_calibration["micro_batch"]),
                            int(cpu_calibration["steps"]), float(cpu_calibration["budget_bytes"]))
        finally:
            torch.set_num_threads(threads)
        info.cpu_samples_per_s = cal.samples_per_s
        info.activation_bytes_per_sample = cal.activation_bytes_per_sample
    elif need_activations:
        model.train()
        saved = []
        for n in (1, 2):
            batch = make(n)
            loss, nbytes = saved_tensor_bytes(lambda: model(**batch))
            del loss
            saved.append(nbytes)
        info.activation_bytes_per_sample = max(saved[1] - saved[0], 0) * ACTIVATION_SAFETY
    return info


# --------------------------------------------------------------------------- options and config
@dataclass
class PlanOptions:
    """The ``plan.*`` command-line options (see the module docstring)."""

    probe: Optional[str] = None
    link_gbps: Optional[float] = None  # None = 100 (SLURM) or 20 (local)
    latency_us: float = DEFAULT_LATENCY_US
    mfu: float = DEFAULT_MFU
    overlap: Any = DEFAULT_OVERLAP  # "ddp" or a fraction in [0, 1]
    peak: str = "runtime"


def _number(key: str, value: str, ok, rule: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"plan.{key}={value!r} is not a number: give {rule}") from None
    if not (math.isfinite(number) and ok(number)):
        raise ConfigError(f"plan.{key}={value} is out of range: give {rule}")
    return number


def split_argv(argv: Sequence[str]) -> Tuple[List[str], PlanOptions]:
    """Separate ``plan.KEY=VALUE`` options from the Hydra overrides (``hydra.*`` are dropped:
    nothing is launched, so there is no run directory).

    Raises:
        ConfigError: an unknown ``plan.*`` key or a bad value.
    """
    opts = PlanOptions()
    overrides: List[str] = []
    for arg in argv:
        if not arg.startswith("plan."):
            if not arg.lstrip("+~").startswith("hydra."):
                overrides.append(arg)
            continue
        key, sep, value = arg[len("plan."):].partition("=")
        if not sep or not value:
            raise ConfigError(f"{arg!r} has no value: write plan.{key or 'KEY'}=VALUE")
        if key == "probe":
            opts.probe = value
        elif key == "link_gbps":
            opts.link_gbps = _number(key, value, lambda x: x > 0, "a bandwidth > 0 in Gbit/s, "
                                     "e.g. plan.link_gbps=100")
        elif key == "latency_us":
            opts.latency_us = _number(key, value, lambda x: x >= 0, "microseconds >= 0, e.g. "
                                      "plan.latency_us=10")
        elif key == "mfu":
            opts.mfu = _number(key, value, lambda x: 0 < x <= 1, "a fraction in (0, 1], e.g. "
                               "plan.mfu=0.35")
        elif key == "overlap":
            opts.overlap = "ddp" if value == "ddp" else _number(
                key, value, lambda x: 0 <= x <= 1, "ddp or a fraction in [0, 1], e.g. "
                "plan.overlap=0 for no overlap at all")
        elif key == "peak":
            if value not in ("runtime", "tensor"):
                raise ConfigError(f"plan.peak={value!r} is unknown: use runtime or tensor")
            opts.peak = value
        else:
            raise ConfigError(f"plan.{key} is not a planner option: use plan.probe, "
                              "plan.link_gbps, plan.latency_us, plan.mfu, plan.overlap or "
                              "plan.peak")
    return overrides, opts


def compose_run(overrides: Sequence[str]):
    """Compose ``conf/`` with ``overrides`` as ``python -m hetseq_hpc`` does, and validate it.

    Raises:
        ConfigError: a bad override or value (one line).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hetseq_hpc.config import CONF_DIR, register_configs, to_run_config

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(message) from None
    return to_run_config(cfg)


def partitions_of(run) -> List[PartitionSpec]:
    """The planner's view of ``run.cluster``: one spec per SLURM partition, or one for local."""
    from hetseq_hpc.config import planned_world_size

    cluster = run.cluster
    if cluster.name == "local":
        return [PartitionSpec("local", "local", None, planned_world_size(run),
                              cluster.memory_budget_gb)]
    return [PartitionSpec(key, part.partition, part.gpu_type, part.num_ranks,
                          getattr(part, "memory_budget_gb", None))
            for key, part in cluster.partitions.items()]


def _load_probe(path: str) -> Dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        file = file / "allocation.json"
    if not file.is_file():
        raise ConfigError(f"plan.probe={path!r} does not exist: pass the allocation.json of an "
                          "earlier run (or its run directory)")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"plan.probe={path!r} is not readable JSON ({exc}): pass an "
                          "allocation.json written by hetseq_hpc") from None


@dataclass
class Plan:
    """Everything :func:`render` prints."""

    cluster: str
    partitions: List[PartitionSpec]
    ranks: List[RankSpec]
    prediction: Prediction
    model: ModelInfo
    options: PlanOptions
    link_gbps: float
    source: str  # how the throughputs were obtained


def make_plan(run, opts: PlanOptions) -> Plan:
    """Inputs -> prediction, for a validated run configuration. Starts nothing.

    Raises:
        ConfigError: unknown GPU type, bad probe, a device that cannot fit one sample, or a
            batch that cannot be split.
    """
    parts = partitions_of(run)
    local = run.cluster.name == "local"
    limit = run.trainer.max_micro_batch
    link = opts.link_gbps or (DEFAULT_LOCAL_LINK_GBPS if local else DEFAULT_LINK_GBPS)
    if not local and opts.probe is None:
        for part in parts:  # fail on an unknown GPU before building the model
            if part.gpu_type:
                lookup_gpu(part.gpu_type, f"cluster.partitions.{part.key}.gpu_type")
    probe = _load_probe(opts.probe) if opts.probe else None
    if probe is not None:
        model = measure_model(run.task, need_activations=False)
        ranks = ranks_from_probe(probe, parts, by_index=local, limit=limit)
        source = f"measured calibration from {opts.probe}"
    elif local:
        world = parts[0].ranks
        threads = run.cluster.threads_per_rank or max(1, usable_cores() // world)
        budget = (run.cluster.memory_budget_gb * 2**30 if run.cluster.memory_budget_gb
                  else read_meminfo()[1] / world)
        micro = run.trainer.calibration_micro_batch or max(
            1, min(16, run.trainer.global_batch_size // world))
        model = measure_model(run.task, need_activations=True, cpu_calibration={
            "micro_batch": micro, "steps": run.trainer.calibration_steps, "threads": threads,
            "budget_bytes": budget})
        speeds = list(run.cluster.speeds) or [1.0] * world
        cap = memory_cap(budget, model.param_count, model.activation_bytes_per_sample, limit)
        ranks = [RankSpec(i, "local", f"cpu {threads} thr" + (f" @{s:g}" if s != 1 else ""),
                          model.cpu_samples_per_s * s, cap) for i, s in enumerate(speeds)]
        source = (f"measured on this CPU: {model.cpu_samples_per_s:.1f} samples/s at "
                  f"{threads} thread(s), micro-batch {micro}, x cluster.speeds")
    else:
        model = measure_model(run.task, need_activations=True)
        ranks = ranks_from_table(parts, model.flops_per_sample, model.param_count,
                                 model.activation_bytes_per_sample, opts.mfu,
                                 run.trainer.precision, opts.peak, limit)
        precision = ("as the runtime picks (bf16 on compute capability >= 8.0, else fp32)"
                     if opts.peak == "runtime"
                     else "tensor-core peak everywhere (plan.peak=tensor)")
        source = (f"datasheet peak x MFU {opts.mfu:g} (plan.mfu) / "
                  f"{model.flops_per_sample / 1e9:.2f} GFLOP per sample; precision {precision}")
    for spec in ranks:
        if spec.max_micro_batch < 1:
            raise ConfigError(
                f"rank {spec.rank} ({spec.partition}, {spec.device}) cannot fit one sample of "
                f"this model: shrink task.model, or leave partition {spec.partition!r} out")
    try:
        prediction = predict([r.samples_per_s for r in ranks], run.trainer.global_batch_size,
                             [r.max_micro_batch for r in ranks], model.gradient_bytes, link,
                             opts.latency_us * 1e-6, opts.overlap, run.trainer.allocation)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    return Plan(run.cluster.name, parts, ranks, prediction, model, opts, link, source)


# --------------------------------------------------------------------------- output
def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start, prev = [], None, None
    for i in sorted(ids):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(out)


def rank_classes(plan: Plan) -> List[Tuple[str, List[int]]]:
    """Ranks grouped by partition, then by identical inputs and shares, in rank order."""
    pred = plan.prediction
    groups: Dict[Tuple, List[int]] = {}
    for spec in plan.ranks:
        b = pred.balanced.allocation.shares[spec.rank]
        e = pred.equal.allocation.shares[spec.rank]
        key = (spec.partition, spec.device, spec.samples_per_s, spec.max_micro_batch,
               b.samples, b.micro_batch, b.accum_steps, e.samples, e.micro_batch, e.accum_steps)
        groups.setdefault(key, []).append(spec.rank)
    return [(key[0], ids) for key, ids in groups.items()]


def _ms(seconds: float) -> str:
    """Seconds as milliseconds, 4 significant digits."""
    return f"{seconds * 1e3:.4g}"


def render(plan: Plan) -> str:
    """The human-readable table and summary (without the final JSON line). Times in ms."""
    pred, model, opts = plan.prediction, plan.model, plan.options
    bal, eq = pred.balanced, pred.equal
    slowest = max(bal.compute_s)
    model_line = (f"model: {model.param_count / 1e6:.2f} M parameters, "
                  f"{model.flops_per_sample / 1e9:.3f} GFLOP/sample (training), vocab "
                  f"{model.vocab_size} (task.data.vocab_size)")
    if model.activation_bytes_per_sample:
        model_line += (f", activations {model.activation_bytes_per_sample / 2**20:.1f} MiB/sample"
                       " (fp32, this CPU, x1.5 margin)")
    lines = [
        f"hetseq_hpc plan: cluster={plan.cluster}, {pred.world_size} ranks in "
        f"{len(plan.partitions)} partition(s), global batch {pred.global_batch_size:,}",
        model_line,
        f"throughput: {plan.source}",
        "",
        "balanced = throughput-proportional split (hetseq_hpc.allocation.allocate), "
        "equal = same share per rank; times in ms",
    ]
    head = (f"{'partition':<10} {'device':<24} {'ranks':<12} {'n':>4} {'samples/s':>10} "
            f"{'cap':>6} | {'samples':>7} {'micro x acc':>11} {'compute':>9} {'busy':>5} | "
            f"{'equal':>6} {'micro x acc':>11} {'compute':>9}")
    lines += [head, "-" * len(head)]
    previous = None
    for part, ids in rank_classes(plan):
        spec, first = plan.ranks[ids[0]], ids[0]
        b, e = bal.allocation.shares[first], eq.allocation.shares[first]
        ranks = _ranges(ids)
        ranks = ranks if len(ranks) <= 12 else ranks[:10] + ".."
        lines.append(
            f"{(part if part != previous else ''):<10} {spec.device[:24]:<24} {ranks:<12} "
            f"{len(ids):>4} {spec.samples_per_s:>10.1f} {spec.max_micro_batch:>6} | "
            f"{b.samples:>7} {f'{b.micro_batch} x {b.accum_steps}':>11} "
            f"{_ms(bal.compute_s[first]):>9} {bal.compute_s[first] / slowest:>5.0%} | "
            f"{e.samples:>6} {f'{e.micro_batch} x {e.accum_steps}':>11} "
            f"{_ms(eq.compute_s[first]):>9}")
        previous = part
    ideal_compute = pred.global_batch_size / pred.ideal_samples_per_s
    lines += [
        "",
        f"all-reduce: ring over {pred.world_size} ranks, {model.gradient_bytes / 1e6:.1f} MB fp32 "
        f"gradients, {plan.link_gbps:g} Gbit/s (plan.link_gbps), {opts.latency_us:g} us latency "
        f"(plan.latency_us) = {_ms(pred.allreduce_s)} ms; overlap "
        f"{opts.overlap if opts.overlap == 'ddp' else format(opts.overlap, 'g')} (plan.overlap) "
        f"-> {_ms(pred.exposed_allreduce_s)} ms exposed",
        "",
        f"{'':<24} {'step ms':>9} {'compute ms':>10} {'all-reduce ms':>13} {'samples/s':>12}",
        f"{'balanced (' + bal.allocation.source + ')':<24} {_ms(bal.step_s):>9} "
        f"{_ms(max(bal.compute_s)):>10} {_ms(pred.exposed_allreduce_s):>13} "
        f"{bal.samples_per_s:>12,.1f}",
        f"{'equal split':<24} {_ms(eq.step_s):>9} {_ms(max(eq.compute_s)):>10} "
        f"{_ms(eq.step_s - max(eq.compute_s)):>13} {eq.samples_per_s:>12,.1f}",
        f"{'ideal (sum standalone)':<24} {_ms(ideal_compute):>9} {_ms(ideal_compute):>10} "
        f"{'0':>13} {pred.ideal_samples_per_s:>12,.1f}",
        "",
        f"efficiency {pred.efficiency:.3f} of ideal | speedup {pred.speedup_vs_equal:.2f}x over "
        f"equal split | all-reduce {pred.allreduce_share:.1%} of the step | without any overlap: "
        f"efficiency {pred.no_overlap_samples_per_s / pred.ideal_samples_per_s:.3f}",
    ]
    return "\n".join(lines)


def _probe_model_warning(opts: PlanOptions, run) -> Optional[str]:
    """A one-line warning when the probe's run used a different model than this plan."""
    if not opts.probe:
        return None
    cfg_path = Path(opts.probe)
    cfg_path = (cfg_path if cfg_path.is_dir() else cfg_path.parent) / "hetseq_config.yaml"
    if not cfg_path.is_file():
        return None
    try:
        from dataclasses import asdict

        from omegaconf import OmegaConf

        probed = OmegaConf.to_container(OmegaConf.load(cfg_path).task.model)
        current = asdict(run.task.model)
    except Exception:  # noqa: BLE001 - only a warning
        return None
    diff = sorted(k for k in current if k in probed and probed[k] != current[k])
    if diff:
        return (f"hetseq-plan: warning: the probe run used a different model "
                f"({', '.join(f'{k}={probed[k]}' for k in diff)}): its throughputs may not apply")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hetseq_hpc.plan [overrides] [plan.*=...]``; exit 0, or 2 on a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        unknown = [a for a in argv if a.startswith("-")]
        if unknown:
            raise ConfigError(f"{unknown[0]!r} is not an option: pass Hydra overrides "
                              "(key=value) and plan.KEY=VALUE options; see --help")
        overrides, opts = split_argv(argv)
        run = compose_run(overrides)
        warning = _probe_model_warning(opts, run)
        if warning:
            print(warning, file=sys.stderr)
        plan = make_plan(run, opts)
    except ConfigError as exc:
        print(f"hetseq-plan: error: {exc}", file=sys.stderr)
        return 2
    print(render(plan))
    print(json.dumps(plan.prediction.headline()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
