"""Measure a rank's throughput and memory per sample with a few passes of the real model.

Throughput: ``steps`` timed forward+backward passes (after one warm-up pass) on real training
samples, no optimizer step, gradients dropped afterwards. Memory: bytes the autograd graph
saves for backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` at two batch
sizes (the slope is the per-sample activation memory; works on any device), and on CUDA
also the peak allocated memory, whichever is larger.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional

import torch
from torch import nn

from hetseq_hpc.allocation import micro_batch_cap

log = logging.getLogger(__name__)

#: margin on measured activation memory for temporaries the hooks do not see
ACTIVATION_SAFETY = 1.5
#: weights + gradients + two AdamW moments + one DDP bucket copy, in parameter sizes
STATIC_PARAM_COPIES = 5
#: share of free GPU memory / of this rank's RAM share that the cap may plan to use
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class Calibration:
    """One rank's measurements.

    Attributes:
        samples_per_s: forward+backward throughput at ``micro_batch`` (samples/s).
        micro_batch: micro-batch used for timing.
        activation_bytes_per_sample: activation memory of one sample, with safety margin.
        static_bytes: parameters, gradients, optimizer state, DDP buckets (bytes).
        memory_budget_bytes: memory this rank may plan with (bytes).
        max_micro_batch: the resulting cap (>= 1, or 0 when nothing fits).
    """

    samples_per_s: float
    micro_batch: int
    activation_bytes_per_sample: float
    static_bytes: float
    memory_budget_bytes: float
    max_micro_batch: int

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def saved_tensor_bytes(fn: Callable[[], torch.Tensor]) -> tuple:
    """``(fn(), bytes)``: run ``fn`` and count the bytes autograd saves for backward."""
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, total


def memory_cap(memory_budget_bytes: float, param_bytes: float, activation_bytes_per_sample: float,
               limit: Optional[int] = None) -> int:
    """Micro-batch cap of a device (the one formula the runtime and the planner share):
    :func:`~hetseq_hpc.allocation.micro_batch_cap` with budget ``memory x MEMORY_HEADROOM`` and
    static ``STATIC_PARAM_COPIES x param_bytes`` (weights, gradients, two AdamW moments, one DDP
    bucket copy). Bytes in, samples out; 0 if not one sample fits."""
    return micro_batch_cap(float(memory_budget_bytes) * MEMORY_HEADROOM,
                           float(param_bytes) * STATIC_PARAM_COPIES,
                           activation_bytes_per_sample, limit)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    model: nn.Module,
    make_batch: Callable[[int], Dict[str, torch.Tensor]],
    device: torch.device,
    micro_batch: int,
    steps: int,
    memory_budget_bytes: float,
    max_micro_batch: Optional[int] = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Calibration:
    """Time ``steps`` forward+backward passes and measure memory per sample.

    Args:
        model: the bare model (not DDP-wrapped: calibration must not run collectives).
        make_batch: ``n -> batch`` of ``n`` real samples on the CPU.
        device: where the model lives.
        micro_batch: samples per timed pass.
        steps: timed passes (after one warm-up pass).
        memory_budget_bytes: memory this rank may plan with.
        max_micro_batch: extra cap from ``trainer.max_micro_batch``.
        autocast: context manager factory for mixed precision.
    """

    def run(n: int) -> tuple:
        batch = {k: v.to(device, non_blocking=True) for k, v in make_batch(n).items()}
        with autocast():
            loss, saved = saved_tensor_bytes(lambda: model(**batch))
        loss.backward()
        return saved

    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
    saved_big = run(micro_batch)  # warm-up, and activation bytes at micro_batch
    _sync(device)
    peak_per_sample = 0.0
    if device.type == "cuda":
        peak_per_sample = (torch.cuda.max_memory_allocated(device) - base_alloc) / micro_batch
    start = time.perf_counter()
    for _ in range(steps):
        run(micro_batch)
    _sync(device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    if micro_batch > 1:
        saved_one = run(1)
        per_sample = max(saved_big - saved_one, 0) / (micro_batch - 1)
    else:
        per_sample = float(saved_big)
    per_sample = max(per_sample, peak_per_sample) * ACTIVATION_SAFETY
    model.zero_grad(set_to_none=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    static = float(param_bytes * STATIC_PARAM_COPIES)
    budget = float(memory_budget_bytes) * MEMORY_HEADROOM
    cap = memory_cap(memory_budget_bytes, param_bytes, per_sample, max_micro_batch)
    result = Calibration(
        samples_per_s=micro_batch * steps / elapsed,
        micro_batch=micro_batch,
        activation_bytes_per_sample=per_sample,
        static_bytes=static,
        memory_budget_bytes=budget,
        max_micro_batch=cap,
    )
    log.info(
        "calibration: %.1f samples/s at micro-batch %d; %.1f MiB activations/sample, "
        "%.0f MiB static, budget %.0f MiB -> micro-batch cap %d",
        result.samples_per_s, micro_batch, per_sample / 2**20, static / 2**20, budget / 2**20, cap,
    )
    return result
