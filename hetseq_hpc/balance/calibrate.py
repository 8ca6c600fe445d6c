"""Measure a rank's cost curve and memory per sample with a few passes of the real model.

Time: after one untimed warm-up pass at the calibration micro-batch ``m``, ``steps`` timed
forward+backward passes on real training samples cycle through ``m``, ``m / 4`` and
``m / 16`` (``m`` first; batches built and moved before the clock starts, CUDA events on a
GPU); the fastest pass of each size is kept (one-off stalls only ever add time, the approach
of Python's ``timeit``) and fitted by the cost curve ``t(m) = a + max(c m, h + g m)``, a
line unless the host floor shows (:func:`hetseq_hpc.balance.curves.fit_curve`); plus the per-step fixed cost ``f``
(clipping and an AdamW step, timed on copies of the parameters). A rank that is done before
the slowest one keeps timing passes of the same two sizes while it would otherwise wait for
the exchange of calibrations (``wait_for_peers``; at most :data:`MAX_EXTRA_PASSES`): on a
mixed cluster the fast ranks, whose passes are short and most easily disturbed, get the most
passes, and the start-up does not get longer (at most by the one pass a rank is in when the
slowest finishes). No optimizer step touches the model; gradients are dropped afterwards.

Memory: bytes the autograd graph saves for backward, counted with
``torch.autograd.graph.saved_tensors_hooks`` in the untimed passes (probes, warm-up; the slope
is the per-sample activation memory; works on any device), and on CUDA also the peak
allocated memory, whichever is larger.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from hetseq_hpc.balance.curves import fit_curve, fit_residuals
from hetseq_hpc.balance.memory import (
    MEMORY_HEADROOM,
    local_part,
    memory_cap,
    model_state_bytes,
)
from hetseq_hpc.env.hardware import adamw_kernel

log = logging.getLogger(__name__)

#: margin on measured activation memory for temporaries the hooks do not see
ACTIVATION_SAFETY = 1.5
#: samples of the two untimed probe passes whose saved bytes cap the warm-up pass's
#: micro-batch (2, not 1: BatchNorm refuses one sample per channel in training)
PROBE_SAMPLES = (2, 4)
#: the timed micro-batches are the calibration micro-batch divided by powers of this
LOW_SIZE_DIVISOR = 4
#: distinct timed sizes (``m``, ``m / 4``, ``m / 16``): three are needed to see a host floor
TIMED_SIZES = 3
#: most passes a rank times while slower ranks still calibrate (``wait_for_peers``)
MAX_EXTRA_PASSES = 16
#: how long a rank that is done looks for the other ranks' "done" before it times another
#: pass, seconds (the last rank to finish sees every rank done within a round trip)
PEER_GRACE_S = 0.02


class PeersDone(Protocol):
    """What ``wait_for_peers`` returns (:class:`hetseq_hpc.distributed.rendezvous.PendingBarrier`)."""

    def done(self) -> bool:
        """True once every rank is done (never blocks)."""

    def wait(self) -> None:
        """Block until every rank is done."""


@dataclass(frozen=True)
class Calibration:
    """One rank's measurements.

    Attributes:
        samples_per_s: forward+backward throughput at ``micro_batch`` from the fit (samples/s).
        micro_batch: the largest timed micro-batch.
        activation_bytes_per_sample: activation memory of one sample, with safety margin.
        static_bytes: parameters, gradients, optimizer state, DDP buckets (bytes).
        memory_budget_bytes: memory this rank may plan with (bytes).
        max_micro_batch: the resulting cap (>= 1, or 0 when nothing fits).
        overhead_s: ``a`` of the fitted cost curve (seconds per micro-batch).
        per_sample_s: ``c`` of the fitted cost curve (seconds per sample).
        step_fixed_s: ``f``, the per-step fixed cost (clip + optimizer step), seconds.
        host_s: ``h``, the fitted host floor of a micro-batch (0: the curve is a line).
        host_per_sample_s: ``g``, time per sample while the host bounds a pass.
        timings: ``[micro-batch, seconds]`` of every timed pass (the fit's data).
    """

    samples_per_s: float
    micro_batch: int
    activation_bytes_per_sample: float
    static_bytes: float
    memory_budget_bytes: float
    max_micro_batch: int
    overhead_s: float = 0.0
    per_sample_s: float = 0.0
    step_fixed_s: float = 0.0
    timings: List[List[float]] = field(default_factory=list)
    host_s: float = 0.0
    host_per_sample_s: float = 0.0

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_sizes(micro_batch: int, steps: int, cap: int) -> List[int]:
    """Micro-batch sizes of the ``steps`` timed passes: the calibration micro-batch ``m``,
    ``m / LOW_SIZE_DIVISOR``, ``m / LOW_SIZE_DIVISOR**2`` in turn (:data:`TIMED_SIZES`,
    ``m`` first), all within the memory ``cap`` and none below 2 samples unless ``m`` is 1;
    fewer sizes when ``m`` is too small to split."""
    high = max(1, min(int(micro_batch), int(cap) if cap >= 1 else 1))
    # never a batch of one when the rank can take more: a training-mode BatchNorm refuses it
    # (a model that opted in with allow_batchnorm), and one sample says little about a step
    low = min(2, high)
    levels: List[int] = []
    for j in range(TIMED_SIZES):
        size = max(low, high // LOW_SIZE_DIVISOR**j)
        if size not in levels:
            levels.append(size)
    return [levels[j % len(levels)] for j in range(int(steps))]


def fastest_per_size(
    sizes: Sequence[int], times_s: Sequence[float]
) -> Tuple[List[int], List[float]]:
    """``(sizes, seconds)``: the fastest timing of each distinct micro-batch size, sizes
    ascending (interference only ever adds time, so the minimum is the least disturbed)."""
    best: Dict[int, float] = {}
    for n, t in zip(sizes, times_s):
        best[int(n)] = min(best.get(int(n), float("inf")), float(t))
    ordered = sorted(best)
    return ordered, [best[n] for n in ordered]


def probe_activation_bytes(
    run: Callable[[int], None], saved: Dict[int, int], micro_batch: int
) -> Optional[Tuple[float, float]]:
    """Run passes of the :data:`PROBE_SAMPLES` sizes (``run(n)`` records the pass's saved
    tensor bytes in ``saved[n]``); returns ``(bytes per sample, fixed bytes)`` of the saved
    activations, the slope and intercept of the two (the larger pass's bytes over its
    samples when they do not grow: never zero), or None when ``micro_batch`` is too small to
    need a cap."""
    small, large = PROBE_SAMPLES
    if micro_batch <= large:
        return None
    run(small)
    run(large)
    slope = (saved[large] - saved[small]) / (large - small)
    if slope <= 0:
        return saved[large] / large, 0.0
    return float(slope), float(max(saved[small] - small * slope, 0.0))


def done_within(done: Callable[[], bool], seconds: float) -> bool:
    """True as soon as ``done()`` is; False if it is still False after ``seconds`` (polled
    every millisecond)."""
    deadline = time.perf_counter() + seconds
    while not done():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.001)
    return True


def time_optimizer_step(model: nn.Module, device: torch.device, repeats: int = 2) -> float:
    """Seconds of one clip + AdamW step on copies of the parameters with the model's gradients
    (the per-step fixed cost ``f``; the model itself is not changed). The first step allocates
    the optimizer state and is not counted; 0.0 when the model has no gradients. Under FSDP
    the copies are this rank's shards (no collective runs)."""
    local = local_part  # a shard of an FSDP parameter: its local part
    pairs = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    if not pairs:
        return 0.0
    copies = [local(p).detach().clone() for p, _ in pairs]
    for copy, (_, grad) in zip(copies, pairs):
        copy.grad = local(grad)
    opt = torch.optim.AdamW(copies, lr=1e-12, **adamw_kernel(copies))
    best = float("inf")
    for j in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(copies, 1.0, foreach=True)
        opt.step()
        _sync(device)
        if j:
            best = min(best, time.perf_counter() - start)
    for copy in copies:
        copy.grad = None
    del opt, copies
    return 0.0 if best == float("inf") else best


def calibrate(
    model: nn.Module,
    make_batch: Callable[[int], Dict[str, torch.Tensor]],
    device: torch.device,
    micro_batch: int,
    steps: int,
    memory_budget_bytes: float,
    max_micro_batch: Optional[int] = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    step_fixed: bool = True,
    wait_for_peers: Optional[Callable[[], PeersDone]] = None,
    static_bytes: Optional[float] = None,
) -> Calibration:
    """Measure memory per sample, then time ``steps`` forward+backward passes at up to three
    sizes and fit the cost curve ``t(m) = a + max(c m, h + g m)``
    (:func:`hetseq_hpc.balance.curves.fit_curve`).

    Passes: untimed probes of :data:`PROBE_SAMPLES` samples
    (:func:`probe_activation_bytes`: their saved bytes lower ``micro_batch`` to the memory cap
    first), one untimed pass at
    ``micro_batch`` (warm-up; saved activations, an upper bound
    of the per-sample memory that sets a safe size for the timed passes), one untimed pass of
    every timed size not run yet (a shape's first pass is slower), then the timed passes of
    :func:`timed_sizes` (batch built and moved before the clock starts, the gradients set to
    None first, as in a step's first pass, no hooks; the per-sample memory is the slope of
    the saved bytes between the warm-up and the largest smaller size counted untimed), then
    (``step_fixed``) the per-step fixed cost
    :func:`time_optimizer_step`. The curve is fitted to the fastest pass of each size
    (:func:`fastest_per_size`). Every timing and the fit's residuals are logged.

    Args:
        model: the bare model (not DDP-wrapped: calibration must not run collectives).
        make_batch: ``n -> batch`` of ``n`` real samples on the CPU.
        device: where the model lives.
        micro_batch: the largest timed micro-batch (lowered to the memory cap).
        steps: timed passes (after the warm-up pass).
        memory_budget_bytes: memory this rank may plan with.
        max_micro_batch: extra cap from ``balance.max_micro_batch``.
        autocast: context manager factory for mixed precision (the rank's precision).
        step_fixed: also time the optimizer step (the per-step fixed cost ``f``).
        wait_for_peers: called once when this rank's own passes (and the optimizer timing)
            are done, to say so (the worker passes :meth:`Rendezvous.post_barrier
            <hetseq_hpc.distributed.rendezvous.Rendezvous.post_barrier>`); until its result is
            ``done()`` this rank times more passes of the two sizes, alternating on (at most
            :data:`MAX_EXTRA_PASSES`; none when every rank is done within
            :data:`PEER_GRACE_S`), then waits for it. The passes join the fit and ``timings``.
            None: no extra passes, no waiting.
        static_bytes: the model state this rank will hold in training
            (:func:`hetseq_hpc.balance.memory.model_state_bytes`: less under FSDP); None = a
            full DDP replica.
    """
    saved: Dict[int, int] = {}

    def to_device(n: int) -> Dict[str, torch.Tensor]:
        return {k: v.to(device, non_blocking=True) for k, v in make_batch(n).items()}

    def run(n: int) -> None:
        batch = to_device(n)
        with autocast():
            loss, count = saved_tensor_bytes(lambda: model(**batch))
        loss.backward()
        saved.setdefault(n, count)

    model.train()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # small probes first (2 and 4 samples): their saved bytes cap the warm-up, which must not
    # overrun a small budget either
    probe_per_sample = probe_activation_bytes(run, saved, int(micro_batch))
    if probe_per_sample is not None:  # the cap's own formula (below), from the probes' slope
        micro_batch = max(
            1,
            min(
                int(micro_batch),
                memory_cap(
                    memory_budget_bytes,
                    param_bytes,
                    probe_per_sample[0] * ACTIVATION_SAFETY,
                    max_micro_batch,
                    static_bytes,
                ),
            ),
        )
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
    run(micro_batch)  # warm-up, and activation bytes at micro_batch
    _sync(device)
    peak_per_sample = 0.0
    if device.type == "cuda":
        peak_per_sample = (torch.cuda.max_memory_allocated(device) - base_alloc) / micro_batch
    # every saved byte counted as per-sample: an upper bound, so this cap is a safe one
    upper = max(saved[micro_batch] / micro_batch, peak_per_sample) * ACTIVATION_SAFETY
    sizes = timed_sizes(
        micro_batch,
        steps,
        memory_cap(memory_budget_bytes, param_bytes, upper, max_micro_batch, static_bytes),
    )
    # one untimed pass of every size not run yet (the probes and the warm-up ran theirs): a
    # shape's first pass is slower (new buffers), and the few timed passes must not carry
    # that (it tilted the line through the smaller sizes: +11-15 % on the small BERT's middle
    # sizes, issue 43); these passes count those sizes' saved bytes too
    for n in sorted(set(sizes) - set(saved)):
        run(n)
    times = []
    events = device.type == "cuda"

    def timed(n: int) -> None:
        batch = to_device(n)  # built and moved outside the clock
        # each pass as a step's first: its backward writes the gradients, adding into none
        # (an accumulating add over every parameter is a fixed cost the held-out sizes and a
        # one-pass step do not pay: +9-11 % on the small BERT's middle sizes, issue 43)
        model.zero_grad(set_to_none=True)
        _sync(device)
        if events:
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        with autocast():
            loss = model(**batch)
        loss.backward()
        if events:
            end_event.record()
            end_event.synchronize()
            elapsed = start_event.elapsed_time(end_event) / 1e3
        else:
            elapsed = time.perf_counter() - start
        times.append(max(elapsed, 1e-9))

    for n in sizes:
        timed(n)
    fixed = time_optimizer_step(model, device) if step_fixed else 0.0
    if wait_for_peers is not None:
        peers = wait_for_peers()
        cycle = sorted(set(sizes), reverse=True)  # the same sizes, alternating on
        if not done_within(peers.done, PEER_GRACE_S):
            while len(sizes) < steps + MAX_EXTRA_PASSES and not peers.done():
                sizes.append(cycle[len(sizes) % len(cycle)])
                timed(sizes[-1])
        peers.wait()
    below = [n for n in saved if n < micro_batch]
    if not below and min(sizes) < micro_batch:  # one untimed pass counts a smaller size
        run(min(sizes))
        below = [min(sizes)]
    model.zero_grad(set_to_none=True)
    small = max(below) if below else micro_batch
    if micro_batch > small:
        per_sample = max(saved[micro_batch] - saved[small], 0) / (micro_batch - small)
    elif probe_per_sample is not None:  # one size only (a tight budget): the probes' slope
        per_sample = probe_per_sample[0]
    else:
        per_sample = float(saved[micro_batch]) / micro_batch
    per_sample = max(per_sample, peak_per_sample) * ACTIVATION_SAFETY
    static = model_state_bytes(param_bytes) if static_bytes is None else float(static_bytes)
    budget = float(memory_budget_bytes) * MEMORY_HEADROOM
    cap = memory_cap(memory_budget_bytes, param_bytes, per_sample, max_micro_batch, static)
    fit_sizes, fit_times = fastest_per_size(sizes, times)
    curve = fit_curve(fit_sizes, fit_times, fixed)
    high = max(sizes)
    result = Calibration(
        samples_per_s=high / curve.micro_s(high),
        micro_batch=high,
        activation_bytes_per_sample=per_sample,
        static_bytes=static,
        memory_budget_bytes=budget,
        max_micro_batch=cap,
        overhead_s=curve.overhead_s,
        per_sample_s=curve.per_sample_s,
        step_fixed_s=curve.step_fixed_s,
        timings=[[int(n), float(t)] for n, t in zip(sizes, times)],
        host_s=curve.host_s,
        host_per_sample_s=curve.host_per_sample_s,
    )
    residuals = fit_residuals(curve, sizes, times)
    log.info(
        "calibration: timings %s -> t(m) = %.2f ms + %s (residuals %s), step fixed "
        "cost %.1f ms; %.1f samples/s at micro-batch %d",
        ", ".join(f"t({n})={t * 1e3:.1f} ms" for n, t in zip(sizes, times)),
        curve.overhead_s * 1e3,
        f"{curve.per_sample_s * 1e3:.3f} ms x m"
        if curve.host_s == 0
        else f"max({curve.per_sample_s * 1e3:.3f} ms x m, {curve.host_s * 1e3:.2f} ms + "
        f"{curve.host_per_sample_s * 1e3:.3f} ms x m) (host-bound below m = "
        f"{curve.host_bound_below:.0f})",
        ", ".join(f"{r:+.1%}" for r in residuals),
        fixed * 1e3,
        result.samples_per_s,
        high,
    )
    log.info(
        "calibration: %.1f MiB activations/sample, %.0f MiB static, budget %.0f MiB -> "
        "micro-batch cap %d",
        per_sample / 2**20,
        static / 2**20,
        budget / 2**20,
        cap,
    )
    return result
