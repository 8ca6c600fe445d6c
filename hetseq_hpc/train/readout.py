"""A step's results that stay on the device until the next step reads them: no host sync.

A steady-state step (:meth:`~hetseq_hpc.train.trainer.Trainer.train_step` with
``settle=False``) ends with its global loss sum, this rank's loss sum, the gradient norm and
each micro-batch's loss copied to host memory without waiting (``non_blocking``, pinned on a
GPU) and a CUDA event after the copy; the next step reads them once its own work is queued
(the event has long passed then), or a validation, checkpoint or stop of that step reads them
first. Whether the update was applied was decided on the device (the fused optimizer's
``found_inf``): a non-finite loss or norm skips it there, so a step read late that was bad
left the model as it was. Why it stays exact: docs/design/exact-gradients.md, "No host
synchronisation in a step".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hetseq_hpc.train.records import StepRecord


@dataclass
class PendingStep:
    """One step's device results on their way to the host.

    Attributes:
        rec: the step's record (``loss``, ``grad_norm`` NaN until :meth:`read`).
        values: float64 ``[global loss sum, this rank's loss sum, gradient norm, loss of each
            micro-batch ...]`` in host memory (filled when ``copied`` has passed).
        copied: CUDA event recorded after the copy (None on a CPU rank: already there).
        timing: CUDA events of the step's start and its last gradient bucket (None on a CPU).
        restore: the scheduler's state and each group's learning rate before the step (put back
            when the step turns out bad: it was not applied).
        row: the step's ``metrics.jsonl`` row once its phase was reached (written when read).
        last_val: the validation shown with its progress line.
    """

    rec: StepRecord
    values: torch.Tensor
    copied: Optional[Any] = None
    timing: Tuple[Optional[Any], Optional[Any]] = (None, None)
    restore: Tuple[Dict[str, Any], List[float]] = field(default_factory=lambda: ({}, []))
    row: Optional[Dict[str, Any]] = None
    last_val: Optional[Dict[str, float]] = None
    read_values: Optional[List[float]] = None

    @classmethod
    def capture(
        cls,
        rec: StepRecord,
        global_loss: torch.Tensor,
        local_loss: torch.Tensor,
        norm: torch.Tensor,
        micro_losses: Sequence[torch.Tensor],
        restore: Tuple[Dict[str, Any], List[float]],
        timing: Tuple[Optional[Any], Optional[Any]] = (None, None),
    ) -> PendingStep:
        """Start the copy of the step's 0-dim device tensors to the host (no wait)."""
        parts = [global_loss.double(), local_loss.double(), norm.detach().double()]
        parts += [x.detach().double() for x in micro_losses]
        on_device = torch.stack(parts)
        values = on_device.to("cpu", non_blocking=True)  # pinned when on_device is CUDA
        copied = None
        if on_device.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        return cls(rec, values, copied, timing, restore)

    def read(self) -> List[float]:
        """The values (waits for this step's copy only: the device's queue runs on)."""
        if self.read_values is None:
            if self.copied is not None:
                self.copied.synchronize()
            self.read_values = self.values.tolist()
        return self.read_values

    @property
    def global_loss_sum(self) -> float:
        """The loss sum over every rank."""
        return self.read()[0]

    @property
    def local_loss_sum(self) -> float:
        """This rank's loss sum."""
        return self.read()[1]

    @property
    def norm(self) -> float:
        """The global gradient norm (before clipping)."""
        return self.read()[2]

    def bad_micro(self) -> int:
        """The 1-based index of this rank's first micro-batch with a non-finite loss (0: none)."""
        for j, value in enumerate(self.read()[3:], 1):
            if not math.isfinite(value):
                return j
        return 0

    def compute_seconds(self) -> Optional[float]:
        """Seconds from the step's start to its last gradient bucket on the GPU clock, or None
        (a CPU rank; no bucket event)."""
        start, end = self.timing
        if start is None or end is None:
            return None
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


__all__ = ["PendingStep"]
