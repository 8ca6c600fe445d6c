"""The planner's per-(GPU class, precision) throughput against published MEASURED BERT training.

The table (hetseq_hpc.plan.gpus.ACHIEVED) is seeded from ONE measurement: NVIDIA
DeepLearningExamples, PyTorch BERT README (pytorch:21.11 NGC), BERT-Large pre-training phase 1
(seq 128), 1 GPU: A100 80GB mixed precision 580 seq/s; V100 32GB mixed 224, FP32 50. The
predicted ratios are checked against OTHER published measurements (within 25 %):

- same README, SQuAD fine-tuning (seq 384), 1 GPU: A100 mixed 110.5 seq/s; V100 mixed 52, FP32 12;
- same README, pre-training phase 2 (seq 512), 1 GPU: A100 mixed 210; V100 mixed 75, FP32 19;
- Lambda deeplearning-benchmark (github.com/lambdal/deeplearning-benchmark,
  pytorch/pytorch-train-throughput-fp16.csv / -fp32.csv, commit 4e11f68 of 2024-07-24),
  bert_large_squad, 1 GPU: A100 80GB SXM4 fp16 152; V100 16GB fp16 57, fp32 12.

T4 (fp32 only; NOT the DLE BERT-Large measurement, a DIFFERENT model): the one published measured
T4 TRAINING throughput found is the same Hugging Face run_squad.py job (BERT-BASE, SQuAD v1.1,
seq 384, fp32) profiled on 1 T4 (Pollux OSDI'21 artifact, github.com/petuum/adaptdl
simulator/traces/bert/placements.csv, commit de25dcc, AWS g4dn.12xlarge) and on 1 V100 SXM2 32GB
(Sia SOSP'23 artifact, github.com/siasosp23/artifacts sia-simulator/traces/bert/placements-azure.csv,
commit aaf7a0d, Azure ND40rs_v2), seconds per step at local batch 4/6/8/11:
T4 0.4553/0.5694/0.7033/0.8553, V100 0.1917/0.2330/0.2750/0.3302 -> T4/V100 = 0.42/0.41/0.39/0.386.
The table's T4 fp32 entry is scaled from the batch-11 ratio, so the T4 check below is a
consistency check (the planner reproduces that published ratio), not an independent validation.
T4 in fp16 (what precision.default=auto picks) has no measurement and stays at plan.mfu.
"""

from __future__ import annotations

import pytest

from hetseq_hpc.balance.placement import plan_placements
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.plan.gpus import (
    ACHIEVED,
    BERT_LARGE_P1_FLOPS,
    SQUAD_BASE_BATCH,
    SQUAD_BASE_FP32_STEP_S,
    lookup_gpu,
)
from hetseq_hpc.plan.inputs import ranks_from_table

WITHIN = 0.25
PUBLISHED = {
    "a100_bf16_over_v100_fp16": {"DLE SQuAD": 110.5 / 52, "DLE phase 2": 210 / 75,
                                 "Lambda bert_large_squad": 152 / 57},
    "v100_fp16_over_v100_fp32": {"DLE SQuAD": 52 / 12, "DLE phase 2": 75 / 19,
                                 "Lambda bert_large_squad": 57 / 12},
}


def _throughput_by_partition(*overrides: str) -> dict:
    run = compose_run_config(["cluster=mixed", *overrides])
    specs = ranks_from_table(plan_placements(run, cores=8), BERT_LARGE_P1_FLOPS, 335_000_000,
                             50e6, run.plan.mfu)
    return {s.partition: s for s in specs}


def test_predicted_class_ratios_match_published_measurements():
    auto = _throughput_by_partition()  # precision.default=auto: A100 bf16, V100 fp16, T4 fp16
    v100_fp32 = _throughput_by_partition("precision.partitions.v100=fp32")["v100"]
    assert "bf16" in auto["a100"].device and "fp16" in auto["v100"].device
    assert "fp32" in v100_fp32.device
    predicted = {
        "a100_bf16_over_v100_fp16": auto["a100"].samples_per_s / auto["v100"].samples_per_s,
        "v100_fp16_over_v100_fp32": auto["v100"].samples_per_s / v100_fp32.samples_per_s,
    }
    for key, published in PUBLISHED.items():
        for where, ratio in published.items():
            off = predicted[key] / ratio - 1
            assert abs(off) <= WITHIN, f"{key}: predicted {predicted[key]:.2f}, {where} {ratio:.2f}"


def test_table_fractions_are_the_cited_measurements():
    """fraction x peak / FLOPs gives back the published samples/s (no fitted constants)."""
    for (family, precision), entry in ACHIEVED.items():
        if family == "T4":  # a different model, scaled onto V100's fraction: checked below
            continue
        gpu = lookup_gpu(family.lower(), "x")
        peak = gpu.fp32_tflops if precision == "fp32" else gpu.tensor_tflops
        assert entry.fraction * peak * 1e12 / BERT_LARGE_P1_FLOPS == pytest.approx(
            entry.samples_per_s)
        assert "DeepLearningExamples" in entry.source and 0 < entry.fraction < 1
    # tensor-core and fp32 paths reach very different fractions of their peaks
    assert ACHIEVED[("V100", "fp32")].fraction > 1.5 * ACHIEVED[("V100", "fp16")].fraction
    # T4 fp32 = V100 fp32 fraction x the published T4:V100 seq/s x the V100:T4 fp32 peak
    t4 = ACHIEVED[("T4", "fp32")]
    measured_ratio = SQUAD_BASE_FP32_STEP_S["V100"] / SQUAD_BASE_FP32_STEP_S["T4"]
    assert t4.fraction == pytest.approx(ACHIEVED[("V100", "fp32")].fraction * measured_ratio
                                        * 15.7 / 8.1)
    assert t4.samples_per_s == pytest.approx(SQUAD_BASE_BATCH / SQUAD_BASE_FP32_STEP_S["T4"])
    assert "BERT-BASE" in t4.source and 0 < t4.fraction < 1


def test_t4_over_v100_fp32_matches_published_measurement():
    """Predicted T4 fp32 / V100 fp32 throughput vs the published side-by-side measurement (module
    docstring: BERT-BASE SQuAD fine-tuning, Pollux + Sia artifacts; NOT the DLE BERT-Large
    model), within 25 % at every local batch both GPUs were profiled at. The T4 entry is scaled
    from the batch-11 ratio, so this checks consistency, not an independent prediction; it also
    shows the datasheet ratio (8.1/15.7 = 0.52) is 22-34 % too optimistic for the 70 W T4."""
    fp32 = _throughput_by_partition("precision.partitions.t4=fp32",
                                    "precision.partitions.v100=fp32")
    t4, v100 = fp32["t4"], fp32["v100"]
    assert "T4 16GB fp32 (table" in t4.device and "fp32 (table" in v100.device
    predicted = t4.samples_per_s / v100.samples_per_s
    published = {4: (0.45532354712486267, 0.19173000752925873),
                 6: (0.5693899691104889, 0.23304663598537445),
                 8: (0.7032617032527924, 0.27499839663505554),
                 11: (0.8552833199501038, 0.33023466169834137)}
    for batch, (t4_step_s, v100_step_s) in published.items():
        ratio = v100_step_s / t4_step_s  # same batch: seq/s ratio = inverse step-time ratio
        assert abs(predicted / ratio - 1) <= WITHIN, f"batch {batch}: {predicted:.3f} vs {ratio:.3f}"
    # the datasheet ratio (0.52) misses the largest common batch (0.386) by more than 25 %
    assert 8.1 / 15.7 / (published[11][1] / published[11][0]) - 1 > WITHIN


def test_unmeasured_class_says_it_runs_at_plan_mfu():
    t4 = _throughput_by_partition("plan.mfu=0.2")["t4"]
    assert "fp16" in t4.device and "plan.mfu 0.2: no measured figure" in t4.device
    assert t4.samples_per_s == pytest.approx(65.0e12 * 0.2 / BERT_LARGE_P1_FLOPS)
