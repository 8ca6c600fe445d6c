"""Rendezvous and the few collectives hetseq_hpc uses outside DDP.

Backends: ranks with CUDA join with ``"cpu:gloo,cuda:nccl"`` (NCCL for CUDA tensors, gloo for
CPU tensors), ranks without CUDA with ``"gloo"``; a job whose ranks mix GPUs and CPUs
(``cluster.devices``) joins with ``"gloo"`` on every rank (:func:`backend_for_job`). Python
objects (probes, allocations, timings) travel over a separate gloo group so they never touch
a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import astuple, dataclass, fields
from datetime import timedelta
from typing import Any, Dict, Iterator, List, MutableMapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from hetseq_hpc.distributed.loopback_store import loopback_store
from hetseq_hpc.env.world import WorldInfo, free_port
from hetseq_hpc.errors import AllocationError, LaunchError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: NCCL settings of an elastic world (in-job recovery): ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
#: (``CleanUpOnly``: the watchdog aborts the communicators of a failed or timed-out collective
#: and the collective raises, but the process lives on to re-form the world; torch's default,
#: 3 ``SkipCleanUp``, and 1 ``TearDown`` end the process, which would kill every survivor).
#: Source: ``ErrorHandlingMode`` in torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (torch 2.13).
ELASTIC_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def set_elastic_nccl_env(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set :data:`ELASTIC_NCCL_ENV` in ``environ`` (default ``os.environ``; read by NCCL process
    groups created afterwards), overriding a user's value with a warning; returns what changed."""
    env = os.environ if environ is None else environ
    changed = {}
    for name, value in ELASTIC_NCCL_ENV.items():
        old = env.get(name)
        if old != value:
            if old is not None:
                log.warning(
                    "%s=%s would end this rank when a peer is lost; in-job recovery "
                    "(trainer.elastic) sets %s",
                    name,
                    old,
                    value,
                )
            env[name] = value
            changed[name] = value
    return changed


@dataclass(frozen=True)
class StepStats:
    """What one rank tells the others at the end of the backward passes of an optimizer step
    (on CPU ranks while the last gradient bucket is being all-reduced, see
    :meth:`Rendezvous.post_step_stats`; on GPU ranks after the backward pass).

    Attributes:
        loss_sum: SUM of the rank's unit losses over its micro-batches (not a mean).
        count: loss units (masked tokens for BERT) the rank processed; the global normaliser
            is the sum over ranks.
        samples: samples the rank processed.
        compute_time_s: forward+backward seconds up to the gradient all-reduce.
        step_time_s: seconds from the step's start to posting these statistics (on CPU: the end
            of its compute; on a GPU: after the backward pass, its all-reduce wait included).
        data_time_s: seconds spent building the rank's batches.
        stop_code: the strongest stop request the rank received
            (:data:`hetseq_hpc.env.preemption.NONE` = 0 when none).
        tail_time_s: seconds of local work between the rank's previous exchange and this
            step's start (clipping, optimizer step, logging): its per-step fixed cost.
        bad_micro: the 1-based index of the rank's first micro-batch whose loss was NaN or
            inf (0: all finite; :mod:`hetseq_hpc.train.nonfinite`).
        joins: the join requests rank 0 saw in the job's store when the step started
            (:mod:`hetseq_hpc.distributed.admission`; 0 on the other ranks and without
            ``trainer.elastic.restarts``).
    """

    loss_sum: float
    count: int
    samples: int
    compute_time_s: float
    step_time_s: float
    data_time_s: float
    stop_code: int = 0
    tail_time_s: float = 0.0
    bad_micro: int = 0
    joins: int = 0


class PendingStats:
    """An all-gather of :class:`StepStats` in flight (:meth:`Rendezvous.post_step_stats`)."""

    def __init__(self, work: dist.Work, gathered: List[torch.Tensor]):
        self._work = work
        self._gathered = gathered

    def result(self) -> List[StepStats]:
        """Wait for the all-gather; every rank's statistics in rank order.

        Raises:
            RuntimeError: a peer failed or the collective timed out
                (``cluster.collective_timeout_s``), as any torch.distributed collective.
        """
        self._work.wait()
        kinds = [f.type for f in fields(StepStats)]
        rows: List[List[Any]] = [
            [int(v) if kind == "int" else float(v) for v, kind in zip(row.tolist(), kinds)]
            for row in self._gathered
        ]
        return [StepStats(*row) for row in rows]


class PendingBarrier:
    """A barrier in flight (:meth:`Rendezvous.post_barrier`)."""

    def __init__(self, work: dist.Work):
        self._work = work

    def done(self) -> bool:
        """True once every rank has posted the barrier (never blocks)."""
        return bool(self._work.is_completed())

    def wait(self) -> None:
        """Wait until every rank has posted it.

        Raises:
            RuntimeError: a peer failed or the collective timed out
                (``cluster.collective_timeout_s``), as any torch.distributed collective.
        """
        self._work.wait()


@dataclass
class Rendezvous:
    """An initialised default process group plus a gloo group for CPU-side objects."""

    world: WorldInfo
    cpu_group: Optional[dist.ProcessGroup]

    def exchange_step_stats(self, stats: StepStats) -> List[StepStats]:
        """Every rank's :class:`StepStats` of this step, in rank order.

        ONE all-gather of a float64 vector per rank over the gloo group (counts stay exact
        as float64 up to 2**53).
        """
        return self.post_step_stats(stats).result()

    def post_step_stats(self, stats: StepStats) -> PendingStats:
        """Start :meth:`exchange_step_stats` without waiting: the all-gather runs on the gloo
        group's threads while this rank goes on (the training loop posts its statistics when
        its backward pass has produced the last gradient bucket, so the exchange overlaps the
        gradient all-reduce instead of following it). Every rank must post exactly once before
        any other collective on the gloo group, and read the result with
        :meth:`PendingStats.result`."""
        mine = torch.tensor(astuple(stats), dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world.world_size)]
        work = dist.all_gather(gathered, mine, group=self.cpu_group, async_op=True)
        return PendingStats(work, gathered)

    def post_barrier(self) -> PendingBarrier:
        """Start a barrier over the gloo group without waiting: a rank that is done with
        something (its calibration) says so and can go on working until :meth:`PendingBarrier.
        done` says every rank is; it must :meth:`PendingBarrier.wait` before any other
        collective on the gloo group."""
        return PendingBarrier(dist.barrier(group=self.cpu_group, async_op=True))

    def check_agreement(self, digest: str, what: str) -> None:
        """Check that every rank computed the same ``digest`` of ``what`` (one all-gather).

        Raises:
            AllocationError: the digests differ; the message names each rank's digest.
        """
        check_same(self.all_gather_objects(digest), what)

    def all_gather_objects(self, obj: T) -> List[T]:
        """Every rank's ``obj`` (picklable), ordered by rank."""
        out: List[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """``obj`` as given on rank ``src`` (picklable; the other ranks' ``obj`` is ignored)."""
        box: List[Any] = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_reduce_sum_cpu(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a small CPU tensor (float64 recommended), in place."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.cpu_group)
        return values

    def barrier(self) -> None:
        """Wait for every rank (over the gloo group)."""
        dist.barrier(group=self.cpu_group)


def check_same(digests: Sequence[str], what: str) -> None:
    """Every rank's digest of ``what`` (in rank order) must be the same.

    Raises:
        AllocationError: the digests differ; the message names each rank's digest.
    """
    if len(set(digests)) != 1:
        per_rank = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
        raise AllocationError(
            f"ranks disagree on the {what} (digest {per_rank}): mixed hetseq_hpc versions? "
            "install the same hetseq_hpc and torch on every node"
        )


def backend_for(device: torch.device) -> str:
    """``"cpu:gloo,cuda:nccl"`` on a CUDA device, else ``"gloo"``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def gloo_for_all(kinds: Optional[Sequence[str]]) -> bool:
    """Whether a job whose ranks are on ``kinds`` (every rank's device kind in rank order,
    ``cluster.devices``; None = not named) runs gloo on every rank: when any rank is on the
    CPU. NCCL cannot span a CPU rank; gloo all-reduces and broadcasts CUDA tensors too."""
    return bool(kinds) and "cpu" in (kinds or ())


def backend_for_job(device: torch.device, kinds: Optional[Sequence[str]] = None) -> str:
    """The backend this rank joins with, the same on every rank of the job: ``"gloo"`` when
    any rank of ``kinds`` is on the CPU (:func:`gloo_for_all`), else :func:`backend_for`
    this rank's ``device`` (every rank alike: all on GPUs, or all on CPUs).

    Args:
        device: this rank's compute device.
        kinds: every rank's device kind (``cuda``/``cpu``) in rank order, or None when the
            job does not name them (each rank's own device decides, as before).
    """
    return "gloo" if gloo_for_all(kinds) else backend_for(device)


def join(
    world: WorldInfo,
    device: torch.device,
    timeout_s: int,
    job: Optional[dist.Store] = None,
    step_timeout_s: Optional[float] = None,
    kinds: Optional[Sequence[str]] = None,
) -> Rendezvous:
    """Join the rendezvous at ``tcp://master_addr:master_port``, or through the job's store.

    Args:
        world: this rank's place in the job.
        device: this rank's compute device (picks the backend).
        timeout_s: how long the rendezvous and every later collective may wait, seconds.
        job: the job's store served by the launcher
            (:func:`hetseq_hpc.distributed.membership.job_store`): generation 0 of an elastic
            world, whose store no rank holds.
        step_timeout_s: accepted for callers of an elastic world and not applied here: start-up
            collectives (calibration, DDP's first broadcast, the contract check) keep
            ``timeout_s``, and the training loop shortens the default group's timeout to the
            step's own (:class:`hetseq_hpc.train.recovery.timeouts.StepTimeout`) once training starts.
        kinds: every rank's device kind (``cluster.devices``), or None; with a CPU rank among
            them every rank joins with gloo (:func:`backend_for_job`).

    Raises:
        LaunchError: the store cannot be reached or a peer does not arrive in ``timeout_s``.
    """
    backend = backend_for_job(device, kinds)
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
    kwargs: Dict[str, Any] = {}
    if device.type == "cuda" and "nccl" in backend:
        kwargs["device_id"] = device
        if job is not None:  # an elastic world: NCCL must not end the survivors
            set_elastic_nccl_env()
    try:
        # a loopback master (cluster=local) gets a store bound to 127.0.0.1 only
        store = (
            dist.PrefixStore("g0/pg", job) if job is not None else loopback_store(world, timeout_s)
        )
        kwargs.update({"store": store} if store is not None else {"init_method": init_method})
        dist.init_process_group(
            backend=backend,
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
    return Rendezvous(world=world, cpu_group=cpu_group)


def leave() -> None:
    """Destroy the process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@contextlib.contextmanager
def rendezvous(
    world: WorldInfo,
    device: torch.device,
    timeout_s: int,
    job: Optional[dist.Store] = None,
    step_timeout_s: Optional[float] = None,
    kinds: Optional[Sequence[str]] = None,
) -> Iterator[Rendezvous]:
    """Context manager around :func:`join` that always tears the process group down (the
    current one: an elastic world may have re-formed it)."""
    rdv: Optional[Rendezvous] = None
    try:
        rdv = join(world, device, timeout_s, job, step_timeout_s, kinds)
        yield rdv
    finally:
        leave()


@contextlib.contextmanager
def single_process_rendezvous(
    device: Optional[torch.device] = None, timeout_s: int = 60
) -> Iterator[Rendezvous]:
    """A real world-size-1 process group on a free loopback port, for running a
    :class:`~hetseq_hpc.train.trainer.Trainer` step in-process (tests, notebooks).

    DDP needs an initialised process group, so this is not a fake: every collective runs
    through gloo with one member.

    Raises:
        LaunchError: a process group already exists in this process, or none could be made.
    """
    if dist.is_initialized():
        raise LaunchError(
            "a torch.distributed process group already exists in this process: "
            "leave it (hetseq_hpc.distributed.rendezvous.leave) before a single-process one"
        )
    world = WorldInfo(
        rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    with rendezvous(world, device or torch.device("cpu"), timeout_s) as rdv:
        yield rdv
