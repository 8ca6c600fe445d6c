"""What the trainer needs from a task. A task owns its data, model and loss normaliser."""

from __future__ import annotations

from typing import Dict, Protocol, Sequence

import torch
from torch import nn


class Task(Protocol):
    """Interface every task implements (see :class:`hetseq_hpc.tasks.bert.task.BertTask`).

    The model's ``forward(**batch)`` returns the SUM of per-unit losses (units: masked tokens
    for BERT), and :meth:`count` gives the number of units in a batch before any forward pass,
    so the trainer can normalise by the GLOBAL count across ranks.
    """

    name: str

    def prepare(self) -> None:
        """Build caches (tokenizer, packed data). Run on one rank before the others load."""

    def load(self) -> None:
        """Open the prepared data (every rank)."""

    @property
    def num_train(self) -> int:
        """Training samples."""

    @property
    def num_val(self) -> int:
        """Validation samples."""

    @property
    def tokens_per_sample(self) -> int:
        """Tokens in one sample (for tokens/s)."""

    def build_model(self) -> nn.Module:
        """A fresh model on the CPU; the caller seeds the RNG first."""

    def make_batch(self, positions: Sequence[int], epoch: int, split: str) -> Dict[str, torch.Tensor]:
        """The batch of split positions ``positions`` (0-based within the split)."""

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Loss units in ``batch`` (the normaliser), known before the forward pass."""

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one sample, for MFU."""
