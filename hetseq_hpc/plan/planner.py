"""From a validated run configuration to a :class:`Plan`: inputs, prediction, warnings.

Three sources of per-rank throughput, in this order: ``plan.probe`` (measured calibrations of an
earlier run), cluster=local (this CPU, calibrated as a local rank would), else the GPU spec
model (SLURM partitions, :mod:`hetseq_hpc.plan.perf_model`). A rank rated from specs also pays
the time of building its batches (:func:`with_batch_building`); measured ranks include it.
Starts nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, List, Optional, Tuple

from hetseq_hpc.balance.memory import PARAM_BYTES, model_state_bytes
from hetseq_hpc.balance.memory import memory_cap as device_memory_cap
from hetseq_hpc.balance.memory import param_memory_cap as memory_cap
from hetseq_hpc.config.plan import DEFAULT_LINK_GBPS, DEFAULT_LOCAL_LINK_GBPS, PlanConfig
from hetseq_hpc.errors import AllocationError, ConfigError
from hetseq_hpc.plan.gpu_specs import GPU_LINK_GBPS, find_spec
from hetseq_hpc.plan.inputs import (
    PartitionSpec,
    RankSpec,
    check_gpu_types,
    load_probe,
    partitions_of,
    probe_file,
    probe_partition_ranks,
    probe_sync_s,
    ranks_from_probe,
    ranks_from_table,
)
from hetseq_hpc.plan.model_info import CpuCalibration, ModelInfo, measure_model
from hetseq_hpc.plan.perf_model import FACTORS, pass_overhead_s, probe_samples_per_s
from hetseq_hpc.plan.sharding_plan import ModeFit, chosen_mode, mode_fits, planned_block_params
from hetseq_hpc.plan.step_time import Prediction, predict, ring_link_gbps
from hetseq_hpc.rundir.paths import RunDir

#: fewer samples per rank than this (on average) leaves most devices idle between all-reduces
MIN_SAMPLES_PER_RANK = 8
#: a predicted efficiency below this is worth a warning
MIN_EFFICIENCY = 0.5
#: largest global batch the small-batch warning suggests
MAX_SUGGESTED_BATCH = 2**22


@dataclass
class Plan:
    """Everything :func:`hetseq_hpc.plan.render.render` prints."""

    cluster: str  # the cluster config's name (cluster=mixed: "mixed")
    partitions: List[PartitionSpec]
    ranks: List[RankSpec]
    prediction: Prediction
    model: ModelInfo
    options: PlanConfig
    link_gbps: float  # the network between nodes (plan.link_gbps or its default)
    source: str  # how the throughputs were obtained
    warnings: List[str] = field(default_factory=list)  # one line each, for stderr
    sharding: str = "ddp"  # the mode the runtime would use (sharding.mode, auto resolved)
    configured_sharding: str = "none"  # sharding.mode as configured
    mode_fits: List[ModeFit] = field(default_factory=list)  # DDP and FSDP (memory known)
    ring_gbps: float = 0.0  # the all-reduce ring's slowest link (ring_gbps_of); 0 = link_gbps


def intra_node_gbps(gpu_type: Optional[str]) -> float:
    """Link between two ranks of one node, Gbit/s: the GPU's (PCIe or NVLink, from its spec
    row, :attr:`hetseq_hpc.plan.gpu_specs.GpuSpec.intra_node_gbps`; PCIe 3.0 x16 for a GPU in
    no table), or gloo over shared memory/loopback on CPU-only nodes
    (:data:`~hetseq_hpc.config.plan.DEFAULT_LOCAL_LINK_GBPS`)."""
    if not gpu_type:
        return DEFAULT_LOCAL_LINK_GBPS
    spec = find_spec(gpu_type)
    return spec.intra_node_gbps if spec else GPU_LINK_GBPS["pcie3"]


def ring_gbps_of(run, network_gbps: float) -> float:
    """The all-reduce ring's slowest link for ``run``'s cluster
    (:func:`hetseq_hpc.plan.step_time.ring_link_gbps`): traffic inside a node at the GPUs' link
    (a partition's ``intra_node_gbps``, else its GPU's spec), only cross-node hops at
    ``network_gbps``. cluster=local: ``network_gbps`` (loopback)."""
    if run.cluster.is_local:
        return float(network_gbps)
    groups = [
        (
            int(p.nodes),
            int(p.ranks_per_node_effective),
            float(p.intra_node_gbps)
            if getattr(p, "intra_node_gbps", None)
            else intra_node_gbps(p.gpu_type),
        )
        for p in run.cluster.partitions.values()
    ]
    return ring_link_gbps(groups, network_gbps)


def _local_ranks(run) -> Tuple[ModelInfo, List[RankSpec], str]:
    """cluster=local: calibrate the model on this CPU as a local rank does (the runtime's
    threads, calibration micro-batch and memory budget, :mod:`hetseq_hpc.balance.placement`), x each
    rank's emulated speed (``cluster.speeds``)."""
    from hetseq_hpc.balance.memory import memory_budget_bytes
    from hetseq_hpc.balance.placement import (
        calibration_micro_batch,
        plan_placements,
    )
    from hetseq_hpc.env.hardware import read_meminfo

    places = plan_placements(run)
    first = places[0]
    calib = CpuCalibration(
        micro_batch=calibration_micro_batch(run, len(places)),
        steps=run.balance.calibration_steps,
        threads=first.threads,
        budget_bytes=memory_budget_bytes(first, "cpu", read_meminfo()[1], first.ranks_on_node),
    )
    model = measure_model(run.task, need_activations=True, cpu_calibration=calib)
    budgets = [memory_budget_bytes(p, "cpu", read_meminfo()[1], p.ranks_on_node) for p in places]
    ranks = [
        RankSpec(
            p.rank,
            "local",
            f"cpu {p.threads} thr" + (f" @{p.emulate_speed:g}" if p.emulate_speed != 1 else ""),
            model.cpu_samples_per_s * p.emulate_speed,
            memory_cap(
                budget,
                model.param_count,
                model.activation_bytes_per_sample,
                run.balance.max_micro_batch,
            ),
            memory_bytes=budget,
        )
        for p, budget in zip(places, budgets)
    ]
    source = (
        f"measured on this CPU: {model.cpu_samples_per_s:.1f} samples/s at "
        f"{calib.threads} thread(s), micro-batch {calib.micro_batch}, x cluster.speeds"
    )
    return model, ranks, source


def with_batch_building(ranks: List[RankSpec], data_s_per_sample: float) -> List[RankSpec]:
    """Ranks rated from GPU specs, bounded by the host time of building their batches: a rank
    builds step k+1's batches on a background thread while step k runs
    (:class:`~hetseq_hpc.train.batches.BatchPrefetcher`), so ``data_s_per_sample``
    (:func:`hetseq_hpc.plan.model_info.batch_build_s`) overlaps the passes and bounds the rate
    only where it is the slower of the two: the cost curve's per-sample time and the rate's
    become ``max(compute, data)`` per sample. Measured ranks (a probe, this CPU) are timed
    by their own passes."""
    if data_s_per_sample <= 0:
        return list(ranks)
    return [
        replace(
            r,
            samples_per_s=1.0 / max(1.0 / r.samples_per_s, data_s_per_sample),
            curve=r.curve
            and replace(r.curve, per_sample_s=max(r.curve.per_sample_s, data_s_per_sample)),
        )
        for r in ranks
    ]


def _spec_ranks(
    placements, model: ModelInfo, opts: PlanConfig, limit: Optional[int]
) -> List[RankSpec]:
    """The GPU spec model's ranks for ``placements`` (:func:`ranks_from_table` with ``model``'s
    figures, ``limit`` = ``balance.max_micro_batch``) with their batch building
    (:func:`with_batch_building`)."""
    return with_batch_building(
        ranks_from_table(
            placements,
            model.flops_per_sample,
            model.param_count,
            model.activation_bytes_per_sample,
            opts.mfu,
            opts.peak,
            limit,
            model.param_tensors,
            model.accesses_per_sample,
        ),
        model.data_s_per_sample,
    )


def _data_time(model: ModelInfo, opts: PlanConfig) -> ModelInfo:
    """``model`` with ``plan.data_ms_per_sample`` as its batch-building time where it is set."""
    if opts.data_ms_per_sample is not None:
        model.data_s_per_sample = opts.data_ms_per_sample / 1e3
        model.data_from = "plan.data_ms_per_sample"
    return model


def _data_note(model: ModelInfo) -> str:
    """The source line's part for :func:`with_batch_building`."""
    if model.data_s_per_sample <= 0:
        return (
            "; no time for building batches (plan.data_ms_per_sample=0)"
            if model.data_from == "plan.data_ms_per_sample"
            else ""
        )
    return (
        f"; {model.data_s_per_sample * 1e3:.3f} ms per sample building batches "
        f"({model.data_from}; built a step ahead, beside the passes: a rank runs at the "
        "slower of the two; plan.data_ms_per_sample= sets it)"
    )


def _table_ranks(run, opts: PlanConfig) -> Tuple[ModelInfo, List[RankSpec], str]:
    """SLURM without a probe: the GPU spec model, memory cap from the spec memory."""
    from hetseq_hpc.balance.placement import plan_placements

    model = _data_time(measure_model(run.task, need_activations=True, time_batches=True), opts)
    placements = plan_placements(run)
    ranks = _spec_ranks(placements, model, opts, run.balance.max_micro_batch)
    requested = sorted({p.precision for p in placements})
    precision = (
        f"as the runtime picks from the requested {'/'.join(requested)} (auto: bf16 "
        "on compute capability >= 8.0, fp16 on 7.x, else fp32; per rank in the "
        "device column)"
        if opts.peak == "runtime"
        else "tensor-core peak everywhere (plan.peak=tensor)"
    )
    source = (
        f"GPU specs, not a probe: {model.flops_per_sample / 1e9:.2f} GFLOP per sample at "
        f"{FACTORS['compute_fraction']:.3f} of peak + {model.accesses_per_sample / 1e6:.1f} M "
        f"element accesses ({model.accesses_from}) at "
        f"{FACTORS['bandwidth_fraction']:.3f} of bandwidth, fitted on "
        f"DLE PyTorch BERT and checked on held-out figures (docs/planner-accuracy.md), "
        f"+ {pass_overhead_s(model.param_tensors) * 1e3:.1f} ms per micro-batch "
        f"({model.param_tensors} parameter tensors); precision {precision}; fp32 means "
        f"fp32, not TF32 (the runtime leaves TF32 off){_data_note(model)}"
    )
    return model, ranks, source


def _asymptotic_rate(rank: RankSpec) -> float:
    """A probed rank's samples/s without the fixed time per pass: ``1 / per_sample_s`` of its
    cost curve, or its measured samples/s when the probe has no curve."""
    return 1.0 / rank.curve.per_sample_s if rank.curve else rank.samples_per_s


def _probe_ranks(run, opts: PlanConfig, probe, parts) -> Tuple[ModelInfo, List[RankSpec], str]:
    """``plan.probe``: probed partitions use their measurements; a partition the probe lacks
    (a lab that probed its A100s first) comes from the GPU spec model, scaled by what the probe
    showed on this task: the median over the probed GPU partitions of measured / spec-model
    samples/s, both without the fixed time per pass (the probe's cost curve where it has one,
    :func:`_asymptotic_rate`; the spec ranks add the fixed time back). A probed GPU in no spec
    table is predicted from the probe's own SM count, clock and capability
    (:func:`hetseq_hpc.plan.gpu_specs.spec_from_probe`); the scale is 1 when no probed partition
    can be predicted. The source line says which partitions came from specs."""
    from hetseq_hpc.balance.placement import plan_placements

    limit = run.balance.max_micro_batch
    found = (
        {}
        if run.cluster.is_local
        else {p.key: probe_partition_ranks(probe, p, 0, limit) for p in parts}
    )
    missing = [p for p in parts if p.key in found and found[p.key] is None]
    if missing and len(missing) == len(parts):  # nothing matched: the old one-line refusal
        ranks_from_probe(probe, parts, limit=limit)
    for part in missing:
        if not part.gpu_type:
            raise ConfigError(
                f"plan.probe has no rank of partition {part.partition!r}, a CPU-only partition "
                "the GPU spec model cannot stand in for: probe it too (hetseq-hpc probe)"
            )
    if not missing:
        model = measure_model(run.task, need_activations=False)
        ranks = ranks_from_probe(probe, parts, by_index=run.cluster.is_local, limit=limit)
        return model, ranks, f"measured calibration from {opts.probe}"
    check_gpu_types(missing)
    model = _data_time(measure_model(run.task, need_activations=True, time_batches=True), opts)
    known = {p.key for p in parts if p.gpu_type and find_spec(p.gpu_type)}
    places = [pl for pl in plan_placements(run) if pl.partition_key in known]
    table: dict = {}
    for spec in _spec_ranks(places, model, opts, limit):
        table.setdefault(spec.partition, spec.samples_per_s)
    for part in parts:  # probed GPUs in no spec table: predicted from the probe's own facts
        if found[part.key] is not None and part.key not in table:
            rate = probe_samples_per_s(
                probe,
                part.partition,
                part.gpu_type,
                model.flops_per_sample,
                model.accesses_per_sample,
            )
            if rate:  # bounded by the batch building, as the table's ranks
                table[part.key] = 1.0 / max(1.0 / rate, model.data_s_per_sample)
    # like with like: the probe's per-sample rate (its cost curve, without the fixed time per
    # pass the spec ranks add back) against the spec model's; its samples/s without a curve
    ratios = [
        _asymptotic_rate(found[k][0]) / table[k]
        for k in found
        if found[k] is not None and k in table
    ]
    scale = statistics.median(ratios) if ratios else 1.0
    ranks: List[RankSpec] = []
    for part in parts:
        if found[part.key] is not None:
            specs = [replace(r, rank=len(ranks) + i) for i, r in enumerate(found[part.key])]
        else:
            t = _spec_ranks(
                [pl for pl in plan_placements(run) if pl.partition_key == part.key],
                model,
                opts,
                limit,
            )[0]
            curve = t.curve and replace(t.curve, per_sample_s=t.curve.per_sample_s / scale)
            specs = [
                replace(
                    t,
                    rank=len(ranks) + i,
                    samples_per_s=t.samples_per_s * scale,
                    curve=curve,
                    device=f"{t.device} x{scale:.2f}",
                )
                for i in range(part.ranks)
            ]
        ranks.extend(specs)
    probed = [k for k in found if found[k] is not None]
    basis = (
        f"the median of the probed partitions' measured / spec-model ratios "
        f"{', '.join(f'{r:.3g}' for r in ratios)}"
        if ratios
        else "no probed partition could be predicted from specs: unscaled"
    )
    source = (
        f"measured calibration from {opts.probe} for partition(s) {', '.join(probed)}; "
        f"{', '.join(p.key for p in missing)} from GPU specs x {scale:.3g} ({basis})"
        f"{_data_note(model)}"
    )
    return model, ranks, source


def make_plan(run, opts: Optional[PlanConfig] = None, label: Optional[str] = None) -> Plan:
    """Inputs -> prediction, for a validated run configuration. Starts nothing.

    Args:
        run: a :class:`~hetseq_hpc.config.RunConfig`.
        opts: planner options; default ``run.plan``.
        label: how the plan names the cluster: the config's name (``mixed`` for
            ``cluster=mixed``, :func:`hetseq_hpc.config.compose.group_choices`); default
            ``cluster.name`` (only its kind: ``local`` or ``slurm``).

    Raises:
        ConfigError: unknown GPU type, bad probe, a device that cannot fit one sample, or a
            batch that cannot be split.
    """
    opts = run.plan if opts is None else opts
    parts = partitions_of(run)
    local = run.cluster.is_local
    link = opts.link_gbps or (DEFAULT_LOCAL_LINK_GBPS if local else DEFAULT_LINK_GBPS)
    ring = ring_gbps_of(run, link)
    if not local and opts.probe is None:
        check_gpu_types(parts)  # fail on an unknown GPU before building the model
    measured_sync_s = None
    if opts.probe:
        probe = load_probe(opts.probe)
        model, ranks, source = _probe_ranks(run, opts, probe, parts)
        # a probe of another mix has no step sync to reuse
        measured_sync_s = None if "from GPU specs" in source else probe_sync_s(probe, len(ranks))
    elif local:
        model, ranks, source = _local_ranks(run)
    else:
        model, ranks, source = _table_ranks(run, opts)

    memory = [r.memory_bytes for r in ranks]
    known = all(m > 0 for m in memory)
    mode = (
        chosen_mode(run.sharding.mode, memory, model.param_count)
        if known
        else ("fsdp" if run.sharding.mode == "fsdp" else "ddp")
    )
    offload = bool(run.sharding.cpu_offload) and not local
    # the block FSDP gathers at once: the largest unit, or all of them where the runtime
    # groups them (sharding.units=one, or auto where a replica fits every rank)
    block_params = (
        planned_block_params(
            run.sharding.units,
            memory,
            model.param_count,
            model.largest_unit_params,
            model.root_params,
        )
        if known
        else model.largest_unit_params
    )
    if mode == "fsdp" and known and model.activation_bytes_per_sample > 0:
        # the caps a sharded rank has (the runtime's formula); a probe's own caps stand
        root = None if model.root_params is None else float(model.root_params) * PARAM_BYTES
        static = model_state_bytes(
            float(model.param_count) * PARAM_BYTES,
            "fsdp",
            len(ranks),
            float(block_params) * PARAM_BYTES,
            offload,
            gathered_weights=not model.evaluates_sharded,
            root_bytes=root,
        )
        ranks = [
            replace(
                r,
                max_micro_batch=device_memory_cap(
                    r.memory_bytes,
                    0.0,
                    model.activation_bytes_per_sample,
                    run.balance.max_micro_batch,
                    static,
                ),
            )
            for r in ranks
        ]
    for spec in ranks:
        if spec.max_micro_batch < 1:
            raise ConfigError(
                f"rank {spec.rank} ({spec.partition}, {spec.device}) cannot fit one sample of "
                f"this model: shrink task.model, shard it (sharding.mode=fsdp), or leave partition {spec.partition!r} out"
            )
    curves = [r.curve for r in ranks] if all(r.curve for r in ranks) else None

    def predict_at(batch: int, forced: Optional[List[int]] = None) -> Prediction:
        return predict(
            [r.samples_per_s for r in ranks],
            batch,
            [r.max_micro_batch for r in ranks],
            model.gradient_bytes,
            ring,
            opts.latency_s,
            opts.overlap,
            forced,
            curves,
            measured_sync_s,
        )

    try:
        prediction = predict_at(run.trainer.global_batch_size, run.balance.allocation)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    retry = None if run.balance.allocation else predict_at
    warnings = [w for w in (probe_model_warning(opts, run), batch_warning(prediction, retry)) if w]
    fits: List[ModeFit] = []
    if known and model.activation_bytes_per_sample > 0:
        passes = max(len(s.micro_sizes) for s in prediction.balanced.allocation.shares)
        fits = mode_fits(
            memory,
            model.param_count,
            block_params,
            model.activation_bytes_per_sample,
            prediction.balanced.step_s,
            prediction.allreduce_s,
            passes,
            offload,
            gathered_weights=not model.evaluates_sharded,
            root_params=model.root_params,
            # a model too large for a replica: auto shards its units one by one
            scaled_unit_params=(
                block_params if run.sharding.units == "one" else model.largest_unit_params
            ),
        )
    return Plan(
        label or run.cluster.name,
        parts,
        ranks,
        prediction,
        model,
        opts,
        link,
        source,
        warnings,
        mode,
        run.sharding.mode,
        fits,
        ring,
    )


def _good_enough(prediction: Prediction) -> bool:
    per_rank = prediction.global_batch_size / prediction.world_size
    return per_rank >= MIN_SAMPLES_PER_RANK and prediction.efficiency >= MIN_EFFICIENCY


def batch_warning(
    prediction: Prediction, predict_at: Optional[Callable[[int], Prediction]] = None
) -> Optional[str]:
    """One line when the global batch is too small for the mix: fewer than
    :data:`MIN_SAMPLES_PER_RANK` samples per rank on average, or a predicted efficiency below
    :data:`MIN_EFFICIENCY`; else None.

    ``predict_at(batch)`` (the same prediction at another global batch) lets the line name the
    smallest batch, doubling from the current one up to :data:`MAX_SUGGESTED_BATCH`, that clears
    both bars.
    """
    if _good_enough(prediction):
        return None
    world, batch = prediction.world_size, prediction.global_batch_size
    hint = "plan fewer ranks or a faster link (plan.link_gbps)"
    candidate = max(2 * batch, MIN_SAMPLES_PER_RANK * world)
    while predict_at is not None and candidate <= MAX_SUGGESTED_BATCH:
        try:
            bigger = predict_at(candidate)
        except AllocationError:  # a batch the allocator rejects: no suggestion
            break
        if _good_enough(bigger):
            hint = f"trainer.global_batch_size={candidate} predicts {bigger.efficiency:.2f}"
            break
        candidate *= 2
    return (
        f"global batch {batch:,} is small for {world} ranks ({batch / world:.1f} samples per "
        f"rank, predicted efficiency {prediction.efficiency:.2f}; aim for >= "
        f"{MIN_SAMPLES_PER_RANK} and >= {MIN_EFFICIENCY:g}): raise it, e.g. {hint}"
    )


def probe_model_warning(opts: PlanConfig, run) -> Optional[str]:
    """One line when the probe's run used a different model than this plan; else None.

    Raises:
        ConfigError: ``plan.probe`` does not exist (:func:`probe_file`).
    """
    if not opts.probe:
        return None
    cfg_path = RunDir(probe_file(opts.probe).parent).config  # the probe's run directory
    if not cfg_path.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        probed = OmegaConf.to_container(OmegaConf.load(cfg_path).task.model)
        current = asdict(run.task.model)
    except Exception:  # only a warning: an unreadable probe config is skipped
        return None
    diff = sorted(k for k in current if k in probed and probed[k] != current[k])
    if diff:
        return (
            f"the probe run used a different model "
            f"({', '.join(f'{k}={probed[k]}' for k in diff)}): its throughputs may not apply"
        )
    return None
