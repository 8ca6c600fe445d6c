"""All ranks agree on one allocation: every rank's start-up report (probe, calibration,
placement) is gathered, each rank computes the same split from the same floats, and a digest
check proves they did (:meth:`hetseq_hpc.distributed.gang.Gang.check_agreement`).
Rank 0 records it in ``allocation.json``."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from hetseq_hpc.balance.allocation import Allocation, allocate
from hetseq_hpc.balance.calibrate import Calibration
from hetseq_hpc.balance.curves import CostCurve
from hetseq_hpc.balance.placement import RankPlacement
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.distributed.rendezvous import gloo_for_all
from hetseq_hpc.env.emulation import Emulation
from hetseq_hpc.env.hardware import DeviceProbe
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import AllocationError
from hetseq_hpc.files.atomic import atomic_write_json
from hetseq_hpc.rundir.paths import RunDir

log = logging.getLogger(__name__)


@dataclass
class RankMeta:
    """Static facts about a rank, reported in metrics.jsonl and allocation.json."""

    rank: int
    device: str
    node: str
    het_group: Optional[int] = None
    partition: Optional[str] = None
    gres: Optional[str] = None
    precision: Optional[str] = None  # what the rank computes in (fp32, bf16, fp16)
    compiled: Optional[bool] = None  # trainer.compile compiles its units (None: not said)


@dataclass(frozen=True)
class RankReport:
    """What one rank tells every other rank at start-up (gathered once, the same on all).

    Attributes:
        probe: the rank's device and its memory.
        calibration: samples/s, cost curve, memory figures in bytes, ``max_micro_batch`` in
            samples.
        world: the rank's place in the job (rank, node, het component).
        meta: the rank's facts for metrics.jsonl and allocation.json.
        precision: the rank's resolved precision (fp32, bf16, fp16).
        threads: torch CPU threads of the rank.
        emulation: how its speed is emulated (``cluster.speeds``), or None.
        placement: how the rank runs (partition, memory budget), or None.
    """

    probe: DeviceProbe
    calibration: Calibration
    world: WorldInfo
    meta: RankMeta
    precision: str = "fp32"
    threads: int = 1
    emulation: Optional[Emulation] = None
    placement: Optional[RankPlacement] = None

    @classmethod
    def of(cls, value: Union[RankReport, Mapping[str, Any]]) -> RankReport:
        """``value`` itself, or the report a plain mapping of :meth:`to_dict` describes."""
        return value if isinstance(value, RankReport) else cls.from_dict(value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankReport:
        """Inverse of :meth:`to_dict`."""
        emulation, placement = data.get("emulation"), data.get("placement")
        return cls(
            probe=DeviceProbe.from_dict(data["probe"]),
            calibration=Calibration(**data["calibration"]),
            world=WorldInfo(**data["world"]),
            meta=RankMeta(**data["meta"]),
            precision=str(data.get("precision", "fp32")),
            threads=int(data.get("threads", 1)),
            emulation=None
            if emulation is None
            else Emulation(**{**emulation, "exempt_threads": tuple(emulation["exempt_threads"])}),
            placement=None if placement is None else RankPlacement(**placement),
        )

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (what travels between ranks): each part's ``to_dict``."""
        return {
            "probe": self.probe.to_dict(),
            "calibration": self.calibration.to_dict(),
            "world": self.world.to_dict(),
            "meta": asdict(self.meta),
            "precision": self.precision,
            "threads": self.threads,
            "emulation": None if self.emulation is None else self.emulation.to_dict(),
            "placement": None if self.placement is None else self.placement.to_dict(),
        }


def agree_on_allocation(run: RunConfig, reports: Sequence[RankReport], rdv: Gang) -> Allocation:
    """Compute the allocation from every rank's report and check that all ranks got the same.

    Raises:
        AllocationError: a rank cannot fit one sample, ranks mix CUDA and CPU where the job
            did not name its devices (``cluster.devices``: then NCCL would span them), or
            digests differ.
    """
    check_device_kinds([r.probe.kind for r in reports], gloo_for_all(run.cluster.device_kinds()))
    caps = [int(r.calibration.max_micro_batch) for r in reports]
    shard_hint = (
        "shard the model state (sharding.mode=fsdp, or auto), "
        if run.sharding.mode == "none"
        else "use activation checkpointing (sharding.activation_checkpointing=true), "
    )
    for i, cap in enumerate(caps):
        if cap < 1:
            cal = reports[i].calibration
            placement = reports[i].placement
            key = placement.partition_key if placement is not None else None
            knob = (
                f"cluster.partitions.{key}.memory_budget_gb"
                if key
                else f"cluster.memory_budgets_gb[{i}]"
                if getattr(run.cluster, "memory_budgets_gb", None)
                else "cluster.memory_budget_gb"
            )
            raise AllocationError(
                f"rank {i} ({reports[i].probe.name}) cannot fit one sample: needs "
                f"{(cal.static_bytes + cal.activation_bytes_per_sample) / 2**30:.2f} GiB, "
                f"has {cal.memory_budget_bytes / 2**30:.2f} GiB (memory budget {knob}, unset = "
                f"the device's free memory); {shard_hint}raise {knob} if the device has more "
                "memory, shrink task.model, or leave that device out"
            )
    throughputs = [float(r.calibration.samples_per_s) for r in reports]
    allocation = allocate(
        throughputs,
        run.trainer.global_batch_size,
        caps,
        forced=run.balance.allocation,
        curves=report_curves(reports),
    )
    rdv.check_agreement(allocation.digest(), "allocation")
    return allocation


def check_device_kinds(kinds: Sequence[str], gloo: bool = False) -> None:
    """Every rank's device kind (``cuda`` or ``cpu``), in rank order, must be the same, unless
    every rank joined with gloo (``gloo``: the job named its devices, ``cluster.devices``, with
    a CPU rank among them; :func:`~hetseq_hpc.distributed.rendezvous.backend_for_job`): gloo
    all-reduces CUDA and CPU tensors alike, NCCL cannot reach a CPU rank.

    Raises:
        AllocationError: one line naming each rank's kind and the fix.
    """
    if len(set(kinds)) > 1 and not gloo:
        where = ", ".join(f"rank {i}: {k}" for i, k in enumerate(kinds))
        raise AllocationError(
            f"ranks mix CUDA and CPU devices ({where}): NCCL cannot span both; give "
            "every rank a GPU, run all on CPU (CUDA_VISIBLE_DEVICES=), or name each rank's "
            "device (cluster=local cluster.devices=[cuda,cpu]: gloo for all)"
        )


def agree_on_sharding(
    mode: str,
    param_bytes: float,
    memory_budget_bytes: float,
    rdv: Gang,
    device_kind: str = "cpu",
    gloo: bool = False,
) -> str:
    """The data-parallel mode every rank uses, from ``sharding.mode``: ``none`` -> ``ddp``,
    ``fsdp`` -> ``fsdp``, ``auto`` -> ``ddp`` when a full replica fits every rank's memory
    budget with room for activations (:func:`hetseq_hpc.balance.memory.replica_fits`; DDP is
    faster), else ``fsdp``. Every rank's verdict and device kind are gathered (one small
    all-gather), so all ranks decide alike.

    Args:
        mode: ``sharding.mode``.
        param_bytes: the model's parameter bytes.
        memory_budget_bytes: this rank's budget (:func:`~hetseq_hpc.balance.memory.memory_budget_bytes`).
        rdv: the joined rendezvous.
        device_kind: this rank's device kind; every rank's must match (checked here, before
            any sharding collective) unless every rank runs gloo (``gloo``).
        gloo: every rank joined with gloo (:func:`check_device_kinds`).

    Raises:
        AllocationError: ranks mix CUDA and CPU devices (:func:`check_device_kinds`), or
            ``auto`` picked FSDP for ranks that mix them (FSDP2 shards over one device type).
    """
    from hetseq_hpc.balance.memory import replica_fits

    verdicts = rdv.all_gather_objects(
        (device_kind, bool(replica_fits(memory_budget_bytes, param_bytes)))
    )
    kinds = [kind for kind, _ in verdicts]
    check_device_kinds(kinds, gloo)
    if mode != "auto":
        return "fsdp" if mode == "fsdp" else "ddp"
    fits = [ok for _, ok in verdicts]
    chosen = "ddp" if all(fits) else "fsdp"
    if chosen == "fsdp" and len(set(kinds)) > 1:
        short = [r for r, ok in enumerate(fits) if not ok]
        raise AllocationError(
            f"sharding.mode=auto: a full replica does not fit rank(s) {short}, and FSDP "
            f"cannot span ranks that mix GPUs and CPUs ({', '.join(kinds)}): raise those "
            "ranks' memory budget, shrink task.model, or use the same device on every rank"
        )
    if rdv.world.rank == 0:
        short = [r for r, ok in enumerate(fits) if not ok]
        log.info(
            "sharding.mode=auto -> %s (%s)",
            chosen,
            "a full replica fits every rank"
            if chosen == "ddp"
            else f"a full replica does not fit rank(s) {short}",
        )
    return chosen


def agree_on_units(
    setting: str, param_bytes: float, memory_budget_bytes: float, units: int, rdv: Gang
) -> bool:
    """Whether FSDP shards the task's ``units`` sharding units as ONE group (every rank alike),
    from ``sharding.units``: ``one`` -> yes, ``per_unit`` -> no, ``auto`` -> yes when a full
    replica fits every rank's memory budget with room for activations
    (:func:`hetseq_hpc.balance.memory.replica_fits`, as ``sharding.mode=auto`` decides DDP):
    one group then holds at most the whole weights and their gradients beside the rank's
    shard, no more than a DDP replica, and gathers once per pass instead of once per unit
    (FSDP2's host work per unit dominates a small model's step: docs/design/sharding.md). Fewer
    than two units: nothing to group (False). One small all-gather for ``auto``.

    Args:
        setting: ``sharding.units`` (``auto``, ``per_unit`` or ``one``).
        param_bytes: the model's parameter bytes; memory_budget_bytes: this rank's budget.
        units: how many sharding units the task names.
        rdv: the joined rendezvous (every rank calls this at the same point).
    """
    from hetseq_hpc.balance.memory import replica_fits, units_grouped

    if units < 2:
        return False
    if setting != "auto":  # one / per_unit: nothing to gather
        return units_grouped(setting, False)
    fits = rdv.all_gather_objects(bool(replica_fits(memory_budget_bytes, param_bytes)))
    grouped = units_grouped(setting, all(fits))
    if rdv.world.rank == 0:
        log.info(
            "sharding.units=auto -> %s (%s)",
            "one" if grouped else "per_unit",
            f"a full replica fits every rank: the {units} units gathered as one group"
            if grouped
            else "a full replica does not fit rank(s) "
            f"{[r for r, ok in enumerate(fits) if not ok]}: each of the {units} units alone",
        )
    return grouped


def report_curves(reports: Sequence[RankReport]) -> Optional[List[CostCurve]]:
    """Every rank's calibrated cost curve (:mod:`hetseq_hpc.balance.curves`), from the same gathered
    floats on every rank; None when a report has no fit (then the split follows samples/s)."""
    cals = [r.calibration for r in reports]
    if not all(float(c.per_sample_s or 0) > 0 for c in cals):
        return None
    return [
        CostCurve(
            c.overhead_s,
            c.per_sample_s,
            c.step_fixed_s,
            c.host_s,
            c.host_per_sample_s,
        )
        for c in cals
    ]


def write_allocation_json(
    run_dir: RunDir,
    allocation: Allocation,
    reports: Sequence[RankReport],
    extra: Optional[Dict[str, Any]] = None,
) -> Path:
    """Rank 0 writes ``allocation.json``: the split, the digest, and every rank's world, probe,
    calibration and placement (het component, partition, GRES)."""
    data = {
        "allocation": allocation.to_dict(),
        "digest": allocation.digest(),
        "ranks": [
            {
                **asdict(r.meta),
                "world": r.world.to_dict(),
                "probe": r.probe.to_dict(),
                "calibration": r.calibration.to_dict(),
                "precision": r.precision,
                "emulation": None if r.emulation is None else r.emulation.to_dict(),
                "share": allocation.to_dict()["shares"][i],
            }
            for i, r in enumerate(reports)
        ],
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if extra:
        data.update(extra)
    path = run_dir.allocation
    atomic_write_json(path, data)
    return path


__all__ = [
    "RankMeta",
    "RankReport",
    "agree_on_allocation",
    "agree_on_sharding",
    "agree_on_units",
    "report_curves",
    "write_allocation_json",
]
