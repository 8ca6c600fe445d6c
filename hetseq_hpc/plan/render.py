"""The planner's printed output: the per-partition table, the summary and the JSON headline."""

from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

from hetseq_hpc.plan.planner import Plan


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
    """Ranks grouped by partition, then by identical inputs and shares, in rank order:
    ``[(partition key, [rank, ...]), ...]``."""
    pred = plan.prediction
    groups: Dict[Tuple, List[int]] = {}
    for spec in plan.ranks:
        b = pred.balanced.allocation.shares[spec.rank]
        e = pred.equal.allocation.shares[spec.rank]
        key = (
            spec.partition,
            spec.device,
            spec.samples_per_s,
            spec.max_micro_batch,
            b.samples,
            b.micro_batch,
            b.accum_steps,
            e.samples,
            e.micro_batch,
            e.accum_steps,
        )
        groups.setdefault(key, []).append(spec.rank)
    return [(key[0], ids) for key, ids in groups.items()]


def _ms(seconds: float) -> str:
    """Seconds as milliseconds, 4 significant digits."""
    return f"{seconds * 1e3:.4g}"


def _ring(plan) -> str:
    """The ring's bandwidth and where it comes from: the network (plan.link_gbps) or the
    GPUs' link inside a node (PCIe/NVLink from specs), whichever is slower."""
    ring = plan.ring_gbps or plan.link_gbps
    if ring == plan.link_gbps:
        return f"{ring:g} Gbit/s (plan.link_gbps, the network between nodes)"
    return (
        f"{ring:g} Gbit/s (the slowest link of the ring: GPUs inside a node over "
        f"PCIe/NVLink from specs; network {plan.link_gbps:g} Gbit/s, plan.link_gbps)"
    )


def _header(plan: Plan) -> List[str]:
    pred, model = plan.prediction, plan.model
    model_line = (
        f"model: {model.param_count / 1e6:.2f} M parameters, "
        f"{model.flops_per_sample / 1e9:.3f} GFLOP/sample (training)"
    )
    if model.vocab_size:
        model_line += f", vocab {model.vocab_size} ({model.vocab_from})"
    if model.activation_bytes_per_sample:
        model_line += (
            f", activations {model.activation_bytes_per_sample / 2**20:.1f} MiB/sample"
            " (fp32, this CPU, x1.5 margin)"
        )
    return [
        f"hetseq_hpc plan: cluster={plan.cluster}, {pred.world_size} ranks in "
        f"{len(plan.partitions)} partition(s), global batch {pred.global_batch_size:,}",
        model_line,
        f"throughput: {plan.source}",
        "",
        "balanced = throughput-proportional split (hetseq_hpc.balance.allocation.allocate), "
        "equal = same share per rank; times in ms",
    ]


def _table(plan: Plan) -> List[str]:
    """One line per rank class; the partition and device columns are as wide as their longest
    entry (no label is cut)."""
    bal, eq = plan.prediction.balanced, plan.prediction.equal
    slowest = max(bal.compute_s)
    classes = rank_classes(plan)
    part_w = max([len("partition")] + [len(str(part)) for part, _ in classes])
    dev_w = max([len("device")] + [len(plan.ranks[ids[0]].device) for _, ids in classes])
    head = (
        f"{'partition':<{part_w}} {'device':<{dev_w}} {'ranks':<12} {'n':>4} "
        f"{'samples/s':>10} {'cap':>6} | {'samples':>7} {'micro x acc':>11} {'compute':>9} "
        f"{'busy':>5} | {'equal':>6} {'micro x acc':>11} {'compute':>9}"
    )
    lines = [head, "-" * len(head)]
    previous = None
    for part, ids in classes:
        spec, first = plan.ranks[ids[0]], ids[0]
        b, e = bal.allocation.shares[first], eq.allocation.shares[first]
        ranks = _ranges(ids)
        ranks = ranks if len(ranks) <= 12 else ranks[:10] + ".."
        lines.append(
            f"{(part if part != previous else ''):<{part_w}} {spec.device:<{dev_w}} {ranks:<12} "
            f"{len(ids):>4} {spec.samples_per_s:>10.1f} {spec.max_micro_batch:>6} | "
            f"{b.samples:>7} {f'{b.micro_batch} x {b.accum_steps}':>11} "
            f"{_ms(bal.compute_s[first]):>9} {bal.compute_s[first] / slowest:>5.0%} | "
            f"{e.samples:>6} {f'{e.micro_batch} x {e.accum_steps}':>11} "
            f"{_ms(eq.compute_s[first]):>9}"
        )
        previous = part
    return lines


def _summary(plan: Plan) -> List[str]:
    pred, opts = plan.prediction, plan.options
    bal, eq = pred.balanced, pred.equal
    ideal_compute = pred.global_batch_size / pred.ideal_samples_per_s
    overlap = opts.overlap if opts.overlap == "ddp" else format(opts.overlap, "g")
    exposed = (
        f"the probe run measured {_ms(pred.exposed_allreduce_s)} ms per step beyond the "
        "slowest rank's work (exposed all-reduce, statistics exchange, jitter), used "
        "instead"
        if pred.sync_measured
        else f"overlap {overlap} (plan.overlap) -> {_ms(pred.exposed_allreduce_s)} ms exposed"
    )
    return [
        "",
        f"all-reduce: ring over {pred.world_size} ranks, {plan.model.gradient_bytes / 1e6:.1f} MB "
        f"fp32 gradients, {_ring(plan)}, {opts.latency_us:g} us "
        f"latency (plan.latency_us) = {_ms(pred.allreduce_s)} ms; {exposed}",
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
        f"efficiency {pred.efficiency_no_overlap:.3f}",
    ]


def render(plan: Plan) -> str:
    """The human-readable table and summary (without the final JSON line). Times in ms."""
    from hetseq_hpc.plan.sharding_plan import render_fits

    fits = (
        render_fits(plan.mode_fits, plan.configured_sharding, plan.sharding)
        if plan.mode_fits
        else []
    )
    return "\n".join(_header(plan) + _table(plan) + _summary(plan) + fits)


def headline_json(plan: Plan) -> str:
    """The final output line: :meth:`Prediction.headline` as JSON."""
    headline = plan.prediction.headline()
    headline["sharding"] = plan.sharding
    # batch building added per sample to the ranks rated from specs (0: none, or no such rank)
    headline["data_ms_per_sample"] = round(plan.model.data_s_per_sample * 1e3, 6)
    if plan.mode_fits:
        headline["modes"] = {f.mode: f.to_dict() for f in plan.mode_fits}
    return json.dumps(headline)
