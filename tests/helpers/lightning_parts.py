"""Lightning objects for tests/unit/test_integrations_lightning.py, in a module of their own so
that the test file imports Lightning (~5 CPU-s with torchmetrics) when its first test runs,
on one pytest-xdist worker, rather than while every worker collects the suite."""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from examples.lightning_mlp import TinyClassifier
from hetseq_hpc.integrations.cluster import HetJobEnvironment, launched_for_us
from hetseq_hpc.integrations.lightning import HetSeqStrategy, check_lightning_version, step_loss


def trainer(module: Optional[L.LightningModule] = None, **kwargs) -> L.Trainer:
    """A CPU ``L.Trainer`` (1 device, no logger, checkpoints, bar or summary) with
    ``HetSeqStrategy(global_batch_size=8)`` unless ``strategy`` is given, connected to
    ``module`` (default a :class:`TinyClassifier`)."""
    strategy = kwargs.pop("strategy", None) or HetSeqStrategy(global_batch_size=8)
    made = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"devices": 1, **kwargs},
    )
    made.strategy.connect(module or TinyClassifier())
    return made


class WithBatchNorm(TinyClassifier):
    """The tiny classifier with a BatchNorm1d layer (``net.1``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))


class Manual(TinyClassifier):
    """The tiny classifier with manual optimisation."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class BeforeTransfer(TinyClassifier):
    """The tiny classifier with an ``on_before_batch_transfer`` hook."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch


def fp16_mixed() -> MixedPrecision:
    """Lightning's fp16 mixed precision on the CPU, with its own GradScaler."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


__all__ = [
    "BeforeTransfer",
    "HetJobEnvironment",
    "HetSeqStrategy",
    "Manual",
    "SLURMEnvironment",
    "WithBatchNorm",
    "check_lightning_version",
    "fp16_mixed",
    "launched_for_us",
    "step_loss",
    "trainer",
]
