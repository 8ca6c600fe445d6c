"""The optimizer, its learning-rate schedule, and the per-step dropout seed."""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.env.hardware import adamw_kernel


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the dropout RNG for ``(seed, step, rank)``."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def _warmup_linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    """LR factor: 0 -> 1 over the warm-up, then linear to 0 at ``num_training_steps``."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(
        0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps))
    )


def _warmup_cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5
) -> float:
    """LR factor: 0 -> 1 over the warm-up, then half a cosine (``num_cycles`` 0.5) to 0 at
    ``num_training_steps`` (Loshchilov & Hutter 2017, SGDR, without restarts)."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _warmup_constant(step: int, *, num_warmup_steps: int) -> float:
    """LR factor: 0 -> 1 over the warm-up, then 1."""
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` for ``schedule`` in ``{"linear", "cosine", "constant"}``, with a linear
    warm-up over ``warmup_steps`` optimizer steps; linear and cosine reach 0 at ``total_steps``.

    The factors are transformers' ``get_scheduler("linear" | "cosine" | "constant_with_warmup")``
    formulas (the same LR at every step, float for float) and the scheduler is the same class
    with the same ``state_dict``, so checkpoints written with transformers' schedulers resume.
    Raises ``KeyError`` for another schedule name (the config validates it first).
    """
    factor = {
        "linear": functools.partial(
            _warmup_linear, num_warmup_steps=warmup_steps, num_training_steps=total_steps
        ),
        "cosine": functools.partial(
            _warmup_cosine,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            num_cycles=0.5,
        ),
        "constant": functools.partial(_warmup_constant, num_warmup_steps=warmup_steps),
    }[schedule]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_lr(run: RunConfig) -> float:
    """``optim.lr``, the schedule's peak (a null one is its case's default: RunConfig sets it
    when it is built, so this is the same number)."""
    lr = run.optim.lr
    return run.optim.default_lr(run.random_init) if lr is None else float(lr)


def build_optimizer(
    model: nn.Module, run: RunConfig
) -> Tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without weight decay on biases and LayerNorm weights, plus the warm-up/decay
    scheduler of :func:`build_scheduler`. Returns ``(optimizer, scheduler)``."""
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    optim = run.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=peak_lr(run),
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
        **adamw_kernel(decay + no_decay),
    )
    scheduler = build_scheduler(
        optimizer, optim.schedule, optim.warmup_steps, optim.schedule_steps or run.trainer.max_steps
    )
    return optimizer, scheduler


def apply_configured_lr(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float
) -> Optional[float]:
    """After a resume: make ``lr`` (this run's ``optim.lr``) the schedule's peak, continuing at
    the checkpoint's step. A checkpoint restores the optimizer's and the scheduler's own peak,
    so a lowered ``optim.lr`` (the fix of a diverged run) was silently ignored; the schedule's
    shape (warm-up, decay) is rebuilt from the config already. Nothing changes when the
    peaks are equal (an exact resume stays bit for bit).

    Returns:
        the checkpoint's peak learning rate when it differed from ``lr``, else None.
    """
    old = [float(b) for b in scheduler.base_lrs]
    if all(b == float(lr) for b in old):
        return None
    scheduler.base_lrs = [float(lr)] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = float(lr)
        group["lr"] = float(lr) * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return old[0]
