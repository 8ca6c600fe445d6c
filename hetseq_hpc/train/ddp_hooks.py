"""A DDP communication hook that SUMS gradients across ranks and timestamps local compute.

DDP's built-in all-reduce divides by the world size (a mean), which is wrong when ranks hold
different numbers of samples (PyTorch issues 37359 and 37002); hooks receive buckets not yet
divided (https://pytorch.org/docs/stable/ddp_comm_hooks.html). With every rank's loss equal to
its SUM of per-unit losses divided by the GLOBAL unit count, summing gradients gives exactly
the gradient of the mean loss over the whole global batch.

The hook runs when a bucket's gradients are ready, i.e. as this rank's backward pass reaches
it; the time of the last call is the end of local compute, before any wait for slower ranks.
"""

# No "from __future__ import annotations": DDP checks the hook's real annotations.

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist


@dataclass
class HookState:
    """Timestamps of the hook calls of the current step.

    Attributes:
        last_ready_s: ``time.perf_counter()`` of the latest bucket-ready call (CPU clock).
        events: CUDA events recorded at each call (GPU clock), when on CUDA.
        process_group: the group to all-reduce over (None = default group).
    """

    process_group: Optional[object] = None
    last_ready_s: float = 0.0
    events: List[torch.cuda.Event] = field(default_factory=list)

    def reset(self) -> None:
        """Forget the previous step's timestamps."""
        self.last_ready_s = 0.0
        self.events.clear()


def no_forward_buffer_sync() -> Dict[str, bool]:
    """DDP arguments that stop buffer broadcasts in forward: ranks run different numbers of
    forward passes per step, so a collective there would pair up wrongly and hang.
    (``forward_sync_buffers`` replaced ``broadcast_buffers`` in recent torch releases.)"""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def sum_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a bucket with SUM (no division by world size); record when it was ready."""
    state.last_ready_s = time.perf_counter()
    buffer = bucket.buffer()
    if buffer.is_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        state.events.append(event)
    fut = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group,
                          async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
