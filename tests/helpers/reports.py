"""Start-up reports (hetseq_hpc.balance.agree.RankReport) of made-up CPU ranks, for the
agreement tests in one process."""

from __future__ import annotations

from typing import Optional

from hetseq_hpc.balance.agree import RankMeta, RankReport
from hetseq_hpc.balance.calibrate import Calibration
from hetseq_hpc.balance.placement import RankPlacement
from hetseq_hpc.env.hardware import DeviceProbe
from hetseq_hpc.env.world import WorldInfo

GiB = 2.0**30


def rank_report(
    rank: int = 0,
    world_size: int = 1,
    *,
    samples_per_s: float = 10.0,
    max_micro_batch: int = 4,
    static_bytes: float = 2 * GiB,
    activation_bytes_per_sample: float = 0.5 * GiB,
    memory_budget_bytes: float = 8 * GiB,
    per_sample_s: float = 0.0,
    overhead_s: float = 0.0,
    kind: str = "cpu",
    partition_key: Optional[str] = None,
) -> RankReport:
    """The report of rank ``rank`` of ``world_size``: a ``kind`` device named ``kind`` whose
    calibration has the given figures (bytes, samples/s, seconds)."""
    world = WorldInfo(
        rank=rank, local_rank=rank, world_size=world_size, master_addr="n0", master_port=29500
    )
    return RankReport(
        probe=DeviceProbe(kind=kind, name=kind, hostname="n0"),
        calibration=Calibration(
            samples_per_s=samples_per_s,
            micro_batch=max(max_micro_batch, 1),
            activation_bytes_per_sample=activation_bytes_per_sample,
            static_bytes=static_bytes,
            memory_budget_bytes=memory_budget_bytes,
            max_micro_batch=max_micro_batch,
            overhead_s=overhead_s,
            per_sample_s=per_sample_s,
        ),
        world=world,
        meta=RankMeta(rank=rank, device=kind, node="n0"),
        placement=RankPlacement(
            rank=rank,
            threads=1,
            emulate_speed=1.0,
            memory_budget_gb=None,
            ranks_on_node=world_size,
            partition_key=partition_key,
            partition=partition_key,
            gres=None,
            precision="fp32",
            het_group=None,
        ),
    )
