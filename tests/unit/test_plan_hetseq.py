"""``plan`` for HetSeq's own hardware (TITAN Xp and P100 nodes, 4 GPUs each) from specs alone,
against HetSeq's README performance table (github.com/yifding/hetseq, README.md at afdb4b0,
"Performance table", BERT on nodes with 4 GPUs each): avg. time per step 2.60 s (1 node),
2.69 s (2), 2.794 s (4), 3.126 s (8).

The missed bars are strict xfails with the measured values. The workload, the nodes, the
network assumption, the model and the results: docs/design/hetseq-comparison.md,
"Planning HetSeq's hardware against its published step times"; docs/planner-accuracy.md.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Optional

import pytest

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.plan.planner import make_plan

#: one worker runs the module (bare pytest's --dist loadgroup): its tests share one measurement
#: of HetSeq's BERT-base per process (~9 s), which a second worker would make again
pytestmark = pytest.mark.xdist_group("plan_hetseq")

REPO = Path(__file__).resolve().parents[2]
PUBLISHED_STEP_S = {1: 2.60, 2: 2.69, 4: 2.794, 8: 3.126}
#: hetseq_hpc's own BERT-base (masked-LM head on the masked tokens, fused LayerNorm)
OWN_BERT_BASE = [
    "task=bert",
    "task.model.hidden_size=768",
    "task.model.num_layers=12",
    "task.model.num_heads=12",
    "task.model.intermediate_size=3072",
    "task.data.vocab_size=30522",
]
#: the predictions at 10 Gbit/s today (s): error vs HetSeq's README
MEASURED = {
    1: "1.82 s vs 2.60 s (-30 %)",
    2: "2.20 s vs 2.69 s (-18 %)",
    4: "2.25 s vs 2.794 s (-20 %)",
    8: "2.34 s vs 3.126 s (-25 %)",
}
#: the scaling step(N)/step(1) predicted vs published where it misses (8 nodes: 1.287 vs 1.202,
#: +7 %, within)
SCALING = {2: "1.214 vs 1.035 (+17 %)", 4: "1.238 vs 1.075 (+15.2 %)"}


def hetseq_model(cache_dir: Optional[Path] = None) -> list:
    """Overrides that plan HetSeq's own BERT-base (examples/hetseq_bert.py) with hetseq_hpc's
    token cache in ``cache_dir`` (None: the user's cache)."""
    return [
        "task=custom",
        "task.target=examples.hetseq_bert.HetSeqBertTask",
        f"task.path={REPO}",
        *([f"+task.args.cache_dir={cache_dir}"] if cache_dir else []),
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> list:
    return hetseq_model(tmp_path_factory.mktemp("hetseq-token-cache"))


@functools.cache
def _composed_once(overrides: tuple) -> RunConfig:
    return compose_run_config(list(overrides))


def _composed(overrides: tuple) -> RunConfig:
    """A copy of the run config of ``overrides``, composed once (Hydra takes ~0.3 s a time;
    the probe's bisection plans the same config 25 times, the probe file changing under it)."""
    return copy.deepcopy(_composed_once(overrides))


def _plan(nodes: int, model: list, link_gbps: float = 10, probe: str = ""):
    parts = (
        ["cluster.partitions.xp.nodes=4", "cluster.partitions.p100.nodes=4"]
        if nodes == 8
        else [f"cluster.partitions.xp.nodes={nodes}", "~cluster.partitions.p100"]
    )
    run = _composed(
        (
            "cluster=hetseq_seed",
            *model,
            *parts,
            f"plan.link_gbps={link_gbps}",
            f"trainer.global_batch_size={128 * 4 * nodes}",
            # HetSeq's loader ran in 4 worker processes per GPU, beside it
            "plan.data_ms_per_sample=0",
            *([f"plan.probe={probe}"] if probe else []),
        )
    )
    plan = make_plan(run)
    if not probe:
        assert all("fp32 (specs" in r.device for r in plan.ranks)
    return plan


def _predicted_step_s(nodes: int, model: list, link_gbps: float = 10) -> float:
    return _plan(nodes, model, link_gbps).prediction.equal.step_s  # HetSeq splits equally


@pytest.fixture(scope="module")
def predicted(model):
    return {n: _predicted_step_s(n, model) for n in PUBLISHED_STEP_S}


def test_hetseq_hardware_plans_from_specs(predicted):
    assert all(step > 0 for step in predicted.values())


def test_one_node_all_reduce_runs_over_pcie_not_the_network(model):
    """4 GPUs in one node: the ring never leaves the node, so the network's speed is moot."""
    slow, fast = _plan(1, model, 1), _plan(1, model, 100)
    assert slow.prediction.allreduce_s == pytest.approx(fast.prediction.allreduce_s)
    assert slow.ring_gbps == pytest.approx(15.75 * 8)  # PCIe 3.0 x16, TITAN Xp spec row
    # 2 nodes: the 10 Gbit/s hop between them bounds the ring
    two = _plan(2, model, 10)
    assert two.ring_gbps == 10 and two.prediction.allreduce_s > 5 * fast.prediction.allreduce_s


def test_scaling_depends_on_the_network(model):
    """The scaling check is not vacuous: 1 and 100 Gbit/s predict different 2-node steps."""
    assert _predicted_step_s(2, model, 1) > 2 * _predicted_step_s(2, model, 100)


def test_hetseq_model_costs_what_its_code_does(model):
    """HetSeq's model is planned as any user's model (FLOPs counted, memory traffic from its
    saved activations), and the counts say what its source says: the masked-LM head on all 128
    positions (the FLOP formula of BERT-base with every position masked, within 1 %) and more
    memory traffic than hetseq_hpc's own BERT-base (unfused LayerNorm, logits of every
    position: 307 M element accesses per sample vs 177 M counted)."""
    from hetseq_hpc.plan.model_info import measure_model
    from hetseq_hpc.plan.perf_model import bert_accesses, bert_flops

    # the plans' own measurement (time_batches too): measured once per process, not again
    theirs = measure_model(
        compose_run_config(["cluster=hetseq_seed", *model]).task,
        need_activations=True,
        time_batches=True,
    )
    assert theirs.flops_per_sample == pytest.approx(bert_flops("base", 128, 128), rel=0.01)
    assert theirs.accesses_per_sample > 1.5 * bert_accesses("base", 128)
    ours = _plan(1, OWN_BERT_BASE).prediction.equal.step_s
    assert ours < 0.8 * _plan(1, model).prediction.equal.step_s


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param(
            n,
            marks=pytest.mark.xfail(
                strict=True,
                reason=f"step(N)/step(1) {SCALING[n]} "
                "at 10 Gbit/s: the 1-node step has no network time, N nodes have all of it",
            ),
        )
        if n in SCALING
        else n
        for n in (2, 4, 8)
    ],
)
def test_hetseq_scaling_within_15_percent(predicted, nodes):
    ratio = (predicted[nodes] / predicted[1]) / (PUBLISHED_STEP_S[nodes] / PUBLISHED_STEP_S[1])
    assert abs(ratio - 1) <= 0.15, (nodes, predicted[nodes])


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param(
            n,
            marks=pytest.mark.xfail(
                strict=True,
                reason=f"{MEASURED[n]}: the spec model "
                "rates a TITAN Xp at 77 samples/s of HetSeq's BERT-base in fp32, HetSeq's step implies 49",
            ),
        )
        for n in PUBLISHED_STEP_S
    ],
)
def test_hetseq_absolute_step_time_within_15_percent(predicted, nodes):
    assert abs(predicted[nodes] / PUBLISHED_STEP_S[nodes] - 1) <= 0.15, predicted[nodes]


def test_ring_link_is_the_slowest_hop():
    from hetseq_hpc.plan.step_time import ring_link_gbps

    assert ring_link_gbps([(1, 4, 126.0)], 10) == 126.0  # one node: inside it only
    assert ring_link_gbps([(2, 4, 126.0)], 10) == 10  # the network hop bounds it
    assert ring_link_gbps([(1, 8, 2400.0), (1, 4, 126.0)], 100) == 100
    assert ring_link_gbps([(2, 1, 126.0)], 25) == 25  # one GPU per node: network only
    assert ring_link_gbps([(1, 1, 126.0)], 25) == 25  # one rank: nothing to reduce


def _xp_probe(path, spec, rate: float) -> str:
    """A probe file of partition xp (the calibration ``hetseq-hpc probe`` writes: the cost
    curve and the micro-batch cap) whose per-sample time is the spec model's / ``rate``."""
    per_sample = spec.curve.per_sample_s / rate
    micro = spec.max_micro_batch
    calibration = {
        "samples_per_s": micro / (spec.curve.overhead_s + micro * per_sample),
        "max_micro_batch": micro,
        "overhead_s": spec.curve.overhead_s,
        "per_sample_s": per_sample,
        "step_fixed_s": spec.curve.step_fixed_s,
    }
    path.write_text(
        json.dumps(
            {
                "ranks": [
                    {
                        "rank": 0,
                        "partition": "xp",
                        "gres": "titan_xp",
                        "device": "cuda:0 TITAN Xp",
                        "calibration": calibration,
                    }
                ]
            }
        )
    )
    return str(path)


def one_node_probe(path, model: list) -> float:
    """Write to ``path`` the xp probe whose 1-node plan gives HetSeq's 2.60 s (bisection on
    the rate, 24 halvings); returns the rate (HetSeq's / the spec model's per-sample rate)."""
    spec = _plan(1, model).ranks[0]
    low, high = 0.05, 2.0
    for _ in range(24):
        rate = (low + high) / 2
        step = _plan(1, model, probe=_xp_probe(path, spec, rate)).prediction.equal.step_s
        low, high = (rate, high) if step > PUBLISHED_STEP_S[1] else (low, rate)
    rate = (low + high) / 2
    _xp_probe(path, spec, rate)
    return rate


def test_with_the_one_node_figure_as_a_probe_the_multi_node_steps_are_within_15_percent(
    tmp_path, model
):
    """HetSeq's 1-node step as the measurement of the xp partition: the probe's per-sample
    time is solved (bisection) so that the 1-node plan gives 2.60 s, then 2 and 4 xp nodes are
    planned from the probe and 8 nodes (4 xp + 4 p100) with p100 from the spec model scaled by
    the xp probe's ratio, HetSeq's equal split, 10 Gbit/s between nodes. All within 15 %
    (today +7.5 / +5.1 / -1.7 %). Not the issue's from-specs bar (that one misses, above): it
    shows where the miss is. At 1 Gbit/s the same plans miss by far, so the check is not
    vacuous about the network."""
    probe = tmp_path / "xp_probe.json"
    rate = one_node_probe(probe, model)
    assert 0.64 < rate < 0.72  # HetSeq's 1-node step implies 49 of the model's 77 samples/s
    eight = _plan(8, model, probe=str(probe))
    scale = re.search(r"p100 from GPU specs x ([0-9.]+)", eight.source)
    assert scale and float(scale.group(1)) == pytest.approx(rate, rel=0.01), eight.source
    for nodes in (1, 2, 4, 8):
        step = (
            eight if nodes == 8 else _plan(nodes, model, probe=str(probe))
        ).prediction.equal.step_s
        assert abs(step / PUBLISHED_STEP_S[nodes] - 1) <= 0.15, (nodes, step)
    slow = _plan(2, model, link_gbps=1, probe=str(probe)).prediction.equal.step_s
    assert slow / PUBLISHED_STEP_S[2] - 1 > 0.5, slow


def same_die_cross_check(model: list) -> dict:
    """HetSeq's TITAN Xp figure beside Lambda's held-out GTX 1080 Ti BERT-base fp32 row: both
    GP102, both fp32, both eager BERT-base training. Returns, for each (``hetseq``, ``lambda``),
    the achieved share of the GPU's fp32 peak (published samples/s x counted FLOPs per sample /
    peak FLOP/s), the memory traffic per FLOP (counted element accesses / FLOPs) and the spec
    model's error (predicted / published samples/s - 1)."""
    from hetseq_hpc.plan.gpu_specs import find_spec
    from hetseq_hpc.plan.model_info import measure_model
    from hetseq_hpc.plan.perf_model import predicted, published

    row = next(
        r
        for r in published()
        if r.role == "heldout"
        and r.gpu == "gtx1080ti"
        and r.precision == "fp32"
        and r.model == "base"
    )
    theirs = measure_model(
        compose_run_config(["cluster=hetseq_seed", *model]).task,
        need_activations=True,
        time_batches=True,
    )
    hetseq_rate = 128 / PUBLISHED_STEP_S[1]  # samples/s per GPU: 128 per GPU per 2.60 s step
    predicted_rate = 128 / _predicted_step_s(1, model)
    xp = find_spec("titan_xp").peak_flops("fp32")
    return {
        "hetseq": {
            "peak_share": hetseq_rate * theirs.flops_per_sample / xp,
            "accesses_per_flop": theirs.accesses_per_sample / theirs.flops_per_sample,
            "error": predicted_rate / hetseq_rate - 1,
        },
        "lambda": {
            "peak_share": row.samples_per_s * row.flops / row.spec.peak_flops("fp32"),
            "accesses_per_flop": row.accesses / row.flops,
            "error": predicted(row) / row.samples_per_s - 1,
        },
    }


def test_hetseq_and_lambda_disagree_on_the_same_die(model):
    """Why the absolute bar is missed, from published data alone: on the same GP102 die, in
    fp32, for workloads of the same memory traffic per FLOP (within 10 %), Lambda's GTX 1080 Ti
    reaches 1.5x the share of peak that HetSeq's TITAN Xp step implies (52 % vs 35 %). The spec
    model sits between them: -7 % on Lambda's row (held out, within the bar), +43 % on HetSeq's
    rate. A per-GPU rate that met HetSeq's table would miss Lambda's row by about as much."""
    check = same_die_cross_check(model)
    hetseq, lam = check["hetseq"], check["lambda"]
    assert hetseq["accesses_per_flop"] == pytest.approx(lam["accesses_per_flop"], rel=0.10)
    assert lam["peak_share"] / hetseq["peak_share"] > 1.4
    assert -0.15 < lam["error"] < 0 and hetseq["error"] > 0.35
