"""GPU classes from vendor datasheets: peak TFLOP/s per precision and memory, by GRES type,
and the fraction of that peak real BERT training reaches per (class, precision).

Peak figures are datasheet ones; the achieved fractions (:data:`ACHIEVED`) come from published
MEASURED training throughput, converted with the model's training FLOPs: tensor-core and fp32
paths reach very different fractions of their peaks (V100: 0.43 of 125 TFLOP/s fp16, 0.77 of
15.7 fp32), so one ``plan.mfu`` for all gets ratios like A100:V100 wrong. Classes/precisions
without a measurement fall back to ``plan.mfu`` and the plan says so. Every entry names its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from hetseq_hpc.errors import ConfigError


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
_A6000 = ("NVIDIA RTX A6000 datasheet: tensor 309.7 TF sparse = 154.8 dense, FP32 38.7 TF, "
          "48 GB")

A100_40 = GpuClass("A100 40GB", (8, 0), 312.0, "bf16", 19.5, 40, _A100)
A100_80 = GpuClass("A100 80GB", (8, 0), 312.0, "bf16", 19.5, 80, _A100)
V100_16 = GpuClass("V100 16GB", (7, 0), 125.0, "fp16", 15.7, 16, _V100)
V100_32 = GpuClass("V100 32GB", (7, 0), 125.0, "fp16", 15.7, 32, _V100)
T4 = GpuClass("T4 16GB", (7, 5), 65.0, "fp16", 8.1, 16,
              "NVIDIA T4 datasheet: mixed-precision FP16 65 TF, FP32 8.1 TF, 16 GB")
A10 = GpuClass("A10 24GB", (8, 6), 125.0, "bf16", 31.2, 24,
               "NVIDIA A10 datasheet: BF16 125 TF dense (250 sparse), FP32 31.2 TF, 24 GB")
L4 = GpuClass("L4 24GB", (8, 9), 121.0, "bf16", 30.3, 24,
              "NVIDIA L4 datasheet: BF16 242 TF with sparsity = 121 dense, FP32 30.3 TF, 24 GB")
A40 = GpuClass("A40 48GB", (8, 6), 149.7, "bf16", 37.4, 48,
               "NVIDIA A40 datasheet: BF16 149.7 TF dense (299.4 sparse), FP32 37.4 TF, 48 GB")
RTX_A6000 = GpuClass("RTX A6000 48GB", (8, 6), 154.8, "bf16", 38.7, 48, _A6000)
H100_SXM = GpuClass("H100 SXM 80GB", (9, 0), 989.0, "bf16", 67.0, 80, _H100)
H200 = GpuClass("H200 141GB", (9, 0), 989.0, "bf16", 67.0, 141,
                "NVIDIA H200 datasheet: BF16 1979 TF sparse = 989 dense, FP32 67 TF, 141 GB")

#: GRES type (normalised by :func:`normalise_gpu_type`) -> GPU class.
GPU_TABLE: Dict[str, GpuClass] = {
    "a100": A100_40, "a10040": A100_40, "a10080": A100_80,
    "v100": V100_16, "v10016": V100_16, "v10032": V100_32,
    "t4": T4, "a10": A10, "l4": L4, "a40": A40,
    "rtxa6000": RTX_A6000, "a6000": RTX_A6000,
    "h100": H100_SXM, "h100sxm": H100_SXM, "h10080": H100_SXM,
    "h200": H200,
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
    """The datasheet entry of a GRES type; ``where`` names the config key in errors.

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
    """The precision a rank on ``gpu`` trains in under ``trainer_precision`` (or the rank's
    override): the runtime's own rule, :func:`hetseq_hpc.train.precision.resolve_precision`
    (auto = bf16 on compute capability >= 8.0, fp16 on 7.x, fp32 below); ``peak="tensor"``
    assumes the tensor-core dtype everywhere."""
    if peak == "tensor":
        return gpu.tensor_dtype
    from hetseq_hpc.train.precision import resolve_precision

    return resolve_precision(trainer_precision, "cuda", gpu.capability)[0]


def peak_tflops(gpu: GpuClass, precision: str) -> float:
    """Datasheet peak of ``gpu`` in ``precision`` (``fp32``, or a half type: the tensor-core
    peak; A100-class fp16 and bf16 peaks are equal), TFLOP/s."""
    return gpu.fp32_tflops if precision == "fp32" else gpu.tensor_tflops


#: Training FLOPs of one BERT-Large phase-1 sequence (T=128, 20 masked predictions, V=30522):
#: 3 x (2 x 12 L d^2 x T + 4 L T^2 d + 2 d V x 20) with L=24, d=1024 = 240.5 GFLOP (the
#: forward's matmuls, x3 for forward + backward).
BERT_LARGE_P1_FLOPS = 3 * (2 * 12 * 24 * 1024**2 * 128 + 4 * 24 * 128**2 * 1024
                           + 2 * 1024 * 30522 * 20)
_DLE = ("NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT README (pytorch:21.11 NGC), "
        "BERT-Large pre-training phase 1, seq 128, 1 GPU")


@dataclass(frozen=True)
class Achieved:
    """Measured training throughput of one (GPU class, precision) as a fraction of its peak.

    Attributes:
        fraction: ``samples_per_s x flops_per_sample / peak`` (T4: :func:`_relative_to_v100`).
        samples_per_s: the published measurement (sequences/s of the model ``source`` names).
        source: where it was published, and what was measured.
    """

    fraction: float
    samples_per_s: float
    source: str


def _measured(samples_per_s: float, peak: float, source: str) -> Achieved:
    return Achieved(samples_per_s * BERT_LARGE_P1_FLOPS / (peak * 1e12), samples_per_s, source)


#: (GPU family, precision) -> measured fraction of peak. "mixed precision" in the source is fp16
#: AMP; A100's bf16 runs the same tensor cores at the same 312 TFLOP/s peak and is taken at the
#: same fraction. No fp32 A100 entry: NVIDIA publishes TF32, which PyTorch leaves off for matmuls.
#: T4: see :data:`SQUAD_BASE_FP32_STEP_S`; fp32 only, so T4 in fp16 (what ``auto`` picks) still
#: runs at plan.mfu and the plan says so.
ACHIEVED: Dict[Tuple[str, str], Achieved] = {
    ("A100", "fp16"): _measured(580, 312.0, f"{_DLE}, DGX A100 80GB, mixed precision 580 seq/s"),
    ("A100", "bf16"): _measured(580, 312.0, f"{_DLE}, DGX A100 80GB, mixed precision 580 seq/s "
                                "(fp16 AMP; bf16 same peak)"),
    ("V100", "fp16"): _measured(224, 125.0, f"{_DLE}, DGX-1 V100 32GB, mixed precision 224 seq/s"),
    ("V100", "fp32"): _measured(50, 15.7, f"{_DLE}, DGX-1 V100 32GB, FP32 50 seq/s"),
}

#: Seconds per training step (1 GPU, local batch 11, fp32, sync excluded) of the SAME job on T4 and
#: V100: Hugging Face ``run_squad.py``, BERT-BASE SQuAD v1.1 fine-tuning, seq 384, no fp16. T4:
#: Pollux (OSDI'21) artifact, github.com/petuum/adaptdl simulator/traces/bert/placements.csv
#: (commit de25dcc; AWS g4dn.12xlarge, NGC pytorch:20.10); V100: Sia (SOSP'23) artifact,
#: github.com/siasosp23/artifacts sia-simulator/traces/bert/placements-azure.csv (commit
#: aaf7a0d; Azure ND40rs_v2, V100 SXM2 32GB, PyTorch 1.9). The only published measured T4
#: TRAINING throughput found (NVIDIA's tables give T4 inference only). 12.86 vs 33.31 seq/s:
#: T4/V100 = 0.386, not the datasheet's 8.1/15.7 = 0.52 (the 70 W T4 runs below its peak).
SQUAD_BASE_FP32_STEP_S = {"T4": 0.8552833199501038, "V100": 0.33023466169834137}
SQUAD_BASE_BATCH = 11


def _relative_to_v100(gpu: GpuClass) -> Achieved:
    """fp32 fraction of ``gpu`` = the table's V100 fp32 fraction x (its fraction / V100's
    fraction, both in :data:`SQUAD_BASE_FP32_STEP_S`): this source's own absolute fractions (T4
    0.34, V100 0.45 with BERT-base FLOPs) come from an unoptimised eager stack, DLE's V100 from
    NVIDIA's, and only the side-by-side RATIO carries over between stacks."""
    family, v100, step = gpu.label.split()[0], ACHIEVED[("V100", "fp32")], SQUAD_BASE_FP32_STEP_S
    samples_per_s = SQUAD_BASE_BATCH / step[family]
    fraction = v100.fraction * (step["V100"] / step[family]) * (V100_16.fp32_tflops / gpu.fp32_tflops)
    return Achieved(fraction, samples_per_s, (
        f"Pollux/Sia artifacts, BERT-BASE SQuAD fp32 (NOT DLE BERT-Large): {family} "
        f"{samples_per_s:.2f} seq/s vs V100 {SQUAD_BASE_BATCH / step['V100']:.2f}, "
        "scaled onto the DLE V100 fp32 fraction"))


ACHIEVED[("T4", "fp32")] = _relative_to_v100(T4)


def achieved_fraction(gpu: GpuClass, precision: str) -> Optional[Achieved]:
    """The measured fraction of peak for ``gpu`` (by family: A100 40/80GB share one) in
    ``precision``, or None when nothing was measured (use ``plan.mfu``)."""
    family = gpu.label.split()[0]
    return ACHIEVED.get((family, precision))
