"""The planner's inputs: partitions of the cluster config, and per-rank throughput and memory cap
from a probe (an earlier run's ``allocation.json``) or from the GPU spec model.

Probe matching: SLURM partitions take the median samples/s and the smallest memory cap of the
probe ranks of the same ``partition`` name, else of ``gres`` == ``gpu_type``; cluster=local
matches planned rank ``i`` to probe rank ``i``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from hetseq_hpc.balance.curves import MIN_PER_SAMPLE_S, CostCurve
from hetseq_hpc.balance.memory import micro_batch_cap
from hetseq_hpc.balance.memory import param_memory_cap as memory_cap
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.files.user_input import describe, file_problem, number, read_json_file
from hetseq_hpc.plan.gpus import lookup_gpu, runtime_precision
from hetseq_hpc.plan.perf_model import bound_label, pass_overhead_s, sample_time_s
from hetseq_hpc.rundir.paths import RunDir

if TYPE_CHECKING:  # pragma: no cover
    from hetseq_hpc.balance.placement import RankPlacement

_WRITTEN_BY_A_RUN = "pass the allocation.json written by a hetseq_hpc run"


@dataclass(frozen=True)
class PartitionSpec:
    """One partition (het component) as the planner sees it; cluster=local is one of these."""

    key: str  # name in cluster.partitions ("local" for cluster=local)
    partition: str  # Slurm partition name
    gpu_type: Optional[str]
    ranks: int


@dataclass(frozen=True)
class RankSpec:
    """One rank's planning inputs: throughput in samples/s, micro-batch cap in samples."""

    rank: int
    partition: str  # PartitionSpec.key
    device: str  # display label, e.g. "A100 40GB bf16"
    samples_per_s: float
    max_micro_batch: int
    curve: Optional[CostCurve] = None  # the probe's fitted cost curve (hetseq_hpc.balance.curves)
    memory_bytes: float = 0.0  # the rank's memory budget before the headroom; 0 = not known


def partitions_of(run) -> List[PartitionSpec]:
    """The planner's view of ``run.cluster``: one spec per SLURM partition, or one for local."""
    cluster = run.cluster
    if cluster.is_local:
        return [PartitionSpec("local", "local", None, cluster.planned_world_size())]
    return [
        PartitionSpec(key, part.partition, part.gpu_type, part.num_ranks)
        for key, part in cluster.partitions.items()
    ]


def probe_file(path: str) -> Path:
    """``plan.probe``'s file: the path itself, or ``allocation.json`` in it if a directory.

    Raises:
        ConfigError: the file does not exist or is not a regular file (a FIFO, a device).
    """
    file = Path(path)
    if file.is_dir():
        file = RunDir(file).allocation
    problem = file_problem(file)
    if problem:
        shown = repr(path) if file == Path(path) else f"{path!r} ({file})"
        raise ConfigError(
            f"plan.probe={shown} {problem}: pass the allocation.json of an "
            "earlier run (or its run directory), or a file hetseq-hpc probe wrote"
        )
    return file


def load_probe(path: str) -> Dict[str, Any]:
    """The parsed and checked (:func:`check_probe`) ``allocation.json`` named by ``plan.probe``.

    Raises:
        ConfigError: the file is missing, not a regular file, not strict JSON, or not shaped
            like a probe (one line naming the key).
    """
    file = probe_file(path)
    label = f"plan.probe={path!r}"
    return check_probe(read_json_file(file, label, _WRITTEN_BY_A_RUN), label)


#: calibration figures a probe rank may hold: (key, low, high, integer). Bounds keep the
#: planner's arithmetic finite (no overflow to inf); no real device comes near them.
_FIGURES = (
    ("samples_per_s", 1e-6, 1e15, False),
    ("micro_batch", 0, 2**31, True),
    ("max_micro_batch", 0, 2**31, True),
    ("memory_budget_bytes", -1e18, 1e18, False),
    ("static_bytes", 0, 1e18, False),
    ("activation_bytes_per_sample", 0, 1e18, False),
    ("overhead_s", 0, 1e6, False),
    ("per_sample_s", 0, 1e6, False),
    ("step_fixed_s", 0, 1e6, False),
)
_CURVE_KEYS = ("overhead_s", "per_sample_s")


def _check_figures(figures: Any, where: str, fix: str) -> None:
    if not isinstance(figures, dict):
        raise ConfigError(f"{where} is {describe(figures)}, not an object: {fix}")
    for key, low, high, integer in _FIGURES:
        if figures.get(key) is not None:
            number(figures[key], f"{where}.{key}", fix, low, high, integer)
    act = figures.get("activation_bytes_per_sample")
    if act is not None and 0 < act < 1:
        raise ConfigError(f"{where}.activation_bytes_per_sample={act:g} is below one byte: {fix}")


def _check_curve(curve: Any, where: str, fix: str) -> None:
    _check_figures(curve, where, fix)
    missing = [k for k in _CURVE_KEYS if curve.get(k) is None]
    if missing:
        raise ConfigError(
            f"{where} has no {' or '.join(missing)} (a cost curve needs "
            f"{', '.join(_CURVE_KEYS)}): {fix}"
        )
    if curve["per_sample_s"] < MIN_PER_SAMPLE_S:
        raise ConfigError(
            f"{where}.per_sample_s={curve['per_sample_s']:g} is below {MIN_PER_SAMPLE_S:g} s: {fix}"
        )


def _check_curves(curves: Any, where: str, fix: str) -> None:
    if curves is None:
        return
    if not isinstance(curves, list):
        raise ConfigError(f"{where} is {describe(curves)}, not a list: {fix}")
    for i, curve in enumerate(curves):
        _check_curve(curve, f"{where}[{i}]", fix)


def check_probe(
    data: Any, label: str = "plan.probe", fix: str = _WRITTEN_BY_A_RUN
) -> Dict[str, Any]:
    """Check the shape of a parsed probe file (a run's ``allocation.json`` or what
    ``hetseq-hpc probe`` writes) before anything reads it: an object with a non-empty
    ``ranks`` list of objects; their ``partition``/``gres``/``device`` strings or null; every
    ``calibration`` figure a finite number in range (:data:`_FIGURES`); a calibration with
    ``per_sample_s`` > 0 and every entry of ``fitted_curves`` / ``allocation.curves`` a full cost
    curve; ``measured_step.sync_s`` a number of seconds. Returns ``data``.

    Raises:
        ConfigError: one line naming ``label`` and the offending key, ending with ``fix``.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"{label} holds {describe(data)}, not an object with a 'ranks' list: {fix}"
        )
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ConfigError(f"{label} has no 'ranks' list: {fix}")
    for i, rank in enumerate(ranks):
        where = f"{label} ranks[{i}]"
        if not isinstance(rank, dict):
            raise ConfigError(f"{where} is {describe(rank)}, not an object: {fix}")
        for key in ("partition", "gres", "device"):
            if rank.get(key) is not None and not isinstance(rank[key], str):
                raise ConfigError(f"{where}.{key} is {describe(rank[key])}, not a string: {fix}")
        if rank.get("probe") is not None and not isinstance(rank["probe"], dict):
            raise ConfigError(f"{where}.probe is {describe(rank['probe'])}, not an object: {fix}")
        cal = rank.get("calibration")
        if cal is not None:
            _check_figures(cal, f"{where}.calibration", fix)
            if (cal.get("per_sample_s") or 0) > 0:
                _check_curve(cal, f"{where}.calibration", fix)
    _check_curves(data.get("fitted_curves"), f"{label} fitted_curves", fix)
    allocation = data.get("allocation")
    if allocation is not None:
        if not isinstance(allocation, dict):
            raise ConfigError(f"{label} allocation is {describe(allocation)}, not an object: {fix}")
        _check_curves(allocation.get("curves"), f"{label} allocation.curves", fix)
    measured = data.get("measured_step")
    if measured is not None:
        if not isinstance(measured, dict):
            raise ConfigError(
                f"{label} measured_step is {describe(measured)}, not an object: {fix}"
            )
        if measured.get("sync_s") is not None:
            number(measured["sync_s"], f"{label} measured_step.sync_s", fix, -1e6, 1e6)
    return data


def _probe_cap(rank: Dict[str, Any], limit: Optional[int], where: str) -> int:
    cal = rank.get("calibration") or {}
    keys = ("memory_budget_bytes", "static_bytes", "activation_bytes_per_sample")
    if all(k in cal for k in keys):
        # memory_budget_bytes already has the headroom applied (hetseq_hpc.balance.calibrate)
        return micro_batch_cap(
            float(cal["memory_budget_bytes"]),
            float(cal["static_bytes"]),
            float(cal["activation_bytes_per_sample"]),
            limit,
        )
    if "max_micro_batch" in cal:
        cap = int(cal["max_micro_batch"])
        return min(cap, int(limit)) if limit is not None else cap
    raise ConfigError(
        f"{where} has no calibration memory figures (memory_budget_bytes, "
        f"static_bytes, activation_bytes_per_sample): {_WRITTEN_BY_A_RUN}"
    )


def _probe_memory(rank: Dict[str, Any]) -> float:
    """The probed rank's memory budget before the headroom (bytes; 0 when not recorded)."""
    from hetseq_hpc.balance.memory import MEMORY_HEADROOM

    planned = (rank.get("calibration") or {}).get("memory_budget_bytes")
    return float(planned) / MEMORY_HEADROOM if planned else 0.0


def _probe_throughput(rank: Dict[str, Any], where: str) -> float:
    try:
        value = float((rank.get("calibration") or {})["samples_per_s"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"{where} has no calibration.samples_per_s: {_WRITTEN_BY_A_RUN}"
        ) from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"{where} has calibration.samples_per_s={value}: it must be > 0; re-run the probe job"
        )
    return value


def probe_curve(probe: Dict[str, Any], index: int) -> Optional[CostCurve]:
    """Probe rank ``index``'s cost curve: the run's last refit (``fitted_curves``, written when
    it re-balanced online), else its allocation's curves, else the rank's calibration fit;
    None for a probe without fits (older runs: its samples/s are used)."""
    for found in (probe.get("fitted_curves"), (probe.get("allocation") or {}).get("curves")):
        if isinstance(found, list) and index < len(found):
            return CostCurve.from_dict(found[index])
    cal = (probe.get("ranks") or [{}])[index].get("calibration") or {}
    if float(cal.get("per_sample_s") or 0) > 0:
        return CostCurve.from_dict(cal)
    return None


def probe_sync_s(probe: Dict[str, Any], world_size: int) -> Optional[float]:
    """The probe run's measured per-step synchronisation in seconds (``measured_step.sync_s``,
    :func:`hetseq_hpc.train.metrics.measured_step_sync`), when it ran ``world_size`` ranks as
    the plan does (another world all-reduces differently: then None, and the all-reduce model
    is used)."""
    measured = probe.get("measured_step") or {}
    sync = measured.get("sync_s")
    if sync is None or len(probe.get("ranks") or []) != world_size:
        return None
    return max(float(sync), 0.0)


def _median_curve(curves: List[Optional[CostCurve]]) -> Optional[CostCurve]:
    if not curves or any(c is None for c in curves):
        return None
    return CostCurve(
        *(
            statistics.median(getattr(c, k) for c in curves)
            for k in ("overhead_s", "per_sample_s", "step_fixed_s", "host_s", "host_per_sample_s")
        )
    )


def _probe_label(rank: Dict[str, Any]) -> str:
    probe = rank.get("probe") or {}
    if probe.get("kind") == "cuda" and probe.get("name"):
        return f"{str(probe['name']).replace('NVIDIA ', '')} (probe)"
    return f"{rank.get('device') or probe.get('name') or 'device'} (probe)"


def ranks_from_probe(
    probe: Dict[str, Any],
    partitions: Sequence[PartitionSpec],
    by_index: bool = False,
    limit: Optional[int] = None,
) -> List[RankSpec]:
    """Planning inputs from an earlier run's ``allocation.json`` (its measured calibrations).

    Args:
        probe: the parsed file (:func:`load_probe`).
        partitions: the planned cluster (:func:`partitions_of`).
        by_index: cluster=local: planned rank ``i`` takes probe rank ``i``.
        limit: ``balance.max_micro_batch``.

    Raises:
        ConfigError: a partition has no matching probe rank, or the file lacks calibrations.
    """
    probe_ranks = probe.get("ranks")
    if not isinstance(probe_ranks, list) or not probe_ranks:
        raise ConfigError(f"plan.probe has no 'ranks' list: {_WRITTEN_BY_A_RUN}")
    out: List[RankSpec] = []
    if by_index:
        total = sum(p.ranks for p in partitions)
        if len(probe_ranks) < total:
            raise ConfigError(
                f"plan.probe has {len(probe_ranks)} ranks but the plan needs "
                f"{total}: probe with at least as many ranks, or lower cluster.ranks"
            )
        part = partitions[0]
        for i in range(total):
            where = f"plan.probe rank {i}"
            out.append(
                RankSpec(
                    i,
                    part.key,
                    _probe_label(probe_ranks[i]),
                    _probe_throughput(probe_ranks[i], where),
                    _probe_cap(probe_ranks[i], limit, where),
                    probe_curve(probe, i),
                    _probe_memory(probe_ranks[i]),
                )
            )
        return out
    for part in partitions:
        specs = probe_partition_ranks(probe, part, len(out), limit)
        if specs is None:
            seen = sorted({f"{r.get('partition')}/{r.get('gres')}" for r in probe_ranks})
            raise ConfigError(
                f"plan.probe has no rank of partition {part.partition!r} (gres "
                f"{part.gpu_type!r}; it has partition/gres {', '.join(seen)}): probe a run that "
                "includes that partition, or drop plan.probe to use the GPU spec model"
            )
        out.extend(specs)
    return out


def probe_partition_ranks(
    probe: Dict[str, Any], part: PartitionSpec, first_rank: int, limit: Optional[int] = None
) -> Optional[List[RankSpec]]:
    """The ranks of partition ``part`` from a probe (its ranks of the same Slurm partition,
    else of the same GRES type; the median throughput, the smallest cap), numbered from
    ``first_rank``; None when the probe has no such rank.

    Raises:
        ConfigError: a matching probe rank lacks its calibration figures.
    """
    probe_ranks = probe["ranks"]
    matched = [r for r in probe_ranks if r.get("partition") == part.partition]
    if not matched and part.gpu_type:
        matched = [r for r in probe_ranks if r.get("gres") == part.gpu_type]
    if not matched:
        return None
    where = f"plan.probe partition {part.partition!r}"
    throughput = statistics.median(_probe_throughput(r, where) for r in matched)
    cap = min(_probe_cap(r, limit, where) for r in matched)
    label = _probe_label(matched[0])
    curve = _median_curve([probe_curve(probe, probe_ranks.index(r)) for r in matched])
    memory = min(_probe_memory(r) for r in matched)
    return [
        RankSpec(first_rank + i, part.key, label, throughput, cap, curve, memory)
        for i in range(part.ranks)
    ]


def check_gpu_types(partitions: Sequence[PartitionSpec]) -> None:
    """Fail on an unknown GPU type before anything slow (building the model) happens.

    Raises:
        ConfigError: a ``gpu_type`` is not in the spec table.
    """
    for part in partitions:
        if part.gpu_type:
            lookup_gpu(part.gpu_type, f"cluster.partitions.{part.key}.gpu_type")


def ranks_from_table(
    placements: Sequence[RankPlacement],
    flops_per_sample: float,
    param_count: int,
    activation_bytes_per_sample: float,
    mfu: float,
    peak: str = "runtime",
    limit: Optional[int] = None,
    param_tensors: int = 0,
    accesses_per_sample: float = 0.0,
) -> List[RankSpec]:
    """Planning inputs of SLURM ranks from the GPU spec model.

    Per-sample time = :func:`hetseq_hpc.plan.perf_model.sample_time_s` of the rank's GPU in the
    precision it would train in (its requested ``precision``, :func:`runtime_precision`): the
    matmuls at a fitted fraction of peak plus the memory-bound operations at a fitted fraction
    of bandwidth (``docs/planner-accuracy.md``); the device label says how the time splits.
    Cost curve: that per-sample time plus the pass's fixed time
    (:func:`hetseq_hpc.plan.perf_model.pass_overhead_s` of ``param_tensors``) per micro-batch, so
    gradient accumulation costs what it costs. Memory cap = the runtime's formula on the rank's
    budget (:func:`hetseq_hpc.balance.placement.memory_budget_bytes`, with the spec memory standing in
    for the free GPU memory).

    Args:
        placements: every rank's placement (:func:`hetseq_hpc.balance.placement.plan_placements`).
        flops_per_sample: training FLOPs of one sample.
        param_count: model parameters (fp32).
        activation_bytes_per_sample: activation memory of one sample, bytes.
        mfu: ``plan.mfu`` (unused by the spec model; kept for the signature).
        peak: ``plan.peak``; limit: ``balance.max_micro_batch``.
        param_tensors: the model's parameter tensors (0: no fixed time per pass).
        accesses_per_sample: element accesses of a sample's memory-bound operations
            (:attr:`hetseq_hpc.plan.model_info.ModelInfo.accesses_per_sample`).

    Raises:
        ConfigError: a partition has no GPU type, or an unknown one.
    """
    from hetseq_hpc.balance.memory import memory_budget_bytes

    del mfu
    out: List[RankSpec] = []
    for place in placements:
        where = f"cluster.partitions.{place.partition_key}.gpu_type"
        if not place.gres:
            raise ConfigError(
                f"{where} is null (CPU-only nodes) and the spec model has only "
                "GPUs: pass plan.probe=RUN_DIR/allocation.json from a run on them"
            )
        gpu = lookup_gpu(place.gres, where)
        precision = runtime_precision(gpu, place.precision, peak)
        times = sample_time_s(gpu.spec, precision, flops_per_sample, accesses_per_sample)
        per_sample_s = sum(times)
        memory = memory_budget_bytes(place, "cuda", gpu.memory_gib * 2**30, place.ranks_on_node)
        cap = memory_cap(memory, param_count, activation_bytes_per_sample, limit)
        out.append(
            RankSpec(
                place.rank,
                place.partition_key,
                f"{gpu.label} {precision} (specs, {bound_label(times)})",
                1.0 / per_sample_s,
                cap,
                CostCurve(pass_overhead_s(param_tensors), per_sample_s),
                memory_bytes=memory,
            )
        )
    return out
