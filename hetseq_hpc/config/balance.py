"""The ``balance`` group: how the global batch is split over the ranks, measured and re-balanced.

Read by :mod:`hetseq_hpc.balance` (calibration, allocation, online re-balancing) and by the
planner; the global batch itself is the training loop's (``trainer.global_batch_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from hetseq_hpc.config.common import require, require_finite

#: re-balancing interval (steps) when balance.rebalance_every is null and the split is measured
AUTO_REBALANCE_EVERY = 10


@dataclass
class BalanceConfig:
    """The split of each global batch: forced or measured, its caps, and online re-balancing."""

    # forced per-rank sample counts, e.g. [24, 8], summing to trainer.global_batch_size;
    # null = proportional to measured throughput
    allocation: Optional[List[int]] = None
    # largest micro-batch any rank may use (memory caps may lower it); null = no extra cap
    max_micro_batch: Optional[int] = None
    # timed forward+backward passes per rank (after 1 warm-up pass), alternating the
    # calibration micro-batch and a quarter of it; the fastest of each size fits the cost curve
    # (a rank done before the slowest one times more of them while it waits, at most 16)
    calibration_steps: int = 4
    # micro-batch used while calibrating; null = global batch / world size (at most 16 on a CPU,
    # 256 on a GPU, where fewer samples time the kernel launches, not the samples)
    calibration_micro_batch: Optional[int] = None
    # every N steps ranks refit their cost curves from measured step times and may re-balance;
    # 0 = never; null = every 10 steps when the split is measured, never with balance.allocation
    rebalance_every: Optional[int] = None
    # straggle (max - min) / mean of per-rank compute time that triggers a re-balance
    rebalance_threshold: float = 0.1

    def __post_init__(self) -> None:
        require_finite(self, "balance")
        if self.allocation is not None:
            require(
                len(self.allocation) >= 1 and all(int(b) >= 1 for b in self.allocation),
                f"balance.allocation={list(self.allocation)} is invalid: give every rank at least "
                "one sample, e.g. balance.allocation=[24,8]",
            )
        if self.max_micro_batch is not None:
            require(
                self.max_micro_batch >= 1,
                f"balance.max_micro_batch={self.max_micro_batch} is invalid: it must be >= 1",
            )
        if self.calibration_micro_batch is not None:
            require(
                self.calibration_micro_batch >= 1,
                f"balance.calibration_micro_batch={self.calibration_micro_batch} is invalid: use "
                ">= 1, or null for global batch / world size (at most 16 on a CPU, 256 on a GPU)",
            )
        require(
            self.calibration_steps >= 1,
            f"balance.calibration_steps={self.calibration_steps} is invalid: use >= 1",
        )
        require(
            self.rebalance_every is None or self.rebalance_every >= 0,
            f"balance.rebalance_every={self.rebalance_every} is invalid: it must be >= 0",
        )
        require(
            self.rebalance_threshold > 0,
            f"balance.rebalance_threshold={self.rebalance_threshold} is invalid: it must be > 0",
        )

    @property
    def rebalance_interval(self) -> int:
        """Steps between re-balancing decisions (0 = never): ``rebalance_every`` when given,
        else :data:`AUTO_REBALANCE_EVERY` for a measured split and 0 for a forced
        ``balance.allocation`` (the user's split is kept)."""
        if self.rebalance_every is not None:
            return int(self.rebalance_every)
        return 0 if self.allocation is not None else AUTO_REBALANCE_EVERY
