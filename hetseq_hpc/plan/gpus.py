"""GPU classes by GRES type, built from the spec table (:mod:`hetseq_hpc.plan.gpu_specs`): peak
TFLOP/s per precision and memory, plus the precision a rank trains in there.

Achieved throughput comes from :mod:`hetseq_hpc.plan.perf_model` (matmul time at a fraction of the
spec peak + memory-bound operations' time at a fraction of the spec bandwidth, two factors fitted
on one published source, validated on held-out ones: ``docs/planner-accuracy.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.plan.gpu_specs import SPEC_TABLE, GpuSpec, find_spec


@dataclass(frozen=True)
class GpuClass:
    """One GPU model, from its spec row (peak figures, not measured).

    Attributes:
        label: display name.
        capability: CUDA compute capability (decides bf16 autocast at run time).
        tensor_tflops: peak DENSE tensor-core TFLOP/s (no sparsity) in ``tensor_dtype``, fp32
            accumulate (half rate on GeForce parts); the fp16/fp32 non-tensor rate on Pascal.
        tensor_dtype: ``bf16`` or ``fp16`` (Volta/Turing/Pascal have no bf16).
        fp32_tflops: peak fp32 (CUDA-core) TFLOP/s: what an fp32 rank runs at, on Ampere and
            later too (the runtime leaves TF32 matmuls off).
        memory_gib: memory per GPU; the nominal "GB" figure, taken as GiB as nvidia-smi shows it.
        source: the datasheet / whitepaper.
        spec: the spec row (SMs, clocks, bandwidth) the figures come from.
    """

    label: str
    capability: Tuple[int, int]
    tensor_tflops: float
    tensor_dtype: str
    fp32_tflops: float
    memory_gib: float
    source: str
    spec: GpuSpec


def gpu_class(spec: GpuSpec) -> GpuClass:
    """The :class:`GpuClass` of a spec row (or of a probe's facts, ``spec_from_probe``)."""
    dtype = spec.tensor_dtype
    return GpuClass(
        spec.label,
        spec.capability,
        round(spec.peak_flops(dtype) / 1e12, 1),
        dtype,
        round(spec.peak_flops("fp32") / 1e12, 1),
        spec.memory_gib,
        spec.source,
        spec,
    )


#: GRES type (normalised by :func:`normalise_gpu_type`) -> GPU class
GPU_TABLE: Dict[str, GpuClass] = {key: gpu_class(spec) for key, spec in SPEC_TABLE.items()}


def known_gpu(gpu_type: str) -> Optional[GpuClass]:
    """The GPU class of a GRES type or an NVML product name, or None when no row has it."""
    spec = find_spec(gpu_type)
    return gpu_class(spec) if spec is not None else None


def lookup_gpu(gpu_type: str, where: str) -> GpuClass:
    """The GPU class of a GRES type, or of a product name as NVML reports it
    (``"NVIDIA H100 80GB HBM3"``); ``where`` names the config key in errors.

    Raises:
        ConfigError: the type is not in the spec table (one line naming the known ones).
    """
    entry = known_gpu(gpu_type)
    if entry is None:
        known = ", ".join(sorted(GPU_TABLE))
        raise ConfigError(
            f"{where}={gpu_type!r} is not in the planner's GPU spec table (known: {known}): use one "
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
    """Peak of ``gpu`` in ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``), TFLOP/s."""
    return gpu.spec.peak_flops(precision) / 1e12
