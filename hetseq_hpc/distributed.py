"""Rendezvous and the few collectives hetseq_hpc uses outside DDP.

Backends: ranks with CUDA join with ``"cpu:gloo,cuda:nccl"`` (NCCL for CUDA tensors, gloo for
CPU tensors), ranks without CUDA with ``"gloo"``. Python objects (probes, allocations, timings)
travel over a separate gloo group so they never touch a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import LaunchError

log = logging.getLogger(__name__)


@dataclass
class Rendezvous:
    """An initialised default process group plus a gloo group for CPU-side objects."""

    world: WorldInfo
    backend: str
    cpu_group: Any

    def all_gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (picklable), ordered by rank."""
        out: List[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as given on rank ``src``."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_reduce_sum_cpu(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a small CPU tensor (float64 recommended), in place."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.cpu_group)
        return values

    def barrier(self) -> None:
        """Wait for every rank (over the gloo group)."""
        dist.barrier(group=self.cpu_group)


def backend_for(device: torch.device) -> str:
    """``"cpu:gloo,cuda:nccl"`` on a CUDA device, else ``"gloo"``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join(world: WorldInfo, device: torch.device, timeout_s: int) -> Rendezvous:
    """Join the rendezvous at ``tcp://master_addr:master_port``.

    Args:
        world: this rank's place in the job.
        device: this rank's compute device (picks the backend).
        timeout_s: how long the rendezvous and every later collective may wait, seconds.

    Raises:
        LaunchError: the store cannot be reached or a peer does not arrive in ``timeout_s``.
    """
    backend = backend_for(device)
    init_method = f"tcp://{world.master_addr}:{world.master_port}"
    log.info(
        "rank %d/%d joining %s with %s (node %s%s)",
        world.rank,
        world.world_size,
        init_method,
        backend,
        world.node_name,
        "" if world.het_group is None else f", het group {world.het_group}",
    )
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    try:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise LaunchError(
            f"rank {world.rank} could not join the rendezvous at {init_method} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): check that rank 0 runs on "
            f"{world.master_addr} and port {world.master_port} is free and reachable"
        ) from exc
    return Rendezvous(world=world, backend=backend, cpu_group=cpu_group)


def leave() -> None:
    """Destroy the process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@contextlib.contextmanager
def rendezvous(world: WorldInfo, device: torch.device, timeout_s: int) -> Iterator[Rendezvous]:
    """Context manager around :func:`join` that always tears the process group down."""
    rdv: Optional[Rendezvous] = None
    try:
        rdv = join(world, device, timeout_s)
        yield rdv
    finally:
        leave()
