"""Achieved training throughput of any GPU from its specifications, with TWO numbers fitted on
ONE published source and checked on others it was not fitted on.

A pass of ``m`` samples costs ``t(m) = t0(model) + m x (matmul time + memory-bound time)``, the
matmul time from the peak (:mod:`hetseq_hpc.plan.gpu_specs`) at fitted fraction ``a``, the
memory-bound operations' bytes (counted, :func:`transformer_accesses`) at fitted fraction ``e``
of the bandwidth. :func:`fit_factors` fits them on ``data/published_bert.csv``'s ``role=fit``
rows; :func:`heldout_errors` checks the others. The model, its terms, the fit and what is not
modelled: docs/design/planner.md, "Achieved throughput from specifications"; the errors:
docs/planner-accuracy.md.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetseq_hpc.plan.gpu_specs import GpuSpec, find_spec, power_clock_factor, spec_from_probe

#: the published figures (fit and held-out rows, with their sources)
DATA_FILE = Path(__file__).with_name("data") / "published_bert.csv"
#: BERT shapes: model -> (layers, hidden, attention heads); intermediate = 4 x hidden; WordPiece
#: vocabulary 30522
BERT_SHAPES = {"base": (12, 768, 12), "large": (24, 1024, 16)}
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


#: memory-bound operations of one transformer layer, per tensor they run on (forward): on the
#: ``T x hidden`` tensors the q/k/v bias adds (3), and after the attention and after the
#: feed-forward block each a bias add, dropout, residual add and LayerNorm (8); on the
#: ``T x intermediate`` tensor the bias add and GELU (2); on the ``heads x T x T`` scores the
#: scale-and-mask, softmax and dropout (3)
ELEMENTWISE_OPS = {"hidden": 11, "intermediate": 2, "scores": 3}
#: element accesses per ``T x hidden`` element of one FUSED attention kernel (PyTorch's
#: ``scaled_dot_product_attention`` on CUDA: FlashAttention-2 or memory-efficient attention, both
#: with dropout), which never writes the ``heads x T x T`` scores: forward reads Q, K, V and
#: writes O (4); backward reads Q, K, V, O, dO and writes dQ, dK, dV (8). Its per-row softmax
#: statistics (``heads x T``) are left out
FUSED_ATTENTION_ACCESSES = 12
#: element accesses of one such operation: read + write forward, twice that backward (the
#: gradient read and written, the saved input read)
ACCESSES_PER_OP = 6
#: bytes of one activation element: fp16/bf16 activations, fp32 (and TF32) activations
BYTES_PER_ELEMENT = {"half": 2, "fp32": 4}
#: element accesses per element of saved activations, for a model without a counted
#: architecture: :func:`transformer_accesses` (eager attention) over the saved-tensor bytes / 4
#: that hetseq_hpc's own BERT-base (12 x 768, T = 128, fp32, on the CPU) measures: 1.77e8 /
#: 3.12e7. Both sides include the scores: on the CPU with dropout, ``scaled_dot_product_attention``
#: takes its math path, which saves them
ACCESSES_PER_SAVED_ELEMENT = 5.7


def transformer_accesses(
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    intermediate: int = 0,
    fused_attention: bool = False,
) -> float:
    """Element accesses of one training sample's memory-bound operations in a transformer
    encoder: ``layers x 6 x (11 T h + 2 T i + 3 heads T^2)`` (:data:`ELEMENTWISE_OPS`,
    :data:`ACCESSES_PER_OP`); embeddings and output heads are not counted.

    With ``fused_attention`` the attention runs as one kernel that never writes its scores, so the
    three operations on the ``heads x T x T`` scores are replaced by that kernel's own reads and
    writes, :data:`FUSED_ATTENTION_ACCESSES` ``x T h``: ``layers x (6 (11 T h + 2 T i) + 12 T h)``.

    Args:
        layers / hidden / heads: the encoder's shape; seq_len: tokens per sample ``T``.
        intermediate: feed-forward width ``i`` (0: 4 x hidden).
        fused_attention: the model's attention is a fused kernel (hetseq_hpc's own BERT on a
            GPU: ``scaled_dot_product_attention``); False for eager attention (the published
            figures' code, which materialises the scores).
    """
    inter = intermediate or 4 * hidden
    ops = ELEMENTWISE_OPS
    per_layer = ACCESSES_PER_OP * (
        ops["hidden"] * seq_len * hidden + ops["intermediate"] * seq_len * inter
    )
    if fused_attention:
        per_layer += FUSED_ATTENTION_ACCESSES * seq_len * hidden
    else:
        per_layer += ACCESSES_PER_OP * ops["scores"] * heads * seq_len * seq_len
    return float(layers * per_layer)


def accesses_from_activations(activation_bytes_fp32: float) -> float:
    """Element accesses of a sample's memory-bound operations for a model with no counted
    architecture: :data:`ACCESSES_PER_SAVED_ELEMENT` x its saved activation elements
    (``activation_bytes_fp32`` / 4, measured in fp32 without a safety margin)."""
    return ACCESSES_PER_SAVED_ELEMENT * max(activation_bytes_fp32, 0.0) / 4.0


def bert_accesses(model: str, seq_len: int) -> float:
    """:func:`transformer_accesses` of a published BERT (``base`` or ``large``)."""
    layers, hidden, heads = BERT_SHAPES[model]
    return transformer_accesses(layers, hidden, heads, seq_len)


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
    layers, h, _ = BERT_SHAPES[model]
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
    def accesses(self) -> float:
        """Element accesses of one sample's memory-bound operations (:func:`bert_accesses`)."""
        return bert_accesses(self.model, self.seq_len)

    @property
    def net_sample_s(self) -> float:
        """Published time of one sample net of the pass's fixed time, seconds: ``1 / rate -
        t0 / batch`` (the published batch taken as one pass; ``1 / rate`` when no batch is given).

        Raises:
            ValueError: the fixed time alone exceeds the published time of the batch.
        """
        if not self.batch:
            return 1.0 / self.samples_per_s
        busy = 1.0 / self.samples_per_s - self.overhead_s / self.batch
        if busy <= 0:
            raise ValueError(
                f"{DATA_FILE.name}: {self.gpu} {self.model} batch {self.batch} at "
                f"{self.samples_per_s} samples/s is faster than the pass overhead"
            )
        return busy


@lru_cache(maxsize=1)
def published() -> Tuple[Published, ...]:
    """Every row of :data:`DATA_FILE` (fit and held-out), in file order."""
    with DATA_FILE.open(newline="") as fh:
        reader = csv.DictReader(line for line in fh if not line.startswith("#"))
        return tuple(
            Published(
                r["role"],
                r["gpu"],
                r["precision"],
                r["model"],
                r["workload"],
                int(r["seq_len"]),
                int(r["masked"]),
                int(r["batch"] or 0),
                float(r["samples_per_s"]),
                r["source_url"],
                r["table"],
            )
            for r in reader
        )


def _terms(spec: GpuSpec, precision: str, flops: float, accesses: float) -> Tuple[float, float]:
    """``(matmul seconds at a = 1, memory seconds at e = 1)`` of one sample: ``flops / (peak x
    p)`` and ``accesses x width / bandwidth`` (0 without a bandwidth: a probed GPU in no table)."""
    compute = flops / (spec.peak_flops(precision) * power_clock_factor(spec))
    memory = (
        accesses * BYTES_PER_ELEMENT[width(precision)] / (spec.bandwidth_gbs * 1e9)
        if spec.bandwidth_gbs > 0
        else 0.0
    )
    return compute, memory


def fit_factors(rows: Optional[Tuple[Published, ...]] = None) -> Dict[str, float]:
    """The two factors from the ``role=fit`` rows (held-out rows are never read): ``x = 1/a`` and
    ``y = 1/e`` minimise ``sum((c_i x + d_i y) / s_i - 1)^2`` over the fit rows, with ``c_i`` /
    ``d_i`` a row's :func:`_terms` and ``s_i`` its :attr:`Published.net_sample_s` (the 2 x 2
    normal equations, solved exactly).

    Returns:
        ``compute_fraction`` (``a``, of peak) and ``bandwidth_fraction`` (``e``, of bandwidth).

    Raises:
        ValueError: the fit rows do not determine both factors.
    """
    fit = [r for r in (rows if rows is not None else published()) if r.role == "fit"]
    cs, ds = [], []
    for r in fit:
        c, d = _terms(r.spec, r.precision, r.flops, r.accesses)
        cs.append(c / r.net_sample_s)
        ds.append(d / r.net_sample_s)
    scc, sdd = sum(c * c for c in cs), sum(d * d for d in ds)
    scd, sc, sd = sum(c * d for c, d in zip(cs, ds)), sum(cs), sum(ds)
    det = scc * sdd - scd * scd
    if det <= 0:
        raise ValueError(f"{DATA_FILE.name}: the fit rows do not determine both factors")
    x, y = (sc * sdd - sd * scd) / det, (sd * scc - sc * scd) / det
    if x <= 0 or y <= 0:
        raise ValueError(f"{DATA_FILE.name}: the fit gives a non-positive factor ({x}, {y})")
    return {"compute_fraction": 1.0 / x, "bandwidth_fraction": 1.0 / y}


#: the fitted factors (:func:`fit_factors`): compute_fraction (of peak) and bandwidth_fraction
#: (of memory bandwidth)
FACTORS: Dict[str, float] = fit_factors()


def sample_time_s(
    spec: GpuSpec, precision: str, flops_per_sample: float, accesses_per_sample: float
) -> Tuple[float, float]:
    """``(matmul seconds, memory seconds)`` of one sample on ``spec`` in ``precision`` with the
    fitted factors; their sum is the per-sample time of :func:`predict_samples_per_s`."""
    compute, memory = _terms(spec, precision, flops_per_sample, accesses_per_sample)
    return (compute / FACTORS["compute_fraction"], memory / FACTORS["bandwidth_fraction"])


def bound_label(times: Tuple[float, float]) -> str:
    """Where the per-sample time goes, e.g. ``matmul 38 % / memory 62 %``, from the
    ``(matmul seconds, memory seconds)`` of :func:`sample_time_s`."""
    compute, memory = times
    share = compute / (compute + memory)
    return f"matmul {share:.0%} / memory {1 - share:.0%}"


def predict_samples_per_s(
    spec: GpuSpec,
    precision: str,
    flops_per_sample: float,
    micro_batch: int = 0,
    overhead_s: float = 0.0,
    accesses_per_sample: float = 0.0,
) -> float:
    """Predicted training samples/s of one GPU: ``m / (t0 + m x per-sample time)`` with
    :func:`sample_time_s`; the asymptotic rate (no fixed time) when ``micro_batch`` is 0.

    Args:
        spec: the GPU (a spec-table row or :func:`hetseq_hpc.plan.gpu_specs.spec_from_probe`).
        precision: ``fp32``, ``tf32``, ``fp16`` or ``bf16``.
        flops_per_sample: training FLOPs of one sample.
        micro_batch: samples per pass ``m`` (0: the rate without the fixed time).
        overhead_s: the pass's fixed time ``t0``, seconds (:func:`pass_overhead_s`).
        accesses_per_sample: element accesses of the memory-bound operations
            (:func:`transformer_accesses`; 0: matmul time only).
    """
    per_sample_s = sum(sample_time_s(spec, precision, flops_per_sample, accesses_per_sample))
    if micro_batch <= 0:
        return 1.0 / per_sample_s
    return micro_batch / (overhead_s + micro_batch * per_sample_s)


def predicted(row: Published) -> float:
    """The model's samples/s for a published row (its GPU, precision, model and batch)."""
    return predict_samples_per_s(
        row.spec, row.precision, row.flops, row.batch, row.overhead_s, row.accesses
    )


def gpu_class(row: Published) -> str:
    """The class a row is scored in: GPU family (label without memory or form factor) x
    precision, e.g. ``A100 tf32``, ``RTX 3090 fp16``."""
    family = " ".join(
        w
        for w in row.spec.label.split()
        if not w.endswith("GB") and w not in ("PCIe", "SXM", "SXM2")
    )
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
A100_V100_PAIRS = (
    ("a10080", "v10016", "4e11f689"),
    ("a10040", "v10032", "e167f02c"),
    ("a10040", "v10016", "b2763ae2"),
)


def heldout_ratio_errors(gpu_a: str, gpu_b: str, precision: str, source: str) -> List[float]:
    """Errors ``predicted ratio / published ratio - 1`` of GPU ``gpu_a`` over ``gpu_b``: one per
    model size and table that the held-out rows of ``source`` (a part of their URL) publish for
    both in ``precision``; empty when the source has no such pair."""
    rows = [
        r
        for r in published()
        if r.role == "heldout" and source in r.source_url and r.precision == precision
    ]
    return [
        (predicted(a) / predicted(b)) / (a.samples_per_s / b.samples_per_s) - 1
        for a in rows
        if a.gpu == gpu_a
        for b in rows
        if b.gpu == gpu_b
        and a.model == b.model
        and a.table.split(",")[-1] == b.table.split(",")[-1]
    ]


def probe_samples_per_s(
    probe: Dict[str, Any],
    partition: str,
    gpu_type: Optional[str],
    flops_per_sample: float,
    accesses_per_sample: float = 0.0,
) -> Optional[float]:
    """The model's samples/s for a probed partition from the probe's own device facts
    (:func:`hetseq_hpc.plan.gpu_specs.spec_from_probe`: SMs, max SM clock, compute capability;
    the probe is preferred to any table row) in the precision ``auto`` picks there.

    Args:
        probe: a checked probe file (``ranks`` with ``partition``, ``gres`` and ``probe``).
        partition: the Slurm partition; gpu_type: its GRES type (the fallback match).
        flops_per_sample: training FLOPs of one sample.
        accesses_per_sample: element accesses of its memory-bound operations.

    Returns:
        samples/s, or None when the matching probe rank has no GPU facts (a CPU, older probe).
    """
    from hetseq_hpc.train.precision import resolve_precision

    ranks = probe.get("ranks") or []
    matched = [r for r in ranks if r.get("partition") == partition] or [
        r for r in ranks if gpu_type and r.get("gres") == gpu_type
    ]
    spec = spec_from_probe(matched[0].get("probe") or {}) if matched else None
    if spec is None:
        return None
    precision = resolve_precision("auto", "cuda", spec.capability)[0]
    return predict_samples_per_s(
        spec, precision, flops_per_sample, accesses_per_sample=accesses_per_sample
    )
