"""The ``comm`` group: how gradients travel between the ranks.

Read by :class:`hetseq_hpc.train.precision.GradientPath` and the DDP communication hooks
(:mod:`hetseq_hpc.train.ddp_hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hetseq_hpc.config.common import require, require_finite


@dataclass
class CommConfig:
    """Gradient all-reduce: payload dtype, bucket size, and how rank gradients combine."""

    # gradient all-reduce payload: none (fp32), bf16 or fp16 (cast per bucket, still a SUM)
    grad_compression: str = "none"
    # DDP gradient bucket size in MiB; null = DDP's default (25)
    bucket_cap_mb: Optional[float] = None
    # sum = exact global-batch gradient; adasum = Adasum of each rank's own mean gradient
    # (Maleki et al. 2020; NOT the exact global-batch update; power-of-two world sizes only)
    grad_combine: str = "sum"

    def __post_init__(self) -> None:
        require_finite(self, "comm")
        require(
            self.grad_compression in ("none", "bf16", "fp16"),
            f"comm.grad_compression={self.grad_compression!r} is unknown: use none, bf16 or fp16",
        )
        if self.bucket_cap_mb is not None:
            require(
                self.bucket_cap_mb > 0,
                f"comm.bucket_cap_mb={self.bucket_cap_mb} is "
                "invalid: use a size > 0 in MiB, or null for DDP's default 25",
            )
        require(
            self.grad_combine in ("sum", "adasum"),
            f"comm.grad_combine={self.grad_combine!r} is unknown: use sum or adasum",
        )
