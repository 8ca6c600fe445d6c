#!/usr/bin/env python3
"""HetSeqStrategy against plain Lightning DDP, two ranks on this machine's CPUs, interleaved:
each round runs four trainings of the same LightningModule (scripts/lightning_run.py, a
512 -> 2048 -> 4 MLP with LayerNorm, one torch thread per rank), in this order:

* ``ddp_equal`` / ``hetseq_equal``: both ranks at full speed on the equal split (HetSeqStrategy
  forced to it, no re-balancing): the strategy's per-step overhead, target <= 3 %;
* ``ddp_throttled`` / ``hetseq_throttled``: rank 1 throttled to ``--speed`` of a CPU from before
  calibration (the benchmarks' emulation, a cgroup CPU quota); DDP keeps the equal split,
  HetSeqStrategy measures its own: the speed-up, target >= 1.5x.

A run's step time is the median of rank 0's step-end intervals after ``--warmup`` steps, with
rank 0's training-thread CPU time per step beside it (a shared machine's load lengthens the
first, hardly the second); each figure is the median over rounds. The emulation throttles the
whole rank, its per-step fixed cost too (Lightning's bookkeeping, the optimizer step), which no
split shortens: the global batch (1024) is large enough that the samples' compute fills a step;
``--speed`` must be below the CPU share a rank gets anyway on a busy machine. Last line: one
JSON object (machine, per-run medians, overhead, speed-up, targets met).

    python scripts/bench_lightning.py [--rounds 3] [--steps 30] [--speed 0.1]
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
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "scripts" / "lightning_run.py"
#: the benchmark's model and data (compute, not Lightning's bookkeeping, fills a step)
MODEL = ["--features", "512", "--hidden", "2048"]
#: the targets of issue 44
MAX_OVERHEAD = 0.03
MIN_SPEEDUP = 1.5


def machine() -> str:
    """This machine in words: CPUs, their model, the load when the benchmark started."""
    from hetseq_hpc.env.hardware import _cpu_model

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPU {_cpu_model()} (load {load:.1f} at start)"


def run(kind: str, args: argparse.Namespace, out: Path) -> Tuple[float, float]:
    """One training; its median step time and rank 0's median training-thread CPU time per
    step, in seconds."""
    half = args.global_batch // 2
    common = [
        "--devices", "2", *MODEL, "--global-batch-size", str(args.global_batch),
        "--samples", str(args.global_batch * (args.steps + 2)),
        "--max-steps", str(args.steps), "--out", str(out),
    ]  # fmt: skip
    throttle = ["--slow-rank", "1", "--slow-at", "-1", "--slow-speed", str(args.speed)]
    extra = {
        "ddp_equal": ["--mode", "ddp", "--allocation", f"[{half},{half}]"],
        "hetseq_equal": ["--allocation", f"[{half},{half}]", "--rebalance-every", "0"],
        "ddp_throttled": ["--mode", "ddp", "--allocation", f"[{half},{half}]", *throttle],
        "hetseq_throttled": [*throttle],
    }[kind]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(RUN), *common, *extra, "--max-micro-batch", str(args.global_batch)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        sys.exit(f"bench_lightning: {kind} failed:\n{proc.stderr[-3000:]}")
    record = json.loads(out.read_text())
    wall, cpu = (record[key][args.warmup :] for key in ("times", "cpu_times"))
    return (
        statistics.median(b - a for a, b in itertools.pairwise(wall)),
        statistics.median(b - a for a, b in itertools.pairwise(cpu)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--speed", type=float, default=0.1)
    args = parser.parse_args()
    where = machine()
    kinds = ("ddp_equal", "hetseq_equal", "ddp_throttled", "hetseq_throttled")
    steps: Dict[str, List[float]] = {k: [] for k in kinds}
    cpu: Dict[str, List[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as tmp:
        for r in range(args.rounds):
            for kind in kinds:  # interleaved: a slow phase of the machine hits every kind
                wall, busy = run(kind, args, Path(tmp) / f"{kind}{r}.json")
                steps[kind].append(wall)
                cpu[kind].append(busy)
                print(
                    f"round {r + 1} {kind}: {wall * 1e3:.1f} ms/step "
                    f"(rank 0 CPU {busy * 1e3:.1f} ms)",
                    flush=True,
                )
    median = {k: statistics.median(v) for k, v in steps.items()}
    median_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    overhead = median["hetseq_equal"] / median["ddp_equal"] - 1.0
    overhead_ms = 1e3 * (median["hetseq_equal"] - median["ddp_equal"])
    overhead_cpu = median_cpu["hetseq_equal"] / median_cpu["ddp_equal"] - 1.0
    speedup = median["ddp_throttled"] / median["hetseq_throttled"]
    print(f"machine: {where}")
    print(
        f"overhead on the equal split: {100 * overhead:+.1f} % (target <= {100 * MAX_OVERHEAD:.0f} %)"
    )
    print(f"speed-up with rank 1 at {args.speed:g}: {speedup:.2f}x (target >= {MIN_SPEEDUP}x)")
    result = {
        "machine": where,
        "global_batch": args.global_batch,
        "speed": args.speed,
        "rounds": args.rounds,
        "step_s": {k: [round(x, 5) for x in v] for k, v in steps.items()},
        "median_step_s": {k: round(v, 5) for k, v in median.items()},
        "cpu_step_s": {k: [round(x, 5) for x in v] for k, v in cpu.items()},
        "median_cpu_step_s": {k: round(v, 5) for k, v in median_cpu.items()},
        "overhead": round(overhead, 4),
        "overhead_ms": round(overhead_ms, 2),
        "overhead_cpu": round(overhead_cpu, 4),
        "speedup": round(speedup, 3),
        "overhead_ok": overhead <= MAX_OVERHEAD,
        "speedup_ok": speedup >= MIN_SPEEDUP,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
