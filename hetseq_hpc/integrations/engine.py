"""The engine as every integration uses it, without a trainer: which samples form global batch
``k`` (:class:`GlobalOrder`), which agreed allocation cuts it (:class:`SplitSchedule`), the
calibration and the agreement on one split, the one per-step exchange of statistics, and online
re-balancing (:class:`Balancer`). Calibration, cost curves, allocation, agreement by digest and
the re-balancer are :mod:`hetseq_hpc.balance`'s, as the native worker uses them. Torch only: the
Lightning, Fabric and accelerate glue sits on top. Design: docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
from dataclasses import astuple, dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetseq_hpc.balance.agree import RankMeta, RankReport, check_device_kinds, report_curves
from hetseq_hpc.balance.allocation import Allocation, allocate
from hetseq_hpc.balance.calibrate import calibrate
from hetseq_hpc.balance.memory import memory_budget_bytes
from hetseq_hpc.balance.placement import (
    CALIBRATION_MICRO_BATCH_MAX,
    CALIBRATION_MICRO_BATCH_MAX_CUDA,
    RankPlacement,
)
from hetseq_hpc.balance.rebalance import Rebalancer
from hetseq_hpc.distributed.rendezvous import Rendezvous, StepStats
from hetseq_hpc.env.hardware import probe
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import AllocationError, ConfigError
from hetseq_hpc.train.sampler import GlobalBatchSampler

log = logging.getLogger(__name__)

#: one rank's table of logged values to combine over ranks: name -> (op, total, weight)
Table = Dict[str, Tuple[str, float, float]]

#: re-balancing interval (steps) of a measured split when ``rebalance_every`` is None (the
#: native ``balance.rebalance_every`` default); never for a forced ``allocation``
AUTO_REBALANCE_EVERY = 10


@dataclass(frozen=True)
class HetSeqSettings:
    """What every integration takes from the user (keyword names as the user gives them).

    Attributes:
        global_batch_size: ``B``, samples of one optimizer step over all ranks.
        allocation: a forced per-rank split (``len == world size``, sums to ``B``); None =
            measured (calibration, cost curves, memory caps).
        max_micro_batch: the largest micro-batch any rank may use; None = its memory cap.
        memory_budget_gb: per-rank memory budget in GiB for the cap; None = free GPU memory, or
            the rank's share of the node's RAM.
        calibration_steps: timed forward+backward passes per rank.
        calibration_micro_batch: micro-batch timed while calibrating; None = ``B / world``
            (at most 16 on a CPU, 256 on a GPU).
        rebalance_every: steps between re-balancing decisions; 0 = never; None =
            :data:`AUTO_REBALANCE_EVERY` for a measured split, never for a forced one.
        rebalance_threshold: relative model error that counts as a speed change.
        seed: seed of the per-epoch shuffle of the training set.
    """

    global_batch_size: int
    allocation: Optional[Tuple[int, ...]] = None
    max_micro_batch: Optional[int] = None
    memory_budget_gb: Optional[float] = None
    calibration_steps: int = 4
    calibration_micro_batch: Optional[int] = None
    rebalance_every: Optional[int] = None
    rebalance_threshold: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(
            isinstance(self.global_batch_size, int) and self.global_batch_size >= 1,
            f"global_batch_size={self.global_batch_size!r} is invalid: give the samples of one "
            "optimizer step over all ranks, an integer >= 1, e.g. global_batch_size=32",
        )
        if self.allocation is not None:
            counts = list(self.allocation)
            need(
                all(isinstance(b, int) and b >= 1 for b in counts)
                and sum(counts) == self.global_batch_size,
                f"allocation={counts} is invalid: give one count >= 1 per rank, summing to "
                f"global_batch_size={self.global_batch_size}, e.g. allocation=[24, 8]",
            )
        for name in ("max_micro_batch", "calibration_micro_batch"):
            value = getattr(self, name)
            need(
                value is None or (isinstance(value, int) and value >= 1),
                f"{name}={value!r} is invalid: give an integer >= 1, or None",
            )
        need(
            self.memory_budget_gb is None
            or (math.isfinite(self.memory_budget_gb) and self.memory_budget_gb > 0),
            f"memory_budget_gb={self.memory_budget_gb!r} is invalid: give GiB > 0, or None for "
            "the device's free memory",
        )
        need(
            isinstance(self.calibration_steps, int) and self.calibration_steps >= 1,
            f"calibration_steps={self.calibration_steps!r} is invalid: it must be >= 1",
        )
        need(
            self.rebalance_every is None
            or (isinstance(self.rebalance_every, int) and self.rebalance_every >= 0),
            f"rebalance_every={self.rebalance_every!r} is invalid: give steps >= 1, 0 for never, "
            "or None for every 10 steps of a measured split",
        )
        need(
            math.isfinite(self.rebalance_threshold) and 0 < self.rebalance_threshold < 1,
            f"rebalance_threshold={self.rebalance_threshold!r} is invalid: use a share in "
            "(0, 1), e.g. 0.1",
        )

    @property
    def rebalance_interval(self) -> int:
        """Steps between re-balancing decisions (0 = never)."""
        if self.rebalance_every is not None:
            return int(self.rebalance_every)
        return 0 if self.allocation is not None else AUTO_REBALANCE_EVERY


class GlobalOrder:
    """Which dataset positions form global batch ``k`` (0-based, counted over the whole run):
    a function of ``(seed, k)`` only, never of the world size or the split, so runs on
    different mixes see the same batches and a resumed run continues where the global step
    says. Shuffled: :class:`hetseq_hpc.train.sampler.GlobalBatchSampler` (a permutation per
    epoch); else the dataset order. Each epoch's incomplete tail is dropped.

    Raises:
        ConfigError: ``global_batch_size`` exceeds the dataset.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool):
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.shuffle = bool(shuffle)
        self._sampler = GlobalBatchSampler(self.num_samples, self.global_batch_size, int(seed))

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per pass over the dataset, ``N // B``."""
        return self._sampler.steps_per_epoch

    def positions(self, index: int) -> np.ndarray:
        """Dataset positions of global batch ``index``, shape ``(B,)``, int64."""
        if self.shuffle:
            return np.asarray(self._sampler.global_batch(index)[1], dtype=np.int64)
        j = index % self.steps_per_epoch
        b = self.global_batch_size
        return np.arange(j * b, (j + 1) * b, dtype=np.int64)


class SplitSchedule:
    """The agreed allocations and the first global batch each one cuts.

    A re-balanced split takes effect at a batch every rank agrees on (:meth:`switch`), after
    whatever the loader has already cut (:attr:`drawn`): a batch is never cut twice.
    """

    def __init__(self, allocation: Allocation):
        self.entries: List[Tuple[int, Allocation]] = [(0, allocation)]
        #: the highest global batch index cut so far (-1: none)
        self.drawn = -1

    def at(self, index: int) -> Allocation:
        """The allocation that cuts global batch ``index``."""
        current = self.entries[0][1]
        for first, allocation in self.entries:
            if first <= index:
                current = allocation
        return current

    @property
    def latest_first(self) -> int:
        """First global batch of the newest allocation."""
        return self.entries[-1][0]

    def switch(self, allocation: Allocation, first: int) -> None:
        """Cut global batches from ``first`` on with ``allocation``.

        Raises:
            AllocationError: batch ``first`` was already cut with the old split (the loader
                read further ahead than the integration allowed for).
        """
        if first <= self.drawn:
            raise AllocationError(
                f"a re-balanced split was to start at global batch {first}, but the loader had "
                f"already cut batch {self.drawn}: lower the loader's num_workers x "
                "prefetch_factor, or report this as a bug"
            )
        self.entries.append((int(first), allocation))

    def micro_positions(self, order: GlobalOrder, index: int, rank: int) -> List[np.ndarray]:
        """Rank ``rank``'s slice of global batch ``index``, cut into its micro-batches."""
        allocation = self.at(index)
        self.drawn = max(self.drawn, int(index))
        share = allocation.shares[rank]
        start = allocation.offsets()[rank]
        mine = order.positions(index)[start : start + share.samples]
        out, at = [], 0
        for size in share.micro_sizes:
            out.append(mine[at : at + size])
            at += size
        return out


def cpu_group(backend: str) -> Any:
    """A gloo group over every rank for Python objects (statistics, reports, digests); the
    default group itself when it is gloo already. Every rank must call it at the same time."""
    return None if backend == "gloo" else dist.new_group(backend="gloo")


def rendezvous_of(
    rank: int,
    local_rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    group: Any,
    source: str = "integration",
) -> Rendezvous:
    """The engine's :class:`~hetseq_hpc.distributed.rendezvous.Rendezvous` over an initialised
    default process group (the framework's), with ``group`` for objects (:func:`cpu_group`)."""
    world = WorldInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        master_addr=master_addr or "127.0.0.1",
        master_port=int(master_port) or 1,
        source=source,
        node_name=socket.gethostname(),
    )
    return Rendezvous(world=world, cpu_group=group)


def calibration_micro_batch(settings: HetSeqSettings, world_size: int, device_type: str) -> int:
    """The micro-batch timed while calibrating (the native rule of
    :func:`hetseq_hpc.balance.placement.calibration_micro_batch`, from the settings)."""
    if settings.calibration_micro_batch:
        size = int(settings.calibration_micro_batch)
    else:
        most = (
            CALIBRATION_MICRO_BATCH_MAX_CUDA
            if device_type == "cuda"
            else CALIBRATION_MICRO_BATCH_MAX
        )
        size = max(1, min(most, settings.global_batch_size // max(int(world_size), 1)))
    if settings.max_micro_batch:
        size = min(size, int(settings.max_micro_batch))
    return size


@contextlib.contextmanager
def untouched(module: nn.Module, device: torch.device):
    """Restore the RNG states and every submodule's train/eval flag afterwards: calibration
    runs real passes, and a training run must not depend on how many it ran."""
    flags = [(m, m.training) for m in module.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, flag in flags:
            m.train(flag)


class Balancer:
    """Calibration, agreement on the split, the per-step exchange and re-balancing of one rank.

    Args:
        settings: the user's :class:`HetSeqSettings`.
        rdv: the engine's rendezvous over the framework's process group (:func:`rendezvous_of`).
        lookahead: global batches the loader may cut beyond the one being trained
            (:func:`hetseq_hpc.integrations.data.lookahead`): a re-balanced split starts that
            many batches after the decision.
    """

    def __init__(self, settings: HetSeqSettings, rdv: Rendezvous, lookahead: int = 0):
        self.settings = settings
        self.rdv = rdv
        self.lookahead = int(lookahead)
        self.schedule: Optional[SplitSchedule] = None
        self.rebalancer: Optional[Rebalancer] = None
        self.reports: List[RankReport] = []
        self.moves: List[Dict[str, Any]] = []
        self._names: Optional[Tuple[str, ...]] = None  # the agreed layout of exchange()

    @property
    def rank(self) -> int:
        """This rank."""
        return self.rdv.world.rank

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.rdv.world.world_size

    def agree(
        self,
        model: nn.Module,
        make_batch: Callable[[int], Dict[str, torch.Tensor]],
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        precision: str = "fp32",
        ranks_on_node: int = 1,
    ) -> Allocation:
        """Calibrate this rank (:func:`hetseq_hpc.balance.calibrate.calibrate` on ``model``,
        whose ``forward(**make_batch(n))`` returns the SUM loss of ``n`` samples), gather every
        rank's report, compute the split (:func:`hetseq_hpc.balance.allocation.allocate`: the
        forced one, else the min-max split of the cost curves under the memory caps) and check
        by digest that every rank computed the same.

        Raises:
            ConfigError: a forced allocation does not have one count per rank.
            AllocationError: a rank cannot fit one sample, ranks mix CUDA and CPU, or the
                digests differ.
        """
        s = self.settings
        world = self.world_size
        if s.allocation is not None and len(s.allocation) != world:
            raise ConfigError(
                f"allocation={list(s.allocation)} has {len(s.allocation)} counts but the job has "
                f"{world} rank(s): give one count per rank, or allocation=None to measure"
            )
        dev = probe(device.index if device.type == "cuda" else None)
        placement = RankPlacement(
            rank=self.rank,
            threads=torch.get_num_threads(),
            emulate_speed=1.0,
            memory_budget_gb=s.memory_budget_gb,
            ranks_on_node=max(int(ranks_on_node), 1),
            partition_key=None,
            partition=self.rdv.world.partition,
            gres=None,
            precision=precision,
            het_group=self.rdv.world.het_group,
        )
        budget = memory_budget_bytes(placement, dev.kind, dev.memory_free_bytes, ranks_on_node)
        with untouched(model, device):
            cal = calibrate(
                model,
                make_batch,
                device,
                calibration_micro_batch(s, world, device.type),
                s.calibration_steps,
                budget,
                s.max_micro_batch,
                autocast,
                wait_for_peers=self.rdv.post_barrier if world > 1 else None,
            )
        here = self.rdv.world
        meta = RankMeta(
            rank=here.rank,
            device=dev.label,
            node=here.node_name,
            het_group=here.het_group,
            partition=here.partition,
            precision=precision,
        )
        mine = RankReport(
            world=here,
            probe=dev,
            calibration=cal,
            meta=meta,
            precision=precision,
            threads=torch.get_num_threads(),
            placement=placement,
        )
        self.reports = [RankReport.of(r) for r in self.rdv.all_gather_objects(mine.to_dict())]
        check_device_kinds([r.probe.kind for r in self.reports])
        caps = [int(r.calibration.max_micro_batch) for r in self.reports]
        for i, cap in enumerate(caps):
            if cap < 1:
                cal_i = self.reports[i].calibration
                need = (cal_i.static_bytes + cal_i.activation_bytes_per_sample) / 2**30
                raise AllocationError(
                    f"rank {i} ({self.reports[i].probe.name}) cannot fit one sample: needs "
                    f"{need:.2f} GiB, has {cal_i.memory_budget_bytes / 2**30:.2f} GiB; raise "
                    "memory_budget_gb if the device has more memory, shrink the model, or leave "
                    "that device out"
                )
        allocation = allocate(
            [float(r.calibration.samples_per_s) for r in self.reports],
            s.global_batch_size,
            caps,
            forced=list(s.allocation) if s.allocation is not None else None,
            curves=report_curves(self.reports),
        )
        self.rdv.check_agreement(allocation.digest(), "allocation")
        self.schedule = SplitSchedule(allocation)
        if s.rebalance_interval and world > 1:
            self.rebalancer = Rebalancer(
                caps=caps, threshold=s.rebalance_threshold, curves=report_curves(self.reports)
            )
        if self.rank == 0:
            log.info(
                "hetseq: allocation %s (%s; micro-batch x accumulation %s)",
                allocation.samples,
                allocation.source,
                [f"{sh.micro_batch}x{sh.accum_steps}" for sh in allocation.shares],
            )
        return allocation

    def exchange(
        self, stats: StepStats, table: Optional[Table] = None
    ) -> Tuple[List[StepStats], List[Table]]:
        """Every rank's statistics of this step and its ``table`` of logged values
        (name -> ``(op, total, weight)``), in rank order: the same collectives on every rank
        whatever its number of micro-batches.

        Once every rank logged the same names, ONE all-gather of a float64 vector (statistics,
        a changed-names flag, the totals and weights in the agreed order); a step where some
        rank's names changed adds one all-gather of the tables as objects (every rank sees the
        flag, so every rank takes it); before that, the objects alone."""
        table = dict(table or {})
        names = tuple(sorted(table))
        if self._names is None:
            gathered = self.rdv.all_gather_objects((stats, table))
            tables = [g[1] for g in gathered]
            self._agree_names(tables)
            return [g[0] for g in gathered], tables
        known = self._names
        row = [*astuple(stats), float(names != known)]
        for name in known:
            _, total, weight = table.get(name, ("mean", 0.0, 0.0))
            row += [total, weight]
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.rdv.cpu_group)
        width = len(astuple(stats))
        per_rank = [StepStats(*r[:width].tolist()) for r in rows]  # float64: exact to 2**53
        if any(r[width].item() for r in rows):
            tables = self.rdv.all_gather_objects(table)
            self._agree_names(tables)
            return per_rank, tables
        ops = {name: op for name, (op, _, _) in table.items()}
        tables = []
        for r in rows:
            values = r[width + 1 :].tolist()
            tables.append(
                {
                    name: (ops[name], values[2 * i], values[2 * i + 1])
                    for i, name in enumerate(known)
                }
            )
        return per_rank, tables

    def _agree_names(self, tables: List[Table]) -> None:
        """The fixed layout of :meth:`exchange`: the names every rank logged, if they agree."""
        sets = {tuple(sorted(t)) for t in tables}
        self._names = sets.pop() if len(sets) == 1 else None

    def after_step(self, index: int, per_rank: List[StepStats], last: bool = False) -> bool:
        """Feed the re-balancer the table of global batch ``index`` (0-based) and, when it is
        due, decide (the same decision on every rank, checked by digest); a new split cuts
        global batches from ``index + 1 + lookahead`` on. Rows of steps still cut by the old
        split after a decision are not fed. Returns whether the split moved.

        Raises:
            AllocationError: the ranks decided differently.
        """
        if self.rebalancer is None or self.schedule is None or last:
            return False
        if self.schedule.latest_first > index:
            return False  # a switch is pending: these steps still run the old split
        self.rebalancer.record(per_rank)
        current = self.schedule.at(index)
        step = index + 1
        if not self.rebalancer.due(step, self.settings.rebalance_interval, current):
            return False
        new = self.rebalancer.observe(step, current)
        self.rdv.check_agreement(
            new.digest() if new is not None else "unchanged",
            f"re-balancing decision at step {step}",
        )
        if new is None:
            return False
        first = index + 1 + self.lookahead
        new = replace(new, step=first + 1)
        self.schedule.switch(new, first)
        why = self.rebalancer.decisions[-1]
        self.moves.append({"at_step": first + 1, "from": current.samples, "to": new.samples})
        if self.rank == 0:
            log.info(
                "hetseq: step %d: re-balancing %s -> %s from step %d (predicted gain %.1f %%)",
                step,
                current.samples,
                new.samples,
                first + 1,
                100 * float(why.get("gain", 0.0)),
            )
        return True


def global_loss(per_rank: Sequence[StepStats]) -> float:
    """The exact mean loss of the global batch: summed unit losses over summed units."""
    units = sum(s.count for s in per_rank)
    return sum(s.loss_sum for s in per_rank) / units if units else float("nan")


def divide_gradients(params: Iterable[torch.Tensor], count: float) -> None:
    """Divide every gradient of ``params`` by the global unit count ``count`` (after the SUM
    all-reduce, before clipping: the result is the gradient of the global mean loss)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, float(count))


__all__ = [
    "AUTO_REBALANCE_EVERY",
    "Balancer",
    "GlobalOrder",
    "HetSeqSettings",
    "SplitSchedule",
    "Table",
    "calibration_micro_batch",
    "cpu_group",
    "divide_gradients",
    "global_loss",
    "rendezvous_of",
    "untouched",
]
