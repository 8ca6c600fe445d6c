"""``plan`` for HetSeq's own hardware (TITAN Xp and P100 nodes, 4 GPUs each) from specs alone,
against HetSeq's README performance table (github.com/yifding/hetseq, README.md at afdb4b0,
"Performance table", BERT on nodes with 4 GPUs each): avg. time per step 2.60 s (1 node),
2.69 s (2), 2.794 s (4), 3.126 s (8).

The workload, from HetSeq's run scripts (STORE_RUN_FILE/Train_bert/*, docs/source/examples.rst):
BERT-base (uncased_L-12_H-768_A-12), phase-1 data (seq 128), ``--max-sentences 32
--update-freq 4`` = 128 samples per GPU per step, fp32 ("fp16 support" is on the README's
future list). Nodes: the BERT scripts name queues gpu@qa-xp-* (TITAN Xp) and gpu@qa-p100-*; the
8-node heterogeneous runs (Train_mnist/node8gpu32_het) use 4 xp + 4 p100 nodes, so 1, 2 and 4
nodes are planned as TITAN Xp and 8 as 4 + 4, HetSeq's equal split. The README names neither the
GPUs of the table nor the network: the link is taken as 10 Gbit/s Ethernet (an assumption).

Result (docs/planner-accuracy.md): the spec model predicts every step ~40 % SHORTER than HetSeq
measured (it rates a TITAN Xp at 98.6 BERT-base samples/s in fp32; HetSeq's 1-node step implies
49), so the absolute 15 % target is NOT met; the scaling from 1 to 8 nodes (step(N) / step(1))
is within 15 %.
"""

from __future__ import annotations

import pytest

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.plan.planner import make_plan

PUBLISHED_STEP_S = {1: 2.60, 2: 2.69, 4: 2.794, 8: 3.126}
BERT_BASE = ["task=bert", "task.model.hidden_size=768", "task.model.num_layers=12",
             "task.model.num_heads=12", "task.model.intermediate_size=3072",
             "task.data.vocab_size=30522", "plan.link_gbps=10"]


def _predicted_step_s(nodes: int) -> float:
    parts = (["cluster.partitions.xp.nodes=4", "cluster.partitions.p100.nodes=4"] if nodes == 8
             else [f"cluster.partitions.xp.nodes={nodes}", "~cluster.partitions.p100"])
    run = compose_run_config(["cluster=hetseq_seed", *BERT_BASE, *parts,
                              f"trainer.global_batch_size={128 * 4 * nodes}"])
    plan = make_plan(run)
    assert all("fp32 (specs" in r.device for r in plan.ranks)
    return plan.prediction.equal.step_s  # HetSeq splits equally


@pytest.fixture(scope="module")
def predicted():
    return {n: _predicted_step_s(n) for n in PUBLISHED_STEP_S}


def test_hetseq_hardware_plans_from_specs(predicted):
    assert all(step > 0 for step in predicted.values())


def test_hetseq_scaling_within_15_percent(predicted):
    for nodes, published in PUBLISHED_STEP_S.items():
        ratio = (predicted[nodes] / predicted[1]) / (published / PUBLISHED_STEP_S[1])
        assert abs(ratio - 1) <= 0.15, (nodes, predicted[nodes], published)


def test_hetseq_absolute_step_time_is_a_documented_miss(predicted):
    for nodes, published in PUBLISHED_STEP_S.items():
        assert -0.45 < predicted[nodes] / published - 1 < -0.35, (nodes, predicted[nodes])
