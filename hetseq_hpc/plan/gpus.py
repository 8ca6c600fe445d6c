"""GPU classes from vendor datasheets: peak TFLOP/s per precision and memory, by GRES type.

Peak figures, not measured ones: real training reaches a fraction of them (``plan.mfu``; see
:func:`hetseq_hpc.plan.cost_model.datasheet_throughput`). Every entry names its datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

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
    """The precision a rank on ``gpu`` trains in: ``bf16`` where the runtime enables bf16
    autocast (``trainer.precision`` auto/bf16 and compute capability >= 8.0, see
    ``hetseq_hpc.worker.precision_context``), else ``fp32``; ``peak="tensor"`` assumes the
    tensor-core dtype everywhere (fp16 on Volta/Turing)."""
    if peak == "tensor":
        return gpu.tensor_dtype
    if trainer_precision in ("auto", "bf16") and gpu.capability >= (8, 0):
        return "bf16"
    return "fp32"


def peak_tflops(gpu: GpuClass, precision: str) -> float:
    """Datasheet peak of ``gpu`` in ``precision`` (``fp32``, or its tensor-core dtype), TFLOP/s."""
    return gpu.fp32_tflops if precision == "fp32" else gpu.tensor_tflops
