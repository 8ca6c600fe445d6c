#!/usr/bin/env python3
"""Side-by-side benchmark: do a fast and a slow device train at (nearly) the SUM of their speeds?

On this machine (2 CPU cores) two ranks, one at full speed and one throttled to ~0.35 by a cgroup
CPU quota (hetseq_hpc.env.emulation), train the BERT task's default model with the same global
batch. In ONE run it measures:

  (a) each rank's standalone throughput at its speed (1 process, 1 thread);
  (b) equal-split DDP -- how every other launcher runs: the same share for every rank;
  (c) hetseq_hpc's automatic allocation (calibrated, with online re-balancing);
  (d) plain torch DDP against hetseq_hpc on two unthrottled ranks, the same equal split
      (the price of hetseq_hpc's machinery: summing hook, per-step exchange, exact weighting).

A second scenario changes the slow rank's quota mid-run (0.35 -> 0.7 by writing its cgroup's
cpu.cfs_quota_us) and counts the steps re-balancing needs to get back above 0.9 efficiency.

It prints a table and, last, one JSON line with efficiency_equal = thr(b)/sum thr(a),
efficiency_balanced = thr(c)/sum thr(a), speedup = thr(c)/thr(b) and overhead_vs_ddp =
step time of hetseq_hpc / step time of plain DDP - 1. Throughput = global batch / median step
time over the steps after warm-up. Targets: efficiency_balanced >= 0.95, overhead_vs_ddp <= 0.02.

    python scripts/bench_hetero.py [--steps 60] [--slow 0.35] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 32
COMMON = ["trainer.val_every=0", "trainer.checkpoint_every=0", "trainer.keep_checkpoints=1",
          "cluster.threads_per_rank=1", f"trainer.global_batch_size={GLOBAL_BATCH}"]


def run_cli(run_dir: Path, *overrides: str, on_row=None) -> list:
    """Run ``python -m hetseq_hpc`` to the end; ``on_row(rows)`` is called as metrics arrive."""
    cmd = [sys.executable, "-m", "hetseq_hpc", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = run_dir / "metrics.jsonl"
    seen = 0
    while proc.poll() is None:
        if on_row is not None and metrics.exists():
            rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
            if len(rows) > seen:
                seen = len(rows)
                on_row(rows)
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(overrides)}):\n{out[-3000:]}")
    return [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]


def throughput(rows: list, warmup: int) -> float:
    """Global batch / median step time (s) over steps after ``warmup``."""
    times = [r["step_time_s"] for r in rows if r["step"] > warmup]
    return GLOBAL_BATCH / statistics.median(times)


def plain_ddp_step_time(steps: int, warmup: int, cache: str) -> float:
    """Median step time of textbook DDP (mean loss, DDP's averaging all-reduce, AdamW, clipping)
    on the same model, data and equal split, 2 unthrottled ranks x 1 thread."""
    out = Path(tempfile.mkdtemp()) / "plain.json"
    code = f"""
import json, os, statistics, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from hetseq_hpc.config.schema import BertTaskConfig
from hetseq_hpc.tasks import build_task
from hetseq_hpc.env.world import free_port
from hetseq_hpc.train.sampler import GlobalBatchSampler

def worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    cfg = BertTaskConfig(); cfg.data.cache_dir = {cache!r}
    task = build_task(cfg, 0); task.load()
    torch.manual_seed(0)
    model = DDP(task.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = GlobalBatchSampler(task.num_train, {GLOBAL_BATCH}, 0)
    times = []
    for step in range({steps}):
        t0 = time.perf_counter()
        epoch, (pos,) = sampler.rank_micro_batches(step, rank * {GLOBAL_BATCH // 2}, [{GLOBAL_BATCH // 2}])
        batch = task.make_batch(pos, epoch, "train")
        loss = model(**batch) / task.count(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        json.dump(times, open({str(out)!r}, "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(),), nprocs=2)
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    times = json.loads(out.read_text())
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per measured run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--slow", type=float, default=0.35, help="speed of the slow rank")
    parser.add_argument("--changed", type=float, default=0.7, help="slow rank's speed after the change")
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    steps = [f"trainer.max_steps={args.steps}"]
    started = time.time()

    # (a) standalone throughput at each speed
    alone = {}
    for speed in (1.0, args.slow, args.changed):
        rows = run_cli(root / f"alone-{speed}", "cluster.ranks=1", f"cluster.speeds=[{speed}]",
                       *steps)
        alone[speed] = throughput(rows, args.warmup)
    ideal = alone[1.0] + alone[args.slow]
    speeds = f"cluster.speeds=[1.0,{args.slow}]"
    half = GLOBAL_BATCH // 2
    # (b) equal split, (c) hetseq_hpc automatic allocation with online re-balancing
    equal_rows = run_cli(root / "equal", "cluster.ranks=2", speeds,
                         f"trainer.allocation=[{half},{half}]", *steps)
    auto_rows = run_cli(root / "auto", "cluster.ranks=2", speeds, "trainer.rebalance_every=10",
                        "trainer.plot=true", *steps)
    thr_equal, thr_auto = throughput(equal_rows, args.warmup), throughput(auto_rows, args.warmup)
    # (d) plain DDP vs hetseq_hpc, both unthrottled, equal split
    cache = None
    alloc = json.loads((root / "auto" / "allocation.json").read_text())
    hetseq_rows = run_cli(root / "unthrottled", "cluster.ranks=2",
                          f"trainer.allocation=[{half},{half}]", *steps)
    for cand in (Path(os.environ.get("HETSEQ_CACHE", "")), Path.home() / ".cache" / "hetseq_hpc"):
        if str(cand) and cand.is_dir():
            cache = str(cand)
            break
    hetseq_step = statistics.median(r["step_time_s"] for r in hetseq_rows if r["step"] > args.warmup)
    ddp_step = plain_ddp_step_time(args.steps, args.warmup, cache)

    # scenario 2: the slow rank's quota changes mid-run
    change_at = args.steps // 3
    changed = {}

    def maybe_change(rows):
        if not changed and len(rows) >= change_at:
            emu = json.loads((root / "change" / "logs" / "rank1.emulation.json").read_text())
            from hetseq_hpc.env.emulation import set_quota

            set_quota(emu["control"], args.changed)
            changed["step"] = rows[-1]["step"]
            changed["method"] = emu["method"]

    change_rows = run_cli(root / "change", "cluster.ranks=2", speeds, "trainer.rebalance_every=5",
                          "trainer.plot=true", f"trainer.max_steps={args.steps * 2}",
                          on_row=maybe_change)
    new_ideal = alone[1.0] + alone[args.changed]
    recovered = None
    after = [r for r in change_rows if r["step"] > changed.get("step", 10**9)]
    for i in range(len(after) - 2):
        window = after[i:i + 3]
        eff = GLOBAL_BATCH / statistics.median(r["step_time_s"] for r in window) / new_ideal
        if eff >= 0.9:
            recovered = window[0]["step"] - changed["step"]
            break
    reallocs = [r["reallocation"] for r in change_rows if "reallocation" in r]

    result = {
        "efficiency_equal": thr_equal / ideal,
        "efficiency_balanced": thr_auto / ideal,
        "speedup": thr_auto / thr_equal,
        "overhead_vs_ddp": hetseq_step / ddp_step - 1,
        "steps_to_recover": recovered,
        "machine": f"{platform.node()} {os.cpu_count()} CPU {platform.processor() or platform.machine()}",
        "emulation": alloc["ranks"][1].get("emulation", {}).get("method"),
    }
    line = "-" * 72
    print(line)
    print(f"hetseq_hpc heterogeneous benchmark: BERT default model, global batch {GLOBAL_BATCH}, "
          f"{args.steps} steps/run, medians after {args.warmup}")
    print(line)
    print(f"(a) standalone   speed 1.00: {alone[1.0]:7.1f} samples/s")
    print(f"                 speed {args.slow:.2f}: {alone[args.slow]:7.1f} samples/s   "
          f"ideal sum {ideal:7.1f}")
    print(f"(b) equal split  {half}/{half}:       {thr_equal:7.1f} samples/s   efficiency "
          f"{result['efficiency_equal']:.3f}")
    print(f"(c) hetseq_hpc   {alloc['allocation']['shares'][0]['samples']}/"
          f"{alloc['allocation']['shares'][1]['samples']} (calibrated): {thr_auto:7.1f} samples/s   "
          f"efficiency {result['efficiency_balanced']:.3f}   speedup {result['speedup']:.2f}x")
    print(f"(d) unthrottled  plain DDP {ddp_step * 1000:6.1f} ms/step, hetseq_hpc "
          f"{hetseq_step * 1000:6.1f} ms/step: overhead {result['overhead_vs_ddp']:+.3f}")
    print(f"scenario 2: slow rank {args.slow} -> {args.changed} at step {changed.get('step')} "
          f"({changed.get('method')}); re-allocations {[(r['at_step'], r['to']) for r in reallocs]}; "
          f"back above 0.9 after {recovered} steps")
    print(f"runs in {root}; plots {root / 'auto' / 'ranks.png'}, {root / 'change' / 'ranks.png'}; "
          f"{time.time() - started:.0f} s")
    print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
