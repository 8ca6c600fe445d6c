"""A tiny model with the task models' interface, for calibrations in the tests."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """A small regression model with the task models' interface (``model(**batch) -> loss``)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x, y):
        return ((self.body(x) - y) ** 2).sum()


def batches(n):
    """A batch of ``n`` random samples for :class:`Tiny`."""
    return {"x": torch.randn(n, 32), "y": torch.randn(n, 1)}
