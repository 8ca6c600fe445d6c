"""One Lightning training run of ``examples/lightning_mlp.py``'s module, as a script (used by
tests/integration/test_lightning.py, tests/slurm/test_lightning_slurm.py and
scripts/bench_lightning.py).

Run as ``python scripts/lightning_run.py --devices N ...``: Lightning's own launcher starts the
other ranks, exactly as a user's ``python train.py`` does. Rank 0 writes ``--out`` (JSON): the exact global loss of every step
(``strategy.last_global_loss``, full precision), the logged ``train_loss``, the split moves and
the final allocation. ``--mode ddp`` trains the same per-rank split with plain Lightning DDP
(each rank its slice of the same global batches, DDP's mean): the naive result. ``--slow-rank``
throttles one rank from a step on (``--slow-at -1``: from before calibration) with the
benchmarks' emulation (a cgroup CPU quota); ``times`` / ``cpu_times`` are rank 0's step-end
wall-clock and training-thread CPU-time readings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import ClassVar, Dict, List, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Sampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ (every rank)

from examples.lightning_mlp import TinyClassifier, make_dataset
from hetseq_hpc.integrations.engine import GlobalOrder


class Record(L.Callback):
    """Every step's losses on rank 0, written to ``out`` at the end of training."""

    def __init__(self, out: Path):
        self.out = out
        self.losses: Dict[int, float] = {}
        self.logged: Dict[int, float] = {}
        self.grad_norms: Dict[int, float] = {}
        self.stats: Dict[int, list] = {}
        self.times: List[float] = []
        self.cpu_times: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.thread_time())  # the training thread's own CPU time
        step = int(trainer.global_step)
        self.logged[step] = float(trainer.callback_metrics["train_loss"])
        exact = getattr(trainer.strategy, "last_global_loss", None)
        if exact is not None:
            self.losses[step] = float(exact)
            self.stats[step] = [
                [s.samples, round(s.compute_time_s, 4), round(s.tail_time_s, 4)]
                for s in trainer.strategy.last_stats
            ]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # the gradient clipping sees: after the strategy's division, before clipping
        norms = [p.grad.detach().norm() for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms[int(trainer.global_step) + 1] = float(torch.stack(norms).norm())

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        strategy = trainer.strategy
        balancer = getattr(strategy, "balancer", None)
        env = strategy.cluster_environment
        world = getattr(env, "world", None)  # HetJobEnvironment's WorldInfo
        data = {
            "world": trainer.world_size,
            "environment": type(env).__name__,
            "het_size": world.het_size if world is not None else None,
            "losses": self.losses or self.logged,
            "logged": self.logged,
            "grad_norms": self.grad_norms,
            "moves": balancer.moves if balancer is not None else [],
            "allocations": (
                [[first, a.samples] for first, a in balancer.schedule.entries]
                if balancer is not None
                else []
            ),
            "epochs": int(trainer.current_epoch),
            "stats": self.stats,
            "times": self.times,
            "cpu_times": self.cpu_times,
            "decisions": (
                balancer.rebalancer.decisions
                if balancer is not None and balancer.rebalancer is not None
                else []
            ),
        }
        self.out.write_text(json.dumps(data, indent=1))


class SlowDown(L.Callback):
    """Throttle rank ``rank`` to ``speed`` from step ``at`` on (hetseq_hpc.env.emulation);
    ``at < 0``: from set-up, after the rendezvous and before calibration."""

    def __init__(self, rank: int, at: int, speed: float):
        self.rank, self.at, self.speed = rank, at, speed
        self.done = False

    def _throttle(self, trainer) -> None:
        if self.done or trainer.global_rank != self.rank:
            return
        from hetseq_hpc.env.emulation import emulate_speed, exempt_communication_threads

        exempt_communication_threads(emulate_speed(self.speed, torch.get_num_threads()))
        self.done = True

    def setup(self, trainer, pl_module, stage):
        if self.at < 0:
            self._throttle(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if 0 <= self.at <= trainer.global_step:
            self._throttle(trainer)


class SliceSampler(Sampler):
    """Plain DDP's uneven split: rank ``rank`` takes ``[offset, offset + count)`` of every
    global batch of the same order hetseq_hpc uses."""

    def __init__(self, order: GlobalOrder, offset: int, count: int, trainer_ref: List):
        self.order, self.offset, self.count, self.trainer_ref = order, offset, count, trainer_ref

    def __len__(self) -> int:
        return self.order.steps_per_epoch

    def __iter__(self):
        index = int(self.trainer_ref[0].global_step)
        while True:
            yield [
                int(p) for p in self.order.positions(index)[self.offset : self.offset + self.count]
            ]
            index += 1


class PlainSplitClassifier(TinyClassifier):
    """The same module with a per-rank loader of its slice (for ``--mode ddp``)."""

    split: ClassVar[List[int]] = []

    def train_dataloader(self):
        data = make_dataset(self.hparams.samples, self.hparams.features, self.hparams.classes)
        rank = self.trainer.global_rank
        order = GlobalOrder(len(data), sum(self.split), 0, True)
        offset = sum(self.split[:rank])
        return DataLoader(
            data, batch_sampler=SliceSampler(order, offset, self.split[rank], [self.trainer])
        )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--mode", choices=("hetseq", "ddp"), default="hetseq")
    parser.add_argument("--allocation", type=json.loads, default=None)
    parser.add_argument("--max-micro-batch", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rebalance-every", type=int, default=None)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--slow-at", type=int, default=0)
    parser.add_argument("--slow-speed", type=float, default=0.25)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    L.seed_everything(0)
    callbacks: List[L.Callback] = [Record(Path(args.out))]
    if args.slow_rank is not None:
        callbacks.append(SlowDown(args.slow_rank, args.slow_at, args.slow_speed))
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="{step}",
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
            )
        )
    if args.mode == "hetseq":
        from hetseq_hpc.integrations.lightning import HetSeqStrategy

        strategy = HetSeqStrategy(
            global_batch_size=args.global_batch_size,
            allocation=args.allocation,
            max_micro_batch=args.max_micro_batch,
            rebalance_every=args.rebalance_every,
        )
        module = TinyClassifier(features=args.features, hidden=args.hidden, samples=args.samples)
        extra = {}
    else:
        strategy = "ddp"
        PlainSplitClassifier.split = list(args.allocation)
        module = PlainSplitClassifier(
            features=args.features, hidden=args.hidden, samples=args.samples
        )
        extra = {"use_distributed_sampler": False}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        gradient_clip_val=args.clip,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(args.ckpt_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **extra,
    )
    trainer.fit(module, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
