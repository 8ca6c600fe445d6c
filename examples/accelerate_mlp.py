"""An accelerate loop with uneven exact batches: the few changed lines (marked ``hetseq``).

Run it with one process per rank (torchrun on one node; srun or ``hetseq-hpc run`` with
``cluster.command`` on a mixed cluster; not ``accelerate launch``, which starts the same
number of processes on every node)::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_mlp.py --allocation 24,8 --max-micro-batch 8

``--out FILE`` writes rank 0's exact global loss of every step as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ (every rank)

from examples.lightning_mlp import make_dataset
from hetseq_hpc.integrations.accelerate import HetSeqAccelerate


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """The MEAN cross-entropy of a batch (what the loop always computed)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train a LayerNorm MLP with AdamW on the CPUs; rank 0 prints (and writes) the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--allocation", default=None, help="e.g. 24,8 (default: measured)")
    parser.add_argument("--max-micro-batch", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)  # hetseq: not the train loader
    loader = DataLoader(make_dataset(), batch_size=8, shuffle=True)
    split = [int(b) for b in args.allocation.split(",")] if args.allocation else None
    hetseq = HetSeqAccelerate(  # hetseq
        accelerator,
        model,
        global_batch_size=args.global_batch_size,
        allocation=split,
        max_micro_batch=args.max_micro_batch,
    )
    loader = hetseq.setup_dataloader(loader, accelerator.unwrap_model(model), loss_fn)  # hetseq
    losses = {}
    while hetseq.global_step < args.max_steps:
        for batch in loader:
            loss = hetseq.backward(model, batch, loss_fn)  # hetseq (was accelerator.backward)
            optimizer.step()
            optimizer.zero_grad()
            losses[hetseq.global_step] = loss
            accelerator.print(f"step {hetseq.global_step}: loss {loss:.6f}")
            if hetseq.global_step >= args.max_steps:
                break
    if args.out and accelerator.is_main_process:
        Path(args.out).write_text(
            json.dumps({"world": accelerator.num_processes, "losses": losses})
        )


if __name__ == "__main__":
    main()
