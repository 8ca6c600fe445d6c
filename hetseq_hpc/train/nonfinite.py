"""A training step whose loss is NaN or inf: where it appeared and what it points to.

Every rank sends the SUM of its micro-batches' losses in the step's exchange
(:class:`~hetseq_hpc.distributed.rendezvous.StepStats`) with the 1-based index of its first
micro-batch whose loss was not finite (``bad_micro``), so every rank sees the same table and
stops at the same step, BEFORE the optimizer applies it (:meth:`Trainer.train_step
<hetseq_hpc.train.trainer.Trainer.train_step>`): the model stays that of the last good step, which
:meth:`~hetseq_hpc.train.trainer.Trainer.keep_good_steps` checkpoints (also with ``trainer.checkpoint_every=0``).

The advice depends on when: at the first step of a run that never updated the model (the
seeded start model), no learning rate was involved yet, so the task's model, loss or data
produce it; after updates, the training diverged (learning rate, warm-up, a low-precision rank).
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch

from hetseq_hpc.distributed.rendezvous import StepStats
from hetseq_hpc.errors import NonFiniteLoss


def first_nonfinite(losses: Sequence[torch.Tensor]) -> int:
    """The 1-based index of the first of ``losses`` (0-dim tensors, one per micro-batch) that
    is NaN or inf; 0 when all are finite. Reads the values (one device synchronisation)."""
    if not losses:
        return 0
    bad = (~torch.isfinite(torch.stack([x.double() for x in losses]))).nonzero()
    return int(bad[0, 0]) + 1 if bad.numel() else 0


def where(table: Sequence[StepStats]) -> List[str]:
    """``rank R (micro-batch J, loss nan)`` for every rank whose loss sum in ``table`` (the
    step's StepStats, in rank order) is not finite."""
    out = []
    for rank, stats in enumerate(table):
        if not math.isfinite(stats.loss_sum):
            at = f"micro-batch {stats.bad_micro}, " if stats.bad_micro else ""
            out.append(f"rank {rank} ({at}loss {stats.loss_sum})")
    return out


def nonfinite_error(
    step: int,
    table: Sequence[StepStats],
    updates: int,
    lr: float,
    warmup_steps: int,
    precisions: Sequence[str],
) -> NonFiniteLoss:
    """The error of step ``step`` whose exchange ``table`` holds a non-finite loss.

    Args:
        step: the optimizer step (1-based); table: every rank's StepStats of it.
        updates: optimizer steps applied to the model before this one (0: the start model;
            a resumed run counts the checkpoint's).
        lr: ``optim.lr``; warmup_steps: ``optim.warmup_steps``.
        precisions: every rank's compute precision (fp32, bf16, fp16), in rank order.

    Returns:
        a :class:`NonFiniteLoss` whose one-line message names the step, the ranks and
        micro-batches, and the likely cause; :meth:`~hetseq_hpc.train.trainer.Trainer.keep_good_steps` adds what was
        checkpointed.
    """
    found = where(table) or ["the global loss"]
    bad = [r for r, s in enumerate(table) if not math.isfinite(s.loss_sum)]
    head = f"the loss is not finite at step {step}: {', '.join(found)}"
    if updates == 0:
        advice = (
            "before any update, so not the learning rate: the task's model, loss or data "
            "produce it (a log or division of 0, NaN/inf in the inputs, an uninitialised "
            "weight); check them on those micro-batches"
        )
    else:
        low = [r for r in bad if r < len(precisions) and precisions[r] in ("bf16", "fp16")]
        advice = (
            f"after {updates} update(s) the training diverged: lower optim.lr (now {lr:g}) or "
            f"raise optim.warmup_steps (now {warmup_steps})"
        )
        if low:
            ranks = ", ".join(str(r) for r in low)
            advice += (
                f", or train rank(s) {ranks} in fp32 (they compute in "
                f"{'/'.join(sorted({precisions[r] for r in low}))}: precision.default=fp32)"
            )
    return NonFiniteLoss(f"{head}; {advice}; the step was not applied", step)


def gradient_error(step: int, norm: float, updates: int, lr: float) -> NonFiniteLoss:
    """The error of step ``step`` whose every loss was finite but whose summed gradient's norm
    (``norm``) was not: the fused optimizer skipped the update on the device, so the model is
    that of step ``step - 1`` (``updates`` optimizer steps applied before it)."""
    return NonFiniteLoss(
        f"the gradient is not finite at step {step} (norm {norm}) although every rank's loss is "
        f"finite, after {updates} update(s): an overflow in the backward pass; lower optim.lr "
        f"(now {lr:g}) or train the low-precision ranks in fp32 (precision.default=fp32); "
        "the step was not applied",
        step,
    )


__all__ = ["first_nonfinite", "gradient_error", "nonfinite_error", "where"]
