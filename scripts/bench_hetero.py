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
step time of hetseq_hpc / step time of plain DDP - 1. Targets: efficiency_balanced >= 0.95,
overhead_vs_ddp <= 0.02.

How it measures: a step's time is the wall-clock time between consecutive steps' ends
(hetseq_hpc: the ``time`` field of metrics.jsonl rows, so logging and metrics writing count;
plain DDP: its loop), and throughput = global batch / median step time after warm-up. Runs on
a shared 2-core VM drift by +-5-10 % from one run to the next, so (d) alternates plain DDP and
hetseq_hpc ``--repeats`` times and compares the medians of the runs' medians. The global batch
(default 128) and the micro-batch cap (default 32; plain DDP accumulates the same way) are the
same in every scenario; with a small global batch, the fixed per-step costs every data-parallel
rank pays (all-reduce, optimizer step) dominate this small model's step, and one huge
micro-batch runs slower per sample on a CPU than several of 32.

    python scripts/bench_hetero.py [--global-batch 128] [--steps 30] [--slow 0.35] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetseq_hpc.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 128  # set from --global-batch in main()
MICRO_BATCH = 32  # the same micro-batch cap everywhere (set from --micro-batch)
COMMON = ["trainer.val_every=0", "trainer.checkpoint_every=0", "trainer.keep_checkpoints=1",
          "cluster.threads_per_rank=1"]


def run_cli(run_dir: Path, *overrides: str, on_row=None) -> list:
    """Run ``python -m hetseq_hpc`` to the end; ``on_row(rows)`` is called as metrics arrive."""
    cmd = [sys.executable, "-m", "hetseq_hpc", *COMMON, f"trainer.global_batch_size={GLOBAL_BATCH}",
           f"trainer.max_micro_batch={MICRO_BATCH}",
           *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = run_dir / "metrics.jsonl"
    seen = 0
    while proc.poll() is None:
        if on_row is not None and metrics.exists():
            rows = read_metrics(metrics)
            if len(rows) > seen:
                seen = len(rows)
                on_row(rows)
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(overrides)}):\n{out[-3000:]}")
    return read_metrics(metrics)


def step_times(rows: list, warmup: int) -> list:
    """Wall-clock seconds between consecutive step ends, for steps after ``warmup``."""
    return [b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] > warmup]


def throughput(rows: list, warmup: int) -> float:
    """Global batch / median step time (s) over steps after ``warmup``."""
    return GLOBAL_BATCH / statistics.median(step_times(rows, warmup))


def plain_ddp_step_time(steps: int, warmup: int) -> float:
    """Median step time (s) of textbook DDP (scripts/plain_ddp.py) on the same model, data and
    equal split, 2 unthrottled ranks x 1 thread."""
    out = Path(tempfile.mkdtemp()) / "plain.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "plain_ddp.py"), "--steps", str(steps),
                    "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
                    "--out", str(out)], cwd=REPO, check=True)
    return statistics.median(json.loads(out.read_text())[warmup:])


def _cpu_model() -> str:
    from hetseq_hpc.env.hardware import _cpu_model as model

    return model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=128, help="global batch, every scenario")
    parser.add_argument("--micro-batch", type=int, default=32,
                        help="micro-batch cap, every scenario (larger ones run slower per sample "
                             "on CPU)")
    parser.add_argument("--steps", type=int, default=30, help="steps per measured run")
    parser.add_argument("--alone-steps", type=int, default=12, help="steps per standalone run")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs for (d)")
    parser.add_argument("--slow", type=float, default=0.35, help="speed of the slow rank")
    parser.add_argument("--changed", type=float, default=0.7, help="slow rank's speed after the change")
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()
    global GLOBAL_BATCH, MICRO_BATCH
    GLOBAL_BATCH, MICRO_BATCH = args.global_batch, args.micro_batch
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    steps = [f"trainer.max_steps={args.steps}"]
    started = time.time()

    # (a) standalone throughput at each speed
    alone = {}
    for speed in (1.0, args.slow, args.changed):
        rows = run_cli(root / f"alone-{speed}", "cluster.ranks=1", f"cluster.speeds=[{speed}]",
                       f"trainer.max_steps={args.alone_steps}")
        alone[speed] = throughput(rows, min(args.warmup, args.alone_steps // 3))
    ideal = alone[1.0] + alone[args.slow]
    speeds = f"cluster.speeds=[1.0,{args.slow}]"
    half = GLOBAL_BATCH // 2
    # (b) equal split, (c) hetseq_hpc automatic allocation with online re-balancing
    equal_rows = run_cli(root / "equal", "cluster.ranks=2", speeds,
                         f"trainer.allocation=[{half},{half}]", *steps)
    auto_rows = run_cli(root / "auto", "cluster.ranks=2", speeds, "trainer.rebalance_every=10",
                        "trainer.plot=true", *steps)
    thr_equal, thr_auto = throughput(equal_rows, args.warmup), throughput(auto_rows, args.warmup)
    # the planner's prediction for (c), from the standalone throughputs as its probe
    probe = root / "standalone-probe.json"
    probe.write_text(json.dumps({"ranks": [
        {"rank": r, "device": f"cpu @{s}", "calibration": {"samples_per_s": alone[s],
                                                           "max_micro_batch": MICRO_BATCH}}
        for r, s in enumerate((1.0, args.slow))]}))
    plan_out = subprocess.run(
        [sys.executable, "-m", "hetseq_hpc.plan", "cluster.ranks=2", speeds,
         f"trainer.global_batch_size={GLOBAL_BATCH}", f"trainer.max_micro_batch={MICRO_BATCH}",
         f"plan.probe={probe}"], cwd=REPO, capture_output=True, text=True)
    predicted = None
    if plan_out.returncode == 0:
        predicted = json.loads(plan_out.stdout.strip().splitlines()[-1])["predicted_samples_per_s"]
    else:
        print(f"planner failed: {plan_out.stderr.strip()[-500:]}", file=sys.stderr)

    # (d) plain DDP vs hetseq_hpc, both unthrottled, equal split, alternating runs
    alloc = json.loads((root / "auto" / "allocation.json").read_text())
    hetseq_runs, ddp_runs = [], []
    for i in range(args.repeats):
        ddp_runs.append(plain_ddp_step_time(args.steps, args.warmup))
        rows = run_cli(root / f"unthrottled-{i}", "cluster.ranks=2",
                       f"trainer.allocation=[{half},{half}]", *steps)
        hetseq_runs.append(statistics.median(step_times(rows, args.warmup)))
    hetseq_step, ddp_step = statistics.median(hetseq_runs), statistics.median(ddp_runs)

    # scenario 2: the slow rank's quota changes mid-run
    change_at = args.steps // 2
    changed = {}

    def maybe_change(rows):
        if not changed and len(rows) >= change_at:
            emu = json.loads((root / "change" / "logs" / "rank1.emulation.json").read_text())
            from hetseq_hpc.env.emulation import emulated_cpus, set_quota

            threads = max(1, round(emu["cpus"] / emu["speed"]))  # the rank's thread count
            set_quota(emu["control"], emulated_cpus(args.changed, threads))
            changed["step"] = rows[-1]["step"]
            changed["method"] = emu["method"]

    change_rows = run_cli(root / "change", "cluster.ranks=2", speeds, "trainer.rebalance_every=5",
                          "trainer.plot=true", f"trainer.max_steps={args.steps * 2}",
                          on_row=maybe_change)
    new_ideal = alone[1.0] + alone[args.changed]
    recovered = None
    after = [r for r in change_rows if r["step"] > changed.get("step", 10**9)]
    for i in range(1, len(after) - 2):
        window = after[i - 1:i + 3]
        eff = GLOBAL_BATCH / statistics.median(step_times(window, 0)) / new_ideal
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
        "planner_error": (predicted / thr_auto - 1) if predicted else None,
        "global_batch": GLOBAL_BATCH,
        "machine": f"{os.cpu_count()} CPU {_cpu_model()}",
        "emulation": alloc["ranks"][1].get("emulation", {}).get("method"),
    }
    line = "-" * 72
    print(line)
    print(f"hetseq_hpc heterogeneous benchmark: BERT default model, global batch {GLOBAL_BATCH}, "
          f"{args.steps} steps/run, medians after {args.warmup}; {result['machine']}")
    print(line)
    print(f"(a) standalone   speed 1.00: {alone[1.0]:7.1f} samples/s")
    print(f"                 speed {args.slow:.2f}: {alone[args.slow]:7.1f} samples/s   "
          f"ideal sum {ideal:7.1f}")
    print(f"(b) equal split  {half}/{half}:       {thr_equal:7.1f} samples/s   efficiency "
          f"{result['efficiency_equal']:.3f}")
    print(f"(c) hetseq_hpc   {alloc['allocation']['shares'][0]['samples']}/"
          f"{alloc['allocation']['shares'][1]['samples']} (calibrated): {thr_auto:7.1f} samples/s   "
          f"efficiency {result['efficiency_balanced']:.3f}   speedup {result['speedup']:.2f}x")
    if predicted:
        print(f"    planner predicted {predicted:7.1f} samples/s for (c): "
              f"{result['planner_error']:+.1%} off the measurement")
    print(f"(d) unthrottled  plain DDP {ddp_step * 1000:6.1f} ms/step, hetseq_hpc "
          f"{hetseq_step * 1000:6.1f} ms/step: overhead {result['overhead_vs_ddp']:+.3f} "
          f"(runs: DDP {[round(t * 1000, 1) for t in ddp_runs]}, "
          f"hetseq_hpc {[round(t * 1000, 1) for t in hetseq_runs]} ms)")
    print(f"scenario 2: slow rank {args.slow} -> {args.changed} at step {changed.get('step')} "
          f"({changed.get('method')}); re-allocations {[(r['at_step'], r['to']) for r in reallocs]}; "
          f"back above 0.9 after {recovered} steps")
    print(f"runs in {root}; plots {root / 'auto' / 'ranks.png'}, {root / 'change' / 'ranks.png'}; "
          f"{time.time() - started:.0f} s")
    print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
