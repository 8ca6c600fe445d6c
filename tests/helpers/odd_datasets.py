"""``task=dataset`` build functions a user may get wrong (tests): empty, huge, ragged or
iterable datasets and a loss_fn that returns the MEAN. Items are drawn from their index, so
any position of a 10**12-item dataset is cheap to read."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset


class Indexed(Dataset):
    """``n`` items ``{"x": 4 floats, "y": 0 or 1}``, item ``i`` drawn from seed ``i % 1000``."""

    def __init__(self, n: int, ragged: bool = False):
        self.n, self.ragged = n, ragged

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(int(i) % 1000)
        width = 3 + int(i) % 3 if self.ragged else 4
        return {"x": torch.randn(width, generator=g), "y": torch.tensor(int(i) % 2)}


class Stream(IterableDataset):
    def __iter__(self):
        yield {"x": torch.zeros(4), "y": torch.tensor(0)}


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y, reduction="sum")


def mean_loss(model, batch):
    """The mistake: PyTorch's default reduction='mean'."""
    return F.cross_entropy(model.lin(batch["x"]), batch["y"])


def build(n: int = 64, val: int = -1, ragged: bool = False, stream: bool = False):
    """``n`` training items (a 10**12 one is fine: nothing is read up front), ``val`` >= 0
    validation items (-1: none), items of 3..5 floats with ``ragged``, an IterableDataset with
    ``stream``."""
    parts = {"train": Stream() if stream else Indexed(n, ragged), "model": Linear()}
    if val >= 0:
        parts["val"] = Indexed(val)
    return parts


def build_mean():
    return {"train": Indexed(64), "model": Linear(), "loss_fn": mean_loss}
