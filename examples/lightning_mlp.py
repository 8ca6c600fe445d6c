"""An ordinary LightningModule trained with uneven exact batches: the one-line change.

Run it (Lightning's own launcher starts the ranks, as with ``strategy="ddp"``)::

    python examples/lightning_mlp.py --devices 2 --global-batch-size 32

or as the per-rank command of a Slurm het job (docs/integrations.md)::

    hetseq-hpc run cluster=mixed 'cluster.command=[python,examples/lightning_mlp.py]'

The module is plain Lightning: a mean cross-entropy loss, LayerNorm, ``self.log(...,
sync_dist=True)``, AdamW and its own DataLoader. The only hetseq_hpc line is the strategy.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hetseq_hpc.integrations.lightning import HetSeqStrategy


def make_dataset(samples: int = 160, features: int = 16, classes: int = 4) -> TensorDataset:
    """A fixed synthetic classification set: ``(x, y)``, ``x`` ``(samples, features)`` float32,
    ``y`` ``(samples,)`` int64 labels of a noisy random linear map."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, classes, generator=gen)
    y = (x @ w + 0.5 * torch.randn(samples, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


class TinyClassifier(L.LightningModule):
    """Linear -> LayerNorm -> tanh -> linear; the loss is the MEAN cross-entropy of a batch."""

    def __init__(
        self,
        features: int = 16,
        hidden: int = 64,
        classes: int = 4,
        samples: int = 160,
        lr: float = 1e-2,
        batch_size: int = 8,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.Tanh(), nn.Linear(hidden, classes)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        data = make_dataset(self.hparams.samples, self.hparams.features, self.hparams.classes)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train :class:`TinyClassifier` on this machine's CPUs (or under srun / hetseq-hpc run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu (CUDA)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args(argv)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=HetSeqStrategy(global_batch_size=args.global_batch_size),  # the one line
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyClassifier())


if __name__ == "__main__":
    main()
