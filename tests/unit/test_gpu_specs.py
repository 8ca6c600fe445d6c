"""The GPU spec model against published figures it was NOT fitted on (issue 25).

Fit: the 4 ``role=fit`` rows of hetseq_hpc/plan/data/published_bert.csv (NVIDIA DLE PyTorch BERT
README, pytorch:21.11, SQuAD, 1 GPU). Held out: every ``role=heldout`` row (DLE PyTorch 20.06
release, Lambda deeplearning-benchmark 2021 and 2024 snapshots, Pollux/Sia traces), URLs in the
file and in docs/planner-accuracy.md; ``role=republished`` rows repeat a measurement already in
the file and are not counted.

Each of the issue's bars is a test that asserts the bar. Where the model misses it today the
test is ``xfail(strict=True)`` with the measured value in its reason: the day the bar is met the
test passes, strict xfail turns that into a failure, and the marker must go (a miss cannot be
pinned in place, a fix cannot go unnoticed).
"""

from __future__ import annotations

import statistics

import pytest

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.plan import perf_model as pm
from hetseq_hpc.plan.gpu_specs import (
    SPEC_TABLE,
    find_spec,
    peak_flops,
    power_clock_factor,
    spec_from_probe,
)
from hetseq_hpc.plan.gpus import GPU_TABLE, lookup_gpu

WITHIN = 0.20
#: held-out classes whose median |error| misses the issue's 20 % today: the measured median
#: |error| and why (docs/planner-accuracy.md)
MISSED = {
    "A40 tf32": "26 %: over-predicted (+25, +28 %); its published TF32 runs slower than the RTX "
    "A6000's (62 vs 94-101 seq/s, the same GA102) while its fp16 is within 12 %",
    "GTX 1080 Ti fp32": "23 %: BERT-large at batch 2 runs far below the model (+39 %; base -7 %)",
    "RTX 4090 fp16": "32 %: under-predicted (-32, -32 %); cause not established",
    "RTX 4090 tf32": "27 %: under-predicted (-26, -27 %); cause not established",
    "T4 fp32": "23 %: one row (Pollux trace, +23 %) after the 70 W power-limit clock",
}


def _class_params():
    return [
        pytest.param(cls, marks=pytest.mark.xfail(strict=True, reason=MISSED[cls]))
        if cls in MISSED
        else cls
        for cls in sorted(pm.heldout_errors())
    ]


#: datasheet peaks, TFLOP/s (dense): (gpu, precision) -> value
DATASHEET = {
    ("v100", "fp16"): 125.0,
    ("v100", "fp32"): 15.7,
    ("t4", "fp16"): 65.0,
    ("t4", "fp32"): 8.1,
    ("a100", "bf16"): 312.0,
    ("a100", "fp32"): 19.5,
    ("a100", "tf32"): 156.0,
    ("a10", "bf16"): 125.0,
    ("a10", "fp32"): 31.2,
    ("a40", "bf16"): 149.7,
    ("a40", "fp32"): 37.4,
    ("rtxa6000", "bf16"): 154.8,
    ("rtxa6000", "fp32"): 38.7,
    ("l4", "bf16"): 121.0,
    ("l4", "fp32"): 30.3,
    ("h100", "bf16"): 989.0,
    ("h100", "fp32"): 67.0,
    ("h200", "bf16"): 989.0,
    ("h200", "fp32"): 67.0,
    ("l40s", "bf16"): 362.0,
    ("l40s", "fp32"): 91.6,
    ("titanxp", "fp32"): 12.15,
    ("p100", "fp32"): 9.3,
    ("rtx3090", "fp16"): 71.0,
    ("rtx3090", "fp32"): 35.6,
    ("rtx4090", "fp16"): 165.2,
    ("rtx4090", "fp32"): 82.6,
    ("titanrtx", "fp16"): 130.0,
    ("rtx2080ti", "fp32"): 13.4,
}


@pytest.mark.parametrize("key, precision", sorted(DATASHEET))
def test_peaks_from_specs_equal_the_datasheet(key, precision):
    spec = find_spec(key)
    assert spec is not None and spec.source
    assert spec.peak_flops(precision) / 1e12 == pytest.approx(DATASHEET[(key, precision)], rel=0.03)


def test_spec_table_covers_the_issue_list_and_every_row_names_its_source():
    for key in (
        "p100",
        "v10016",
        "v10032",
        "t4",
        "titanxp",
        "titanrtx",
        "rtx2080ti",
        "rtx3090",
        "rtx4090",
        "a10",
        "a40",
        "a10040",
        "a10080",
        "l4",
        "l40s",
        "h100",
        "h200",
        "rtxa6000",
    ):
        assert key in SPEC_TABLE and key in GPU_TABLE, key
    assert all("NVIDIA" in s.source for s in SPEC_TABLE.values())
    assert lookup_gpu("TITAN_Xp", "x").fp32_tflops == pytest.approx(12.1, abs=0.1)


def test_unknown_gpu_is_one_line_naming_the_known_ones_and_the_fix():
    with pytest.raises(ConfigError) as err:
        lookup_gpu("k80", "cluster.partitions.old.gpu_type")
    text = str(err.value)
    assert "\n" not in text and "k80" in text and "titanxp" in text and "plan.probe=" in text


@pytest.mark.parametrize(
    "nvml_name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100sxm"),  # read by pynvml on the lent H100, 2026-11-27
        ("NVIDIA H100 PCIe", "h100pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a10040"),
        ("NVIDIA A100-SXM4-80GB", "a10080"),
        ("NVIDIA A100-PCIE-40GB", "a100pcie"),
        ("NVIDIA A100 80GB PCIe", "a10080pcie"),
        ("Tesla V100-SXM2-16GB", "v100sxm2"),
        ("Tesla V100-SXM2-32GB", "v10032"),
        ("Tesla V100-PCIE-16GB", "v100pcie"),
        ("Tesla T4", "t4"),
        ("Tesla P100-PCIE-16GB", "p100"),
        ("Tesla P100-SXM2-16GB", "p100sxm2"),
        ("NVIDIA TITAN Xp", "titanxp"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10", "a10"),
        ("Quadro RTX 8000", "quadrortx8000"),
    ],
)
def test_product_names_as_nvml_reports_them_find_their_row(nvml_name, key):
    """A probe reads the NVML product name; the planner (and its bandwidth for a probed GPU)
    must find the same row as the GRES name."""
    assert find_spec(nvml_name) is SPEC_TABLE[key]
    assert lookup_gpu(nvml_name, "gpu").spec is SPEC_TABLE[key]
    probe = {
        "kind": "cuda",
        "name": nvml_name,
        "sm_count": SPEC_TABLE[key].sm_count,
        "sm_clock_mhz": 1500,
        "compute_capability": list(SPEC_TABLE[key].capability),
    }
    assert spec_from_probe(probe).bandwidth_gbs == SPEC_TABLE[key].bandwidth_gbs


def test_a_probed_gpu_in_no_table_gets_a_peak_from_its_facts():
    probe = {
        "kind": "cuda",
        "name": "NVIDIA Future GPU",
        "sm_count": 100,
        "sm_clock_mhz": 2000,
        "compute_capability": [9, 5],
        "memory_total_bytes": 96 * 2**30,
    }
    spec = spec_from_probe(probe)
    assert spec is not None and spec.memory_gib == 96 and "probe" in spec.source
    # rated as the newest known architecture (Hopper): 128 fp32 lanes, 4096 tensor FLOP/clk/SM
    assert spec.peak_flops("fp32") == pytest.approx(100 * 128 * 2 * 2000e6)
    assert spec.peak_flops("bf16") == pytest.approx(100 * 4096 * 2000e6)
    assert pm.predict_samples_per_s(spec, "bf16", 1e9) > 0  # no bandwidth: compute-bound
    assert spec_from_probe({"kind": "cpu"}) is None
    with pytest.raises(ConfigError, match="older than Pascal"):
        peak_flops((3, 7), 13, 875, "fp32")


def test_fit_uses_only_fit_rows_of_one_source():
    fit = [r for r in pm.published() if r.role == "fit"]
    assert len({r.source_url for r in fit}) == 1 and "DeepLearningExamples" in fit[0].source_url
    assert pm.fit_factors() == pm.FACTORS
    heldout = [r for r in pm.published() if r.role == "heldout"]
    assert heldout and all(r.source_url.startswith("https://github.com/") for r in heldout)
    assert not {r.source_url for r in heldout} & {r.source_url for r in fit}
    # changing a held-out figure cannot move the factors
    moved = tuple(
        r if r.role == "fit" else pm.Published(**{**r.__dict__, "samples_per_s": 1.0})
        for r in pm.published()
    )
    assert pm.fit_factors(moved) == pm.FACTORS


@pytest.mark.parametrize("cls", _class_params())
def test_heldout_median_abs_error_per_class_is_within_20_percent(cls):
    errors = pm.heldout_errors()[cls]
    median = statistics.median(abs(e) for e in errors)
    assert median <= WITHIN, f"{cls}: median |error| {median:.2f} ({len(errors)} rows)"


def test_every_documented_miss_is_a_class_of_the_data():
    assert set(MISSED) <= set(pm.heldout_errors())


def test_overall_median_over_all_heldout_rows():
    everything = [abs(e) for errs in pm.heldout_errors().values() for e in errs]
    assert len(everything) == 93 and statistics.median(everything) <= WITHIN


def test_republished_rows_are_not_counted_as_held_out():
    """DLE 20.06's V100 32G FP32 (12 seq/s, batch 8) is the fit row's measurement; Lambda 2024's
    V100 fp32 42 / 12 seq/s are its 2021 snapshot's. They are kept, marked, and not scored."""
    rows = pm.published()
    again = [r for r in rows if r.role == "republished"]
    assert len(again) == 3 and all(
        r.gpu.startswith("v100") and r.precision == "fp32" for r in again
    )
    fit = {(r.gpu, r.precision, r.model, r.batch, r.samples_per_s) for r in rows if r.role == "fit"}
    heldout = [r for r in rows if r.role == "heldout"]
    # no held-out row repeats a fit row's GPU, precision, model, batch and figure
    assert not [
        r for r in heldout if (r.gpu, r.precision, r.model, r.batch, r.samples_per_s) in fit
    ]
    assert sum(len(v) for v in pm.heldout_errors().values()) == len(heldout) == 93


def test_power_limited_t4_runs_below_its_boost_clock_from_specs_only():
    t4, v100 = find_spec("t4"), find_spec("v100")
    # 70 W against 40 SMs x 1590 MHz at the V100's 300 W / (80 SMs x 1530 MHz): cube root
    need = 300 * 40 * 1590 / (80 * 1530)
    assert power_clock_factor(t4) == pytest.approx((70 / need) ** (1 / 3))
    assert 0.7 < power_clock_factor(t4) < 0.8
    assert power_clock_factor(v100) == 1.0  # the reference itself
    for key in ("a100", "h100", "rtx4090", "l4", "titanxp"):  # no reference on their process
        assert power_clock_factor(find_spec(key)) == 1.0
    assert find_spec("t4").peak_flops("fp32") / 1e12 == pytest.approx(8.1, rel=0.03)  # peak kept


def test_a100_over_v100_ratio_within_20_percent():
    """A100:V100 fp16 over the three held-out sources that publish both: Lambda 2024 (A100 80GB
    SXM4 / V100 16GB, base and large), Lambda 2021 (A100 40GB SXM4 / V100 32GB), DLE 20.06
    (A100 40GB / V100 16GB SQuAD). Median |error| 7.4 % (+7, +1, -18, -14, -4 %) with the
    memory-bound operations counted; 14.4 % with memory time proportional to FLOPs."""
    per_source = [pm.heldout_ratio_errors(a, b, "fp16", src) for a, b, src in pm.A100_V100_PAIRS]
    assert all(per_source), pm.A100_V100_PAIRS  # every source publishes a pair
    errors = [e for errs in per_source for e in errs]
    assert len(errors) == 5
    assert statistics.median(abs(e) for e in errors) <= WITHIN, errors


def test_v100_over_t4_ratio_within_20_percent():
    """The one published side-by-side T4/V100 training pair (fp32, BERT-base SQuAD, Pollux + Sia
    traces): published V100/T4 = 2.59; the spec model with the T4's power-limited clock says
    2.43 (-6 %; 2.06, -21 %, at the boost clock)."""
    t4 = next(r for r in pm.published() if r.gpu == "t4")
    v100 = next(r for r in pm.published() if "siasosp23" in r.source_url)
    predicted = pm.predicted(v100) / pm.predicted(t4)
    published = v100.samples_per_s / t4.samples_per_s
    assert published == pytest.approx(2.59, abs=0.01)
    assert abs(predicted / published - 1) <= WITHIN


def test_pass_overhead_is_our_own_h100_calibration_per_parameter_tensor():
    """t0 = 31.9 ms for hetseq_hpc's BERT-base (202 parameter tensors) on an H100, scaled by the
    tensors of the published models; the fit reads the fit rows' rates net of it."""
    assert pm.pass_overhead_s(202) == pytest.approx(0.0319)
    assert pm.BERT_PARAM_TENSORS == {"base": 199, "large": 391}
    row = next(r for r in pm.published() if r.role == "fit" and r.precision == "fp32")
    # the fit reads the time of a sample net of the fixed time of its pass
    assert row.net_sample_s == pytest.approx(1 / row.samples_per_s - row.overhead_s / row.batch)
    assert row.net_sample_s < 1 / row.samples_per_s


def test_small_batches_pay_the_pass_overhead_large_ones_approach_the_rate():
    spec, flops = find_spec("a100"), pm.bert_flops("base", 384, 0)
    rate = pm.predict_samples_per_s(spec, "bf16", flops)
    t0 = pm.pass_overhead_s(pm.BERT_PARAM_TENSORS["base"])
    one = pm.predict_samples_per_s(spec, "bf16", flops, 1, t0)
    assert one == pytest.approx(1 / (t0 + 1 / rate))
    assert one < pm.predict_samples_per_s(spec, "bf16", flops, 32, t0) < rate
    assert pm.predict_samples_per_s(spec, "bf16", flops, 10**6, t0) == pytest.approx(rate, rel=1e-3)
    assert pm.predict_samples_per_s(spec, "bf16", flops, 32, 0.0) == pytest.approx(rate)


def test_the_two_factors_reproduce_every_fit_row_within_5_percent():
    """Two numbers (fraction of peak, fraction of bandwidth) fitted by least squares on four
    rows: each fit row is reproduced within 5 %, and both factors are physical fractions."""
    assert set(pm.FACTORS) == {"compute_fraction", "bandwidth_fraction"}
    assert 0 < pm.FACTORS["compute_fraction"] <= 1 and 0 < pm.FACTORS["bandwidth_fraction"] <= 1
    for row in (r for r in pm.published() if r.role == "fit"):
        assert abs(pm.predicted(row) / row.samples_per_s - 1) <= 0.05, row


def test_memory_bound_operations_are_counted_from_the_architecture():
    """6 accesses per operation: 11 on T x h, 2 on T x intermediate, 3 on heads x T x T."""
    assert pm.transformer_accesses(1, 8, 2, 4, 32) == 6 * (11 * 4 * 8 + 2 * 4 * 32 + 3 * 2 * 4 * 4)
    assert pm.transformer_accesses(2, 8, 2, 4) == 2 * pm.transformer_accesses(1, 8, 2, 4, 32)
    assert pm.bert_accesses("base", 384) == pm.transformer_accesses(12, 768, 12, 384)
    # a fused attention kernel writes no scores: its Q, K, V, O (and their gradients) instead
    assert pm.transformer_accesses(1, 8, 2, 4, 32, fused_attention=True) == (
        6 * (11 * 4 * 8 + 2 * 4 * 32) + 12 * 4 * 8
    )
    # bytes grow with the width, FLOPs with its square: BERT-large's memory share is smaller
    for key in ("a100", "v100", "rtx4090"):
        spec = find_spec(key)
        base = pm.sample_time_s(
            spec, "fp16", pm.bert_flops("base", 384, 0), pm.bert_accesses("base", 384)
        )
        large = pm.sample_time_s(
            spec, "fp16", pm.bert_flops("large", 384, 0), pm.bert_accesses("large", 384)
        )
        assert large[1] / sum(large) < base[1] / sum(base)
    # half precision moves half the bytes; no bandwidth (a probed GPU in no table): matmuls only
    a100 = find_spec("a100")
    half = pm.sample_time_s(a100, "bf16", 1e9, 1e8)[1]
    assert pm.sample_time_s(a100, "fp32", 1e9, 1e8)[1] == pytest.approx(2 * half)
    assert pm.accesses_from_activations(4e6) == pytest.approx(pm.ACCESSES_PER_SAVED_ELEMENT * 1e6)
