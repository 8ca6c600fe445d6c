#!/usr/bin/env python3
"""Baseline for scripts/bench_hetero.py: textbook DDP on the same model, data and equal split.

Mean loss per rank, DDP's own averaging all-reduce, gradient accumulation under ``no_sync``,
AdamW, gradient clipping: what a user writes without hetseq_hpc. Two unthrottled ranks x 1 thread, gloo. Writes rank 0's step times (s).

    python scripts/plain_ddp.py --steps 60 --global-batch 32 --out times.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq_hpc.config.schema import BertTaskConfig
from hetseq_hpc.env.world import free_port
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.sampler import GlobalBatchSampler


def worker(rank: int, port: int, steps: int, global_batch: int, micro: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    task = build_task(BertTaskConfig(), 0)
    task.prepare()
    task.load()
    torch.manual_seed(0)
    model = DDP(task.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = GlobalBatchSampler(task.num_train, global_batch, 0)
    half = global_batch // 2
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        sizes = [micro] * (half // micro) + ([half % micro] if half % micro else [])
        epoch, micro_positions = sampler.rank_micro_batches(step, rank * half, sizes)
        batches = [task.make_batch(p, epoch, "train") for p in micro_positions]
        total = sum(task.count(b) for b in batches)
        for j, batch in enumerate(batches):  # gradient accumulation, all-reduce on the last
            ctx = model.no_sync() if j < len(batches) - 1 else contextlib.nullcontext()
            with ctx:
                (model(**batch) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(times, fh)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=32, help="micro-batch (accumulate)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(
        worker,
        args=(free_port(), args.steps, args.global_batch, args.micro_batch, args.out),
        nprocs=2,
    )


if __name__ == "__main__":
    main()
