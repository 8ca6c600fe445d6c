"""The DDP training loop with exact gradients for uneven per-rank batches.

One optimizer step on rank ``i`` (``b_i`` samples in ``accum_i`` micro-batches):

1. take its slice of global batch ``k`` (:mod:`hetseq_hpc.train.sampler`);
2. forward+backward every micro-batch on the SUM of its unit losses (masked tokens for BERT);
   all but the last micro-batch run under ``no_sync``, so each rank all-reduces once per step
   whatever its accumulation count;
3. DDP sums the gradients across ranks (:mod:`hetseq_hpc.train.ddp_hooks`);
4. ranks exchange loss sums, unit counts and timings (one small all-gather);
5. gradients are divided by the GLOBAL unit count ``sum_i n_i``: the result is exactly the
   gradient of the mean loss over the whole global batch (see
   ../shared/heterogeneous-training-notes.md in the project history; HetSeq's
   ``world_size / sum(sample_size)`` scaling is the same idea for sum-reduced losses);
6. the global gradient is clipped, then AdamW steps.

Dropout's RNG is re-seeded from ``(seed, step, rank)`` every step, and masking is a function of
``(seed, epoch, sample)``, so a run resumed from a checkpoint repeats an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq_hpc.allocation import Allocation
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed import Rendezvous
from hetseq_hpc.errors import AllocationError, CheckpointError, Preempted
from hetseq_hpc.preemption import REASONS
from hetseq_hpc.train.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from hetseq_hpc.train.ddp_hooks import HookState, sum_allreduce_hook
from hetseq_hpc.train.metrics import MetricsWriter, Progress
from hetseq_hpc.train.sampler import GlobalBatchSampler

log = logging.getLogger(__name__)

# Fields of the per-step all-gather, one float64 vector per rank.
_STAT_FIELDS = ("loss_sum", "count", "samples", "compute_time_s", "step_time_s", "data_time_s",
                "stop")


@dataclass
class RankMeta:
    """Static facts about a rank, reported in metrics.jsonl and allocation.json."""

    rank: int
    device: str
    node: str
    het_group: Optional[int] = None
    partition: Optional[str] = None
    gres: Optional[str] = None


@dataclass
class StepRecord:
    """What one optimizer step produced, as all ranks agree on it."""

    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    per_rank: List[Dict[str, float]]
    wall_s: float
    extra: Dict[str, Any] = field(default_factory=dict)


def _no_forward_buffer_sync() -> Dict[str, bool]:
    """DDP arguments that stop buffer broadcasts in forward: ranks run different numbers of
    forward passes per step, so a collective there would pair up wrongly and hang.
    (``forward_sync_buffers`` replaced ``broadcast_buffers`` in recent torch releases.)"""
    import inspect

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the dropout RNG for ``(seed, step, rank)``."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def build_optimizer(model: nn.Module, run: RunConfig):
    """AdamW without weight decay on biases and LayerNorm weights, plus transformers'
    warm-up/decay scheduler."""
    from transformers import get_scheduler

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "LayerNorm" in name else decay).append(param)
    optim = run.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
    )
    kind = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}[optim.schedule]
    scheduler = get_scheduler(
        kind, optimizer, num_warmup_steps=optim.warmup_steps,
        num_training_steps=optim.schedule_steps or run.trainer.max_steps,
    )
    return optimizer, scheduler


class Trainer:
    """Runs optimizer steps ``start+1 .. trainer.max_steps`` on one rank.

    Args:
        run: the validated run configuration.
        run_dir: the run directory (checkpoints, metrics.jsonl).
        rdv: the joined rendezvous.
        task: the task (data, batches, unit counts).
        model: the bare model, already on ``device`` and identically initialised on all ranks.
        device: this rank's device.
        allocation: the agreed allocation.
        metas: :class:`RankMeta` of every rank, in rank order.
        autocast: factory of the mixed-precision context.
        rebalancer: optional online re-balancer (``observe(step, allocation, per_rank) ->
            Optional[Allocation]``), consulted every ``trainer.rebalance_every`` steps.
    """

    def __init__(
        self,
        run: RunConfig,
        run_dir: Path,
        rdv: Rendezvous,
        task: Any,
        model: nn.Module,
        device: torch.device,
        allocation: Allocation,
        metas: List[RankMeta],
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        rebalancer: Any = None,
        on_allocation: Optional[Callable[[Allocation], None]] = None,
        stop_request: Any = None,
    ):
        self.run = run
        self.cfg = run.trainer
        self.run_dir = Path(run_dir)
        self.rdv = rdv
        self.world = rdv.world
        self.rank = rdv.world.rank
        self.task = task
        self.model = model
        self.device = device
        self.allocation = allocation
        self.metas = metas
        self.autocast = autocast
        self.rebalancer = rebalancer
        self.on_allocation = on_allocation
        self.stop_request = stop_request
        self.sampler = GlobalBatchSampler(task.num_train, self.cfg.global_batch_size, self.cfg.seed)
        self.optimizer, self.scheduler = build_optimizer(model, run)
        self.start_step = 0
        self.history: List[StepRecord] = []
        self.last_val: Optional[Dict[str, float]] = None
        self._resume()
        self.hook_state = HookState()
        self.ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **_no_forward_buffer_sync(),
        )
        self.ddp.register_comm_hook(self.hook_state, sum_allreduce_hook)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        path = resolve_resume(self.cfg.resume, self.run_dir)
        if path is None:
            return
        state = load_checkpoint(path)
        if int(state.get("global_batch_size", -1)) != self.cfg.global_batch_size:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was trained with global batch "
                f"{state.get('global_batch_size')}, but trainer.global_batch_size="
                f"{self.cfg.global_batch_size}: use the same global batch, or a new run directory"
            )
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds a different model ({str(exc).splitlines()[0]}): "
                "use the task.model settings it was trained with, or a new run directory"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.start_step = int(state["step"])
        if self.rank == 0 and "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
        old = state.get("allocation")
        log.info(
            "resumed from %s at step %d (was %s ranks, allocation %s; now %d ranks, %s)",
            path, self.start_step, state.get("world_size"),
            old and [s["samples"] for s in old["shares"]], self.world.world_size,
            self.allocation.samples,
        )

    def _checkpoint(self, step: int) -> None:
        if self.rank == 0:
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "epoch": self.sampler.epoch_of(step - 1),
                "samples_seen": step * self.cfg.global_batch_size,
                "global_batch_size": self.cfg.global_batch_size,
                "seed": self.cfg.seed,
                "world_size": self.world.world_size,
                "allocation": self.allocation.to_dict(),
                "ranks": [m.__dict__ for m in self.metas],
                # dropout is re-seeded from (seed, step, rank) each step; these are kept for
                # anything else that draws random numbers
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()},
            }
            save_checkpoint(state, self.run_dir, step, self.cfg.keep_checkpoints)
        self.rdv.barrier()

    # ------------------------------------------------------------------ one step
    def _compute_seconds(self, t0: float, start_event) -> float:
        if self.device.type == "cuda" and self.hook_state.events and start_event is not None:
            torch.cuda.synchronize(self.device)
            return start_event.elapsed_time(self.hook_state.events[-1]) / 1000.0
        return (self.hook_state.last_ready_s or time.perf_counter()) - t0

    def train_step(self, step: int) -> StepRecord:
        """Run optimizer step ``step`` (1-based) and return what all ranks agree on."""
        share = self.allocation.shares[self.rank]
        offset = self.allocation.offsets()[self.rank]
        t0 = time.perf_counter()
        epoch, micro = self.sampler.rank_micro_batches(step - 1, offset, share.micro_sizes)
        batches = [self.task.make_batch(p, epoch, "train") for p in micro]
        data_s = time.perf_counter() - t0
        torch.manual_seed(step_seed(self.cfg.seed, step, self.rank))
        self.hook_state.reset()
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        self.ddp.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for j, batch in enumerate(batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            count += self.task.count(batch)
            sync = j == len(batches) - 1
            with (contextlib.nullcontext() if sync else self.ddp.no_sync()), self.autocast():
                loss = self.ddp(**batch)
            loss.backward()
            loss_sum += loss.detach().double()
        compute_s = self._compute_seconds(t0, start_event)
        step_s = time.perf_counter() - t0
        stats = torch.tensor(
            [loss_sum.item(), count, share.samples, compute_s, step_s, data_s,
             self.stop_request.code if self.stop_request is not None else 0],
            dtype=torch.float64,
        )
        gathered = [torch.zeros_like(stats) for _ in range(self.world.world_size)]
        dist.all_gather(gathered, stats, group=self.rdv.cpu_group)
        table = torch.stack(gathered)  # (world, fields)
        global_count = float(table[:, 1].sum())
        inv = 1.0 / global_count
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(inv)
        if self.cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None])))
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        per_rank = [dict(zip(_STAT_FIELDS, row.tolist())) for row in table]
        return StepRecord(
            step=step, epoch=epoch, loss=float(table[:, 0].sum()) / global_count, lr=lr,
            grad_norm=grad_norm, per_rank=per_rank, wall_s=wall,
            extra={"stop": int(table[:, 6].max())} if float(table[:, 6].max()) > 0 else {},
        )

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Mean masked-token loss and perplexity on the whole validation split (sharded)."""
        self.model.eval()
        positions = np.arange(self.rank, self.task.num_val, self.world.world_size)
        size = max(1, self.allocation.shares[self.rank].micro_batch)
        sums = torch.zeros(2, dtype=torch.float64)
        for start in range(0, positions.size, size):
            batch = self.task.make_batch(positions[start : start + size], 0, "val")
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.autocast():
                sums[0] += float(self.model(**batch))
            sums[1] += self.task.count(batch)
        self.rdv.all_reduce_sum_cpu(sums)
        self.model.train()
        loss = float(sums[0] / max(sums[1], 1.0))
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    # ------------------------------------------------------------------ the loop
    def _row(self, rec: StepRecord) -> Dict[str, Any]:
        samples_per_s = self.cfg.global_batch_size / max(rec.wall_s, 1e-9)
        ranks = []
        for meta, stats, share in zip(self.metas, rec.per_rank, self.allocation.shares):
            ranks.append({
                "rank": meta.rank, "device": meta.device, "node": meta.node,
                "het_group": meta.het_group, "partition": meta.partition, "gres": meta.gres,
                "micro_batch": share.micro_batch, "accum_steps": share.accum_steps,
                "samples": int(stats["samples"]),
                "step_time_s": round(stats["step_time_s"], 6),
                "compute_time_s": round(stats["compute_time_s"], 6),
                "data_time_s": round(stats["data_time_s"], 6),
            })
        compute = [r["compute_time_s"] for r in ranks]
        mean = sum(compute) / len(compute)
        row = {
            "step": rec.step, "time": time.time(), "epoch": rec.epoch, "loss": rec.loss, "lr": rec.lr,
            "grad_norm": rec.grad_norm, "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * self.task.tokens_per_sample,
            "step_time_s": rec.wall_s,
            "straggle": (max(compute) - min(compute)) / mean if mean > 0 else 0.0,
            "allocation": self.allocation.samples,
            "ranks": ranks,
        }
        return row

    def fit(self) -> Dict[str, Any]:
        """Train to ``trainer.max_steps``; returns a summary (final loss, validation, throughput)."""
        cfg = self.cfg
        writer = MetricsWriter(self.run_dir / "metrics.jsonl", self.start_step) if self.rank == 0 else None
        progress = Progress(cfg.max_steps, self.start_step, enabled=self.rank == 0)
        if self.start_step >= cfg.max_steps:
            log.info("checkpoint is at step %d >= trainer.max_steps=%d: nothing to train",
                     self.start_step, cfg.max_steps)
        last: Optional[StepRecord] = None
        try:
            for step in range(self.start_step + 1, cfg.max_steps + 1):
                rec = self.train_step(step)
                last = rec
                if not math.isfinite(rec.loss):
                    raise FloatingPointError(
                        f"loss is {rec.loss} at step {step}: lower optim.lr or raise "
                        "optim.warmup_steps"
                    )
                self.history.append(rec)
                stop = int(rec.extra.pop("stop", 0))
                row = self._row(rec) if self.rank == 0 else {}
                if self.rebalancer is not None:
                    self.rebalancer.record(rec.per_rank)
                if self.rebalancer is not None and cfg.rebalance_every and step % cfg.rebalance_every == 0:
                    new = self.rebalancer.observe(step, self.allocation)
                    if new is not None:
                        digests = self.rdv.all_gather_objects(new.digest())
                        if len(set(digests)) != 1:
                            raise AllocationError(
                                f"ranks re-balanced differently at step {step} (digests "
                                f"{sorted(set(digests))}): install the same hetseq_hpc everywhere"
                            )
                        log.info("step %d: straggle %.2f -> re-balancing %s -> %s from step %d",
                                 step, self.rebalancer.decisions[-1]["straggle"],
                                 self.allocation.samples, new.samples, step + 1)
                        rec.extra["reallocation"] = {"from": self.allocation.samples,
                                                     "to": new.samples, "at_step": step + 1}
                        self.allocation = new
                        if self.on_allocation is not None:
                            self.on_allocation(new)
                is_last = step == cfg.max_steps
                if (cfg.val_every and step % cfg.val_every == 0) or is_last:
                    self.last_val = self.evaluate()
                    rec.extra.update(self.last_val)
                if writer is not None and (step % cfg.log_every == 0 or is_last or rec.extra):
                    row.update(rec.extra)
                    writer.write(row)
                progress.update(step, rec.loss, cfg.global_batch_size / max(rec.wall_s, 1e-9),
                                extra=(f"val_loss {self.last_val['val_loss']:.4f}"
                                       if "val_loss" in rec.extra else None))
                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or is_last or stop:
                    self._checkpoint(step)
                if stop and not is_last:
                    # every rank saw the same request in the step's all-gather: all stop here
                    raise Preempted(step, stop, REASONS.get(stop, "a stop request"))
        finally:
            progress.close()
            if writer is not None:
                writer.close()
        return self.summary(last)

    def summary(self, last: Optional[StepRecord]) -> Dict[str, Any]:
        """Final figures, including each rank's measured throughput (samples per compute second)."""
        per_rank = []
        for r in range(self.world.world_size):
            samples = sum(rec.per_rank[r]["samples"] for rec in self.history)
            compute = sum(rec.per_rank[r]["compute_time_s"] for rec in self.history)
            per_rank.append({
                "rank": r, "device": self.metas[r].device, "partition": self.metas[r].partition,
                "samples": int(samples),
                "samples_per_compute_s": samples / compute if compute > 0 else None,
            })
        wall = sum(rec.wall_s for rec in self.history)
        steps = len(self.history)
        return {
            "steps_run": steps,
            "final_step": last.step if last else self.start_step,
            "final_loss": last.loss if last else None,
            "first_loss": self.history[0].loss if self.history else None,
            "validation": self.last_val,
            "samples_per_s": steps * self.cfg.global_batch_size / wall if wall > 0 else None,
            "allocation": self.allocation.samples,
            "ranks": per_rank,
        }
