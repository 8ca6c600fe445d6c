"""The optimizer, its learning-rate schedule, and the per-step dropout seed."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hetseq_hpc.config.schema import RunConfig


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the dropout RNG for ``(seed, step, rank)``."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def build_optimizer(model: nn.Module, run: RunConfig):
    """AdamW without weight decay on biases and LayerNorm weights, plus transformers'
    warm-up/decay scheduler."""
    from transformers import get_scheduler

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    optim = run.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
    )
    kind = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}[optim.schedule]
    scheduler = get_scheduler(
        kind, optimizer, num_warmup_steps=optim.warmup_steps,
        num_training_steps=optim.schedule_steps or run.trainer.max_steps,
    )
    return optimizer, scheduler
