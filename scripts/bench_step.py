#!/usr/bin/env python3
"""What a steady-state training step costs the host, on this machine's CPU (in-process, one rank).

(a) ``syncs_per_step``: host synchronisations of a steady-state step (not a log, validation or
checkpoint step) of the real Trainer, counted with a ``TorchDispatchMode``
(:class:`hetseq_hpc.train.sync_count.SyncCounter`: ``aten._local_scalar_dense``, ``nonzero``,
boolean-mask ``index``/``index_put``, and ``torch.cuda.synchronize`` calls), with 1 and 4
micro-batches; (b) ``sleep_cost_ms``: how much a 20 ms sleep in the task's batch building
adds to the median step's critical path (the time the training thread waits for its batches,
``data_time_s``; the batches of step k+1 are built while step k runs), beside the same with the
batches built on the training thread, nothing ahead (``sleep_cost_ms_unprefetched``) and the difference of
the median step wall times (``sleep_cost_wall_ms``: the same, plus this machine's noise).
(c) ``compile_speedup``: samples/s of the steady-state steps of a ``trainer.compile=on``
Trainer over an eager one, steps interleaved, after the compiling first steps (``--no-compile``
skips it: null). (d) ``checkpoint_block_s``: with ``--checkpoint``, the training thread's
blocking time per checkpoint of a BERT-base-sized state (``scripts/bench_checkpoint.py``,
2-3 min, 1.3 GB of memory; else null). Last line: one JSON object.

    python scripts/bench_step.py [--steps 12] [--hidden 128] [--layers 2] [--batch 16]
        [--no-compile] [--checkpoint]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.train.sync_count import SyncCounter
from hetseq_hpc.train.trainer import Trainer

SLEEP_S = 0.020


def make_trainer(rdv, args, cap: int, run_dir: Path, cache: Path, *extra: str) -> Trainer:
    run = compose_run_config(
        [
            f"task.model.hidden_size={args.hidden}",
            f"task.model.num_layers={args.layers}",
            "task.model.num_heads=2",
            f"task.model.intermediate_size={4 * args.hidden}",
            "task.model.max_seq_len=64",
            "task.model.dropout=0.0",
            "cluster.ranks=1",
            f"trainer.global_batch_size={args.batch}",
            f"trainer.max_steps={10 * args.steps}",
            "optim.warmup_steps=0",
            f"task.data.cache_dir={cache}",
            *extra,
        ]
    )
    task = build_task(run.task, run.trainer.seed)
    task.prepare()
    task.load()
    torch.manual_seed(run.trainer.seed)
    return Trainer(
        run,
        RunDir(run_dir),
        rdv,
        task,
        task.build_model(),
        torch.device("cpu"),
        allocate([1.0], args.batch, [cap]),
        [RankMeta(rank=0, device="cpu", node=platform.node())],
    )


def syncs_per_step(rdv, args, micro: int, run_dir: Path, cache: Path) -> int:
    """The most synchronisations counted in one of 3 steady-state steps after 2 warm-up ones."""
    trainer = make_trainer(rdv, args, args.batch // micro, run_dir, cache)
    assert len(trainer.allocation.shares[0].micro_sizes) == micro
    for step in (1, 2):
        trainer.train_step(step, settle=False)
    counts = []
    for step in (3, 4, 5):
        with SyncCounter() as counter:
            trainer.train_step(step, settle=False)
        counts.append(counter.total)
    trainer.settle_pending()
    trainer.batches.close()
    return max(counts)


def sleep_cost_ms(rdv, args, run_dir: Path, cache: Path, prefetch: bool) -> Dict[str, float]:
    """Median step time (ms) of two trainers, steps interleaved, one of whose ``make_batch``
    sleeps 20 ms per step; ``prefetch=False``: nothing is built ahead."""
    plain = make_trainer(rdv, args, args.batch, run_dir / "plain", cache)
    slow = make_trainer(rdv, args, args.batch, run_dir / "slow", cache)
    inner = slow.task.make_batch

    def sleepy(positions, epoch, split):
        time.sleep(SLEEP_S)
        return inner(positions, epoch, split)

    slow.task.make_batch = sleepy
    if not prefetch:  # every step builds its own batches on the training thread
        for trainer in (plain, slow):
            trainer.batches.prefetch = lambda key: None
    times: Dict[str, list] = {"plain": [], "slow": []}
    waits: Dict[str, list] = {"plain": [], "slow": []}
    for step in range(1, args.steps + 3):
        for name, trainer in (("plain", plain), ("slow", slow)):
            t0 = time.perf_counter()
            rec = trainer.train_step(step, settle=False)
            if step > 2:
                times[name].append(time.perf_counter() - t0)
                waits[name].append(rec.per_rank[0].data_time_s)  # the step waited for batches
    for trainer in (plain, slow):
        trainer.settle_pending()
        trainer.batches.close()
    step = {k: 1000 * statistics.median(v) for k, v in times.items()}
    wait = {k: 1000 * statistics.median(v) for k, v in waits.items()}
    return {
        "step_ms": round(step["plain"], 2),
        "cost_ms": wait["slow"] - wait["plain"],  # what the sleep added to the step's path
        "wall_cost_ms": step["slow"] - step["plain"],  # the same from wall times (noisier)
    }


def compile_speedup(rdv, args, run_dir: Path, cache: Path) -> Dict[str, float]:
    """Median step time (ms) of an eager and a ``trainer.compile=on`` Trainer, steps
    interleaved, after 3 steps each (the compiled one's first step compiles)."""
    eager = make_trainer(rdv, args, args.batch, run_dir / "eager", cache)
    compiled = make_trainer(
        rdv, args, args.batch, run_dir / "compiled", cache, "trainer.compile=on"
    )
    times: Dict[str, list] = {"eager": [], "compiled": []}
    for step in range(1, args.steps + 4):
        for name, trainer in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            trainer.train_step(step, settle=False)
            if step > 3:
                times[name].append(time.perf_counter() - t0)
    for trainer in (eager, compiled):
        trainer.settle_pending()
        trainer.batches.close()
    step = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"eager_ms": round(step["eager"], 2), "compiled_ms": round(step["compiled"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-compile", action="store_true", help="skip compile_speedup")
    parser.add_argument("--checkpoint", action="store_true", help="measure checkpoint_block_s")
    args = parser.parse_args()
    out: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, single_process_rendezvous() as rdv:
        root, cache = Path(tmp), Path(tmp) / "cache"
        by_k = {f"k={k}": syncs_per_step(rdv, args, k, root / f"k{k}", cache) for k in (1, 4)}
        out["syncs_per_step"] = max(by_k.values())
        out["syncs_per_step_by_micro_batches"] = by_k
        print(f"syncs per steady-state step: {by_k}", flush=True)
        overlapped = sleep_cost_ms(rdv, args, root / "on", cache, prefetch=True)
        unprefetched = sleep_cost_ms(rdv, args, root / "off", cache, prefetch=False)
        compiled = None if args.no_compile else compile_speedup(rdv, args, root / "c", cache)
    out["step_ms"] = overlapped["step_ms"]
    out["sleep_cost_ms"] = round(overlapped["cost_ms"], 2)
    out["sleep_cost_ms_unprefetched"] = round(unprefetched["cost_ms"], 2)
    out["sleep_cost_wall_ms"] = round(overlapped["wall_cost_ms"], 2)
    print(
        f"a 20 ms sleep in make_batch costs {out['sleep_cost_ms']} ms per step "
        f"({out['sleep_cost_ms_unprefetched']} ms built on the training thread); "
        f"step {out['step_ms']} ms",
        flush=True,
    )
    out["compile_speedup"] = None
    if compiled is not None:  # samples/s compiled over eager = eager time over compiled time
        out["compile_speedup"] = round(compiled["eager_ms"] / compiled["compiled_ms"], 3)
        out["compile_step_ms"] = compiled
        print(f"trainer.compile=on: {compiled} per step", flush=True)
    out["checkpoint_block_s"] = None
    if args.checkpoint:
        from bench_checkpoint import measure_checkpoint_block_s

        out["checkpoint_block_s"] = round(measure_checkpoint_block_s(), 3)
    out["machine"] = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    out["model"] = {"hidden": args.hidden, "layers": args.layers, "batch": args.batch}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
