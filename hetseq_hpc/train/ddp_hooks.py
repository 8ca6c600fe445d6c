"""A DDP communication hook that SUMS gradients across ranks and timestamps local compute.

:func:`sum_allreduce_hook`: a SUM instead of DDP's mean (wrong for uneven per-rank batches); two
variants picked by ``comm.grad_compression`` (:func:`compressed_sum_hook`: bf16/fp16 payload)
and ``comm.grad_combine`` (:func:`adasum_hook`: Adasum, not the exact global-batch gradient).
Why a sum is exact, when the hook fires, and Adasum's rule: docs/design/exact-gradients.md,
"The SUM communication hook".
"""

# No "from __future__ import annotations": DDP checks the hook's real annotations.

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class HookState:
    """Timestamps of the hook calls of the current step.

    Attributes:
        last_ready_s: ``time.perf_counter()`` of the latest bucket-ready call (CPU clock).
        events: CUDA events recorded at each call (GPU clock), when on CUDA.
        process_group: the group to all-reduce over (None = default group).
        comm_dtype: payload dtype of the compressed hooks (None = the gradients' own).
        local_units: this rank's loss units this step (Adasum divides by it).
        bytes_sent: payload bytes this rank handed to collectives this step.
        on_last: called once, right after the step's LAST bucket is ready (this rank's backward
            pass has produced every gradient), before its all-reduce starts; the training loop
            posts its step statistics there so that their exchange overlaps the all-reduce.
            Cleared by the call and by :meth:`reset`.
        comm_spans: ``(launched, done)`` ``time.perf_counter()`` pairs of this step's bucket
            collectives (:meth:`timed`), ``done`` taken when the collective's future completes.
    """

    process_group: Optional[dist.ProcessGroup] = None
    last_ready_s: float = 0.0
    events: List[torch.cuda.Event] = field(default_factory=list)
    comm_dtype: Optional[torch.dtype] = None
    local_units: int = 1
    bytes_sent: int = 0
    on_last: Optional[Callable[[], None]] = None
    comm_spans: List[Tuple[float, float]] = field(default_factory=list)

    def reset(self) -> None:
        """Forget the previous step's timestamps, byte count, collective spans and ``on_last``."""
        self.last_ready_s = 0.0
        self.events.clear()
        self.bytes_sent = 0
        self.on_last = None
        self.comm_spans = []

    def timed(self, fut: torch.futures.Future) -> torch.futures.Future:
        """Record ``fut``'s collective in :attr:`comm_spans` (launched now, done when ``fut``
        completes); returns ``fut``."""
        launched = time.perf_counter()
        spans = self.comm_spans  # this step's list, even if a reset comes before the callback
        fut.add_done_callback(lambda _: spans.append((launched, time.perf_counter())))
        return fut

    def comm_row(self) -> Dict[str, float]:
        """This step's measured gradient communication for ``metrics.jsonl``, seconds: empty
        when no collective ran (one rank, FSDP); else ``allreduce_s``, the time with at least
        one bucket's collective in flight (the union of :attr:`comm_spans`: waiting for a
        slower peer to join counts), and ``allreduce_exposed_s``, from the last bucket ready
        (the end of this rank's backward pass) to the last collective done."""
        spans = sorted(self.comm_spans)
        if not spans:
            return {}
        busy, start, end = 0.0, spans[0][0], spans[0][1]
        for a, b in spans[1:]:
            if a > end:
                busy += end - start
                start = a
            end = max(end, b)
        busy += end - start
        exposed = max(0.0, end - self.last_ready_s) if self.last_ready_s else 0.0
        return {"allreduce_s": round(busy, 6), "allreduce_exposed_s": round(exposed, 6)}

    def bucket_ready(self, bucket: dist.GradBucket) -> torch.Tensor:
        """A hook's first call: :meth:`mark_ready`, then ``on_last`` if ``bucket`` is the
        step's last one (``GradBucket.is_last()``: DDP launches buckets in order, so every
        gradient of this rank is ready then). Returns the bucket's buffer."""
        buffer = bucket.buffer()
        self.mark_ready(buffer)
        if self.on_last is not None and bucket.is_last():
            callback, self.on_last = self.on_last, None
            callback()
        return buffer

    def mark_ready(self, buffer: torch.Tensor) -> None:
        """Record that a bucket is ready (CPU clock, and a CUDA event on a GPU)."""
        self.last_ready_s = time.perf_counter()
        if buffer.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)


def no_forward_buffer_sync() -> Dict[str, bool]:
    """DDP arguments that stop buffer broadcasts in forward: ranks run different numbers of
    forward passes per step, so a collective there would pair up wrongly and hang.
    (``forward_sync_buffers`` replaced ``broadcast_buffers`` in recent torch releases.)"""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def sum_allreduce_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a bucket with SUM (no division by world size); record when it was ready."""
    buffer = state.bucket_ready(bucket)
    state.bytes_sent += buffer.numel() * buffer.element_size()
    fut = state.timed(
        dist.all_reduce(
            buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True
        ).get_future()
    )
    return fut.then(lambda f: f.value()[0])


def compressed_sum_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """:func:`sum_allreduce_hook` with a ``state.comm_dtype`` payload: cast, SUM all-reduce,
    cast back into the bucket. Non-finite values stay non-finite (the loss scale then skips the
    step on every rank)."""
    buffer = state.bucket_ready(bucket)
    payload = buffer.to(state.comm_dtype)
    state.bytes_sent += payload.numel() * payload.element_size()
    fut = state.timed(
        dist.all_reduce(
            payload, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True
        ).get_future()
    )

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def adasum_pair(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Adasum of two flat vectors (float64 recommended):
    ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``; a coefficient stays 1 when its vector's
    squared norm is below ``eps`` (Horovod's guard)."""
    dot = float(torch.dot(a, b))
    a_sq, b_sq = float(torch.dot(a, a)), float(torch.dot(b, b))
    a_coeff = 1.0 - dot / (2.0 * a_sq) if a_sq >= eps else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_sq) if b_sq >= eps else 1.0
    return a_coeff * a + b_coeff * b


def adasum_tree(rows: List[torch.Tensor]) -> torch.Tensor:
    """Adasum of ``rows`` (one per rank, rank order, power-of-two count) in Horovod's
    recursive-halving order: pairs (0,1), (2,3), ... then pairs of those results, ..."""
    level = list(rows)
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def adasum_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Adasum of the ranks' own mean gradients, per parameter tensor (module docstring).

    One all-gather of the bucket (in ``state.comm_dtype`` when set); every rank then computes
    the same combination in float64 from the same gathered data."""
    buffer = state.bucket_ready(bucket)
    payload = buffer.div(state.local_units)
    if state.comm_dtype is not None:
        payload = payload.to(state.comm_dtype)
    state.bytes_sent += payload.numel() * payload.element_size()
    world = dist.get_world_size(state.process_group)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = state.timed(
        dist.all_gather(gathered, payload, group=state.process_group, async_op=True).get_future()
    )
    sizes = [g.numel() for g in bucket.gradients()]

    def combine(_: torch.futures.Future) -> torch.Tensor:
        rows = [g.to(torch.float64) for g in gathered]
        start = 0
        for size in sizes:
            part = adasum_tree([r[start : start + size] for r in rows])
            buffer[start : start + size].copy_(part)
            start += size
        return buffer

    return fut.then(combine)
