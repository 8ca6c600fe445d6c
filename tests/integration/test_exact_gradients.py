"""Exact global-batch gradients with uneven per-rank batches, on a real 2-process gloo group.

Rank 0 holds 24 samples (3 micro-batches, accumulated under ``no_sync``), rank 1 holds 8.
With hetseq_hpc's recipe (SUM losses, the sum-all-reduce hook, divide by the GLOBAL count)
the DDP gradient equals the single-process gradient of the mean loss over all 32 samples.
Plain DDP (mean loss per rank, DDP's averaging all-reduce) does not: it weights the 8-sample
rank like the 24-sample one. The second test proves the first can fail.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq_hpc.env.world import free_port
from hetseq_hpc.train.ddp_hooks import HookState, sum_allreduce_hook

SPLIT = {0: [0, 24], 1: [24, 32]}
MICRO = {0: [8, 8, 8], 1: [8]}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def _worker(rank: int, port: int, recipe: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x, y = _data()
        lo, hi = SPLIT[rank]
        model = _model()
        ddp = DDP(model)
        if recipe == "hetseq":
            ddp.register_comm_hook(HookState(), sum_allreduce_hook)
        start = lo
        sizes = MICRO[rank]
        for j, size in enumerate(sizes):
            xb, yb = x[start : start + size], y[start : start + size]
            start += size
            ctx = ddp.no_sync() if j < len(sizes) - 1 else torch.enable_grad()
            with ctx:
                err = (ddp(xb) - yb).pow(2).sum()
                if recipe == "hetseq":
                    loss = err  # SUM; divided by the global count after the all-reduce
                else:
                    loss = err / (hi - lo)  # per-rank mean; DDP then averages the ranks
                loss.backward()
        if recipe == "hetseq":
            count = torch.tensor([float(hi - lo)])
            dist.all_reduce(count)
            for p in model.parameters():
                p.grad.div_(count)
        if rank == 0:
            torch.save([p.grad.clone() for p in model.parameters()], out)
        dist.barrier()  # nobody tears gloo down while its peer still talks to it
    finally:
        dist.destroy_process_group()


def _ddp_grads(recipe: str):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads.pt")
        mp.spawn(_worker, args=(free_port(), recipe, out), nprocs=2, join=True)
        return torch.load(out)


def _reference_grads():
    x, y = _data()
    model = _model()
    ((model(x) - y).pow(2).mean()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_uneven_ranks_give_the_global_batch_gradient():
    for got, want in zip(_ddp_grads("hetseq"), _reference_grads()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_plain_ddp_mean_is_not_exact():
    diffs = [(g - w).abs().max().item() for g, w in zip(_ddp_grads("plain"), _reference_grads())]
    assert max(diffs) > 1e-3, "plain DDP should weight the uneven ranks wrongly"
