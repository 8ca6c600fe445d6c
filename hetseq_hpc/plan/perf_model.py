"""Achieved training throughput of any GPU from its specifications, with THREE numbers fitted on
ONE published source and checked on others it was not fitted on.

Model (eager PyTorch training code, the code path hetseq_hpc's trainer is): one forward+backward
pass of a micro-batch of ``m`` samples costs a fixed time plus a per-sample time,

    t(m) = t0(model) + m x FLOPs per sample / (FLOP/s achieved)

    FLOP/s achieved = min(peak(precision) x p x a, bandwidth x I(width))

- ``t0``: the pass's fixed cost (kernel launches, an under-filled GPU at small ``m``), taken as
  proportional to the model's parameter tensors (each one is a few kernels forward and backward):
  :data:`PASS_OVERHEAD_S_PER_TENSOR`, from hetseq_hpc's OWN calibration of BERT-base on an H100
  (docs/benchmarks.md, "On a GPU": t(m) = 31.9 ms + 0.243 ms x m, 202 parameter tensors), a
  measurement that is neither the fit source nor a held-out one;

- ``peak``: :mod:`hetseq_hpc.plan.gpu_specs` (SMs x FLOP/SM/clock x clock, per precision);
- ``p``: sustained over boost clock of a power-limited board (T4: 70 W), from its power limit
  and the fit's V100 (:func:`hetseq_hpc.plan.gpu_specs.power_clock_factor`; 1 for most GPUs);
- ``a``: the fraction of peak a compute-bound step reaches;
- ``I(width)``: FLOP per byte of memory traffic of the step, ``half`` (fp16/bf16 activations)
  or ``fp32`` (fp32 and TF32: fp32 activations, twice the bytes).

Fit (:func:`fit_factors`, :data:`FACTORS`) on the ``role=fit`` rows of ``data/published_bert.csv``
only: NVIDIA DeepLearningExamples PyTorch BERT README (pytorch:21.11), SQuAD fine-tuning, 1 GPU:
A100 80GB mixed 110.5 seq/s and TF32 61.5; V100 32GB mixed 52 and FP32 12. Tensor-core and
TF32 rows are bandwidth-bound (their FLOP per byte agree across A100 and V100: 50.9 and 53.4
net of ``t0``), the V100 fp32 row is compute-bound (CUDA cores): ``I_half`` = median FLOP/byte
of the half rows, ``I_fp32`` = that of the A100 TF32 row, ``a`` = the V100 fp32 row's fraction
of peak, each read from the row's rate NET of ``t0`` (its published batch is one pass). Held out:
every ``role=heldout`` row (DLE PyTorch 20.06 release, Lambda's GPU benchmarks 2021 and 2024,
Pollux/Sia traces): :func:`heldout_errors`, ``docs/planner-accuracy.md``. A ``role=republished``
row repeats a measurement already in the file (the fit's, or an older snapshot's): kept for the
record, never counted as held out.

NOT modelled: NVIDIA's fused pre-training scripts (padding removal, fused attention), whose
sequences/s are not comparable across releases.

Training FLOPs per sample (:func:`bert_flops`) are the formula hetseq_hpc's BERT task uses
(:meth:`hetseq_hpc.tasks.bert.mlm_model.BertMaskedLM.flops_per_sample`).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetseq_hpc.plan.gpu_specs import GpuSpec, find_spec, power_clock_factor, spec_from_probe

#: the published figures (fit and held-out rows, with their sources)
DATA_FILE = Path(__file__).with_name("data") / "published_bert.csv"
#: BERT shapes: model -> (layers, hidden); intermediate = 4 x hidden; WordPiece vocabulary 30522
BERT_SHAPES = {"base": (12, 768), "large": (24, 1024)}
BERT_VOCAB = 30522
#: parameter tensors of the published BERT models (Hugging Face / NVIDIA ``BertForQuestionAnswering``:
#: 5 embedding tensors, 16 per layer, 2 of the span head; no pooler)
BERT_PARAM_TENSORS = {"base": 5 + 16 * 12 + 2, "large": 5 + 16 * 24 + 2}
#: fixed cost of one forward+backward pass per parameter tensor, seconds: hetseq_hpc's own BERT-base
#: calibration on an NVIDIA H100 80GB HBM3 (docs/benchmarks.md, "On a GPU", 2026-11-27: cost curve
#: 31.9 ms + 0.243 ms x micro-batch, bf16, sequence 128), over its 202 parameter tensors
PASS_OVERHEAD_S_PER_TENSOR = 0.0319 / 202


def pass_overhead_s(param_tensors: int) -> float:
    """Fixed time of one eager forward+backward pass of a model with ``param_tensors`` parameter
    tensors, seconds (:data:`PASS_OVERHEAD_S_PER_TENSOR` x the count; 0 for 0)."""
    return PASS_OVERHEAD_S_PER_TENSOR * max(int(param_tensors), 0)


def bert_flops(model: str, seq_len: int, masked: float, vocab: int = BERT_VOCAB) -> float:
    """Training FLOPs (forward + backward = 3 x forward matmuls) of one BERT sample: the encoder
    ``2 L (4 h^2 + 2 h 4h) T + 4 L T^2 h`` and the MLM head on the masked tokens only
    ``2 (h^2 + h V) x masked`` (0 for SQuAD fine-tuning, whose 2-logit head is negligible).

    Args:
        model: ``base`` or ``large``.
        seq_len: tokens per sample ``T``.
        masked: masked (predicted) tokens per sample.
        vocab: vocabulary size ``V``.
    """
    layers, h = BERT_SHAPES[model]
    per_layer = 4 * h * h + 2 * h * 4 * h
    encoder = 2 * layers * per_layer * seq_len + layers * 4 * seq_len * seq_len * h
    return 3.0 * (encoder + 2 * (h * h + h * vocab) * masked)


def width(precision: str) -> str:
    """Activation width of a precision: ``half`` (fp16, bf16) or ``fp32`` (fp32, tf32)."""
    return "half" if precision in ("fp16", "bf16") else "fp32"


@dataclass(frozen=True)
class Published:
    """One published single-GPU measurement (a row of :data:`DATA_FILE`).

    Attributes:
        role: ``fit``, ``heldout``, or ``republished`` (a repeat of a measurement already in
            the file, not counted as held out).
        gpu: spec-table key (:data:`hetseq_hpc.plan.gpu_specs.SPEC_TABLE`).
        precision: ``fp16``, ``tf32`` or ``fp32``.
        model: ``base`` or ``large``; workload: ``squad384`` (SQuAD fine-tuning, seq 384).
        seq_len / masked: tokens and masked tokens per sample; batch: per GPU (0 = not given).
        samples_per_s: sequences/s as published.
        source_url / table: where (commit-pinned URL) and which table.
    """

    role: str
    gpu: str
    precision: str
    model: str
    workload: str
    seq_len: int
    masked: int
    batch: int
    samples_per_s: float
    source_url: str
    table: str

    @property
    def spec(self) -> GpuSpec:
        """The GPU's spec row."""
        found = find_spec(self.gpu)
        if found is None:  # the data file and the spec table ship together
            raise KeyError(f"{DATA_FILE.name}: gpu {self.gpu!r} is not in the spec table")
        return found

    @property
    def flops(self) -> float:
        """Training FLOPs of one sample (:func:`bert_flops`)."""
        return bert_flops(self.model, self.seq_len, self.masked)

    @property
    def overhead_s(self) -> float:
        """The model's fixed time of one pass (:func:`pass_overhead_s`), seconds."""
        return pass_overhead_s(BERT_PARAM_TENSORS[self.model])

    @property
    def net_flops_per_s(self) -> float:
        """Achieved FLOP/s net of the pass's fixed time: ``batch x flops / (batch / rate - t0)``
        (the published batch taken as one pass; the plain rate when no batch is given).

        Raises:
            ValueError: the fixed time alone exceeds the published time of the batch.
        """
        if not self.batch:
            return self.samples_per_s * self.flops
        busy = self.batch / self.samples_per_s - self.overhead_s
        if busy <= 0:
            raise ValueError(f"{DATA_FILE.name}: {self.gpu} {self.model} batch {self.batch} at "
                             f"{self.samples_per_s} samples/s is faster than the pass overhead")
        return self.batch * self.flops / busy

    @property
    def fraction(self) -> float:
        """Achieved fraction of the spec peak in this precision, net of the pass's fixed time."""
        return self.net_flops_per_s / self.spec.peak_flops(self.precision)

    @property
    def intensity(self) -> float:
        """Achieved FLOP per byte of memory bandwidth, net of the pass's fixed time."""
        return self.net_flops_per_s / (self.spec.bandwidth_gbs * 1e9)


@lru_cache(maxsize=1)
def published() -> Tuple[Published, ...]:
    """Every row of :data:`DATA_FILE` (fit and held-out), in file order."""
    with DATA_FILE.open(newline="") as fh:
        reader = csv.DictReader(line for line in fh if not line.startswith("#"))
        return tuple(Published(
            r["role"], r["gpu"], r["precision"], r["model"], r["workload"], int(r["seq_len"]),
            int(r["masked"]), int(r["batch"] or 0), float(r["samples_per_s"]), r["source_url"],
            r["table"]) for r in reader)


def fit_factors(rows: Optional[Tuple[Published, ...]] = None) -> Dict[str, float]:
    """The three factors from the ``role=fit`` rows (held-out rows are never read):
    ``compute_fraction`` = median fraction of peak of the fit rows on CUDA cores (``fp32``),
    ``intensity_half`` / ``intensity_fp32`` = median FLOP per byte of the tensor-core fit rows
    (fp16/bf16, resp. tf32). See the module docstring for why each row binds where it does."""
    fit = [r for r in (rows if rows is not None else published()) if r.role == "fit"]
    return {
        "compute_fraction": statistics.median(r.fraction for r in fit if r.precision == "fp32"),
        "intensity_half": statistics.median(r.intensity for r in fit if width(r.precision) == "half"),
        "intensity_fp32": statistics.median(r.intensity for r in fit if r.precision == "tf32"),
    }


#: the fitted factors (:func:`fit_factors`): compute_fraction (of peak), intensity_half and
#: intensity_fp32 (FLOP per byte of memory bandwidth)
FACTORS: Dict[str, float] = fit_factors()


def achieved_flops(spec: GpuSpec, precision: str) -> Tuple[float, str]:
    """``(FLOP/s, bound)``: ``min(peak x power_clock_factor x compute_fraction, bandwidth x
    intensity)`` and which of ``compute`` / ``bandwidth`` binds. A spec without a bandwidth (a
    probed GPU in no table) is compute-bound."""
    compute = (spec.peak_flops(precision) * power_clock_factor(spec)
               * FACTORS["compute_fraction"])
    memory = spec.bandwidth_gbs * 1e9 * FACTORS[f"intensity_{width(precision)}"]
    if spec.bandwidth_gbs > 0 and memory < compute:
        return memory, "bandwidth"
    return compute, "compute"


def predict_samples_per_s(spec: GpuSpec, precision: str, flops_per_sample: float,
                          micro_batch: int = 0, overhead_s: float = 0.0) -> float:
    """Predicted training samples/s of one GPU: ``m / (t0 + m x flops_per_sample / FLOP/s)``
    with :func:`achieved_flops`; the asymptotic rate (no fixed time) when ``micro_batch`` is 0.

    Args:
        spec: the GPU (a spec-table row or :func:`hetseq_hpc.plan.gpu_specs.spec_from_probe`).
        precision: ``fp32``, ``tf32``, ``fp16`` or ``bf16``.
        flops_per_sample: training FLOPs of one sample.
        micro_batch: samples per pass ``m`` (0: the rate without the fixed time).
        overhead_s: the pass's fixed time ``t0``, seconds (:func:`pass_overhead_s`).
    """
    per_sample_s = flops_per_sample / achieved_flops(spec, precision)[0]
    if micro_batch <= 0:
        return 1.0 / per_sample_s
    return micro_batch / (overhead_s + micro_batch * per_sample_s)


def predicted(row: Published) -> float:
    """The model's samples/s for a published row (its GPU, precision, model and batch)."""
    return predict_samples_per_s(row.spec, row.precision, row.flops, row.batch, row.overhead_s)


def gpu_class(row: Published) -> str:
    """The class a row is scored in: GPU family (label without memory or form factor) x
    precision, e.g. ``A100 tf32``, ``RTX 3090 fp16``."""
    family = " ".join(w for w in row.spec.label.split()
                      if not w.endswith("GB") and w not in ("PCIe", "SXM", "SXM2"))
    return f"{family} {row.precision}"


def heldout_errors() -> Dict[str, List[float]]:
    """Relative errors ``predicted / published - 1`` of every held-out row, by :func:`gpu_class`."""
    out: Dict[str, List[float]] = {}
    for row in published():
        if row.role == "heldout":
            out.setdefault(gpu_class(row), []).append(predicted(row) / row.samples_per_s - 1)
    return out


#: the held-out sources that publish both an A100 and a V100 in fp16: (A100 row, V100 row,
#: source commit) of Lambda 2024, Lambda 2021 and DLE 20.06 (the issue's A100:V100 bar)
A100_V100_PAIRS = (("a10080", "v10016", "4e11f689"), ("a10040", "v10032", "e167f02c"),
                   ("a10040", "v10016", "b2763ae2"))


def heldout_ratio_errors(gpu_a: str, gpu_b: str, precision: str, source: str) -> List[float]:
    """Errors ``predicted ratio / published ratio - 1`` of GPU ``gpu_a`` over ``gpu_b``: one per
    model size and table that the held-out rows of ``source`` (a part of their URL) publish for
    both in ``precision``; empty when the source has no such pair."""
    rows = [r for r in published() if r.role == "heldout" and source in r.source_url
            and r.precision == precision]
    return [(predicted(a) / predicted(b)) / (a.samples_per_s / b.samples_per_s) - 1
            for a in rows if a.gpu == gpu_a for b in rows
            if b.gpu == gpu_b and a.model == b.model
            and a.table.split(",")[-1] == b.table.split(",")[-1]]


def probe_samples_per_s(probe: Dict[str, Any], partition: str, gpu_type: Optional[str],
                        flops_per_sample: float) -> Optional[float]:
    """The model's samples/s for a probed partition from the probe's own device facts
    (:func:`hetseq_hpc.plan.gpu_specs.spec_from_probe`: SMs, max SM clock, compute capability;
    the probe is preferred to any table row) in the precision ``auto`` picks there.

    Args:
        probe: a checked probe file (``ranks`` with ``partition``, ``gres`` and ``probe``).
        partition: the Slurm partition; gpu_type: its GRES type (the fallback match).
        flops_per_sample: training FLOPs of one sample.

    Returns:
        samples/s, or None when the matching probe rank has no GPU facts (a CPU, older probe).
    """
    from hetseq_hpc.train.precision import resolve_precision

    ranks = probe.get("ranks") or []
    matched = [r for r in ranks if r.get("partition") == partition] or [
        r for r in ranks if gpu_type and r.get("gres") == gpu_type]
    spec = spec_from_probe(matched[0].get("probe") or {}) if matched else None
    if spec is None:
        return None
    precision = resolve_precision("auto", "cuda", spec.capability)[0]
    return achieved_flops(spec, precision)[0] / flops_per_sample
