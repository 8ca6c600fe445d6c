"""Tiny models the in-process sharding tests share."""

from __future__ import annotations

from torch import nn


class TwoBlockNet(nn.Module):
    """Two blocks in an ``nn.ModuleList`` (the default sharding units) and a head: input
    ``(N, 4)``, output a scalar (the sum of the head's outputs)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 4), nn.ReLU())]
        )
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()
