"""A Lightning Fabric loop with uneven exact batches: the few changed lines (marked ``hetseq``).

Run it (Fabric's launcher starts the ranks)::

    python examples/fabric_mlp.py --devices 2 --allocation 24,8 --max-micro-batch 8

``--out FILE`` writes rank 0's exact global loss of every step as JSON (the tests compare runs
on different splits with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ (every rank)

from examples.lightning_mlp import make_dataset
from hetseq_hpc.integrations.fabric import HetSeqFabric, HetSeqFabricStrategy


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """The MEAN cross-entropy of a batch (what the loop always computed)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train a LayerNorm MLP with AdamW on the CPUs; rank 0 prints (and writes) the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--allocation", default=None, help="e.g. 24,8 (default: measured)")
    parser.add_argument("--max-micro-batch", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=HetSeqFabricStrategy())
    fabric.launch()
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(make_dataset(), batch_size=8, shuffle=True)
    split = [int(b) for b in args.allocation.split(",")] if args.allocation else None
    hetseq = HetSeqFabric(  # hetseq
        fabric,
        global_batch_size=args.global_batch_size,
        allocation=split,
        max_micro_batch=args.max_micro_batch,
    )
    loader = hetseq.setup_dataloader(loader, model.module, loss_fn)  # hetseq
    losses = {}
    while hetseq.global_step < args.max_steps:
        for batch in loader:
            loss = hetseq.backward(model, batch, loss_fn)  # hetseq (was fabric.backward)
            optimizer.step()
            optimizer.zero_grad()
            losses[hetseq.global_step] = loss
            fabric.print(f"step {hetseq.global_step}: loss {loss:.6f}")
            if hetseq.global_step >= args.max_steps:
                break
    if args.out and fabric.global_rank == 0:
        Path(args.out).write_text(json.dumps({"world": fabric.world_size, "losses": losses}))


if __name__ == "__main__":
    main()
