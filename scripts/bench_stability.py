#!/usr/bin/env python3
"""Does the split settle on a noisy machine, and does it still follow a real speed change?

(a) Two IDENTICAL ranks (the quick start's BERT task, global batch 32) train ``--steps`` steps
    while a bounded noisy neighbour -- a busy-looping process on the same cores, switched on and
    off at random (``--seed``; on 2-10 s, off 2-10 s; it ends with the run) -- competes for the
    CPU. The right split is even; every re-allocation is the re-balancer chasing noise.
    Reported: ``reallocations_per_1000_steps`` and ``worst_share_deviation`` (the largest
    |rank share - even share| seen in any step, as a fraction of the global batch).
(b) The speed-change scenario of ``scripts/bench_hetero.py``: a slow rank (0.35) gets faster
    (0.7) half-way; ``steps_to_recover`` = steps until a 4-step window runs at >= 0.9 of the
    co-running ceiling of the new pair (single-rank runs at 1.0 and 0.7 started together).

Targets: (a) <= 5 re-allocations per 1000 steps, worst_share_deviation <= 0.10; (b) back
above 0.9 within 10 steps. Both run quiet, then beside ``--load N`` busy loops
(scripts/busy_load.py); (b) also reports its first move after the change and its direction.

    python scripts/bench_stability.py [--steps 200] [--change-steps 60] [--load 6] [--out DIR]
Last line: one JSON object, the quiet figures at its top level, ``quiet`` and ``loaded``
(with the load average seen) side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hetero as hetero  # the same CLI runner, co-running ceiling and recovery
from busy_load import BusyLoad

from hetseq_hpc.train.metrics import read_metrics

NEIGHBOUR = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


def noisy_neighbour(stop_file: Path, seed: int, limit_s: float) -> subprocess.Popen:
    """A background driver that, until ``stop_file`` exists or ``limit_s`` passed, switches a
    busy-looping process on (2-10 s) and off (2-10 s) at random; returns the driver."""
    driver = f"""
import random, subprocess, sys, time, os
rng = random.Random({seed})
deadline = time.monotonic() + {limit_s}
on = 0.0
while time.monotonic() < deadline and not os.path.exists({str(stop_file)!r}):
    busy = rng.uniform(2, 10)
    p = subprocess.Popen([sys.executable, "-c", {NEIGHBOUR!r}, str(busy)])
    p.wait()
    on += busy
    time.sleep(rng.uniform(2, 10))
print(f"neighbour busy {{on:.0f}} s", flush=True)
"""
    return subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def scenario_noise(root: Path, steps: int, seed: int) -> dict:
    """(a): two identical ranks beside the noisy neighbour."""
    stop = root / "neighbour.stop"
    driver = noisy_neighbour(stop, seed, limit_s=3600)
    try:
        run_dir = root / "noise"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hetseq_hpc",
                "task=bert",
                "cluster.ranks=2",
                f"trainer.max_steps={steps}",
                "trainer.val_every=0",
                "trainer.checkpoint_every=0",
                f"hydra.run.dir={run_dir}",
            ],
            cwd=hetero.REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out = proc.communicate()[0]
    finally:
        stop.touch()
        try:
            driver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
    if proc.returncode != 0:
        sys.exit(f"noise run failed:\n{out[-3000:]}")
    rows = read_metrics(run_dir)
    batch = sum(r["samples"] for r in rows[0]["ranks"])
    moves = [r["reallocation"] for r in rows if "reallocation" in r]
    worst = max(
        abs(r["samples"] / batch - 1 / len(row["ranks"])) for row in rows for r in row["ranks"]
    )
    return {
        "reallocations": len(moves),
        "steps": len(rows),
        "reallocations_per_1000_steps": round(1000 * len(moves) / max(len(rows), 1), 2),
        "worst_share_deviation": round(worst, 4),
        "splits": sorted({tuple(r["samples"] for r in row["ranks"]) for row in rows}),
        "moves": [(m["at_step"], m["to"]) for m in moves],
    }


def scenario_change(root: Path, steps: int, slow: float, changed: float) -> dict:
    """(b): bench_hetero's speed change (slow rank ``slow`` -> ``changed`` half-way)."""
    hetero.GLOBAL_BATCH, hetero.MICRO_BATCH = 128, 32
    warmup = 4
    alone = {
        s: hetero.throughput(
            hetero.run_cli(
                root / f"alone-{s}",
                "cluster.ranks=1",
                f"cluster.speeds=[{s}]",
                "trainer.max_steps=12",
            ),
            warmup,
        )
        for s in (1.0, changed)
    }
    ceiling = hetero.corunning(root, (1.0, changed), 12, warmup, alone)
    seen: dict = {}

    def maybe_change(rows):
        if not seen and len(rows) >= steps // 2:
            emu = json.loads((root / "change" / "logs" / "rank1.emulation.json").read_text())
            from hetseq_hpc.env.emulation import emulated_cpus, set_quota

            threads = max(1, round(emu["cpus"] / emu["speed"]))
            set_quota(emu["control"], emulated_cpus(changed, threads))
            seen["step"] = rows[-1]["step"]

    rows = hetero.run_cli(
        root / "change",
        "cluster.ranks=2",
        f"cluster.speeds=[1.0,{slow}]",
        f"trainer.max_steps={steps}",
        on_row=maybe_change,
    )
    at = seen.get("step", 10**9)
    return {
        "steps_to_recover": hetero.recovery(rows, at, ceiling[1.0] + ceiling[changed]),
        "changed_at_step": seen.get("step"),
        **hetero.first_move_after(rows, at, faster_rank=1),
        "moves": [
            (r["reallocation"]["at_step"], r["reallocation"]["to"])
            for r in rows
            if "reallocation" in r
        ],
    }


def run_mode(root: Path, args, load: int) -> dict:
    """Scenarios (a) and (b) (unless ``--skip-change``) with ``load`` busy loops running
    throughout (0: quiet); their figures, and the load average seen."""
    root.mkdir(parents=True, exist_ok=True)
    with BusyLoad(load) as busy:
        noise = scenario_noise(root, args.steps, args.seed)
        tag = f"load {load}" if load else "quiet"
        print(
            f"[{tag}] (a) {noise['reallocations']} re-allocations in {noise['steps']} steps; "
            f"splits seen {noise['splits']}; worst share deviation "
            f"{noise['worst_share_deviation']}",
            flush=True,
        )
        change = (
            {}
            if args.skip_change
            else scenario_change(root, args.change_steps, args.slow, args.changed)
        )
    if change:
        print(
            f"[{tag}] (b) speed change at step {change['changed_at_step']}: first move after "
            f"{change['first_move_after']} steps (right way: {change['first_move_right_way']}, "
            f"reversed: {change['reversed']}), recovered after {change['steps_to_recover']} "
            f"steps; moves {change['moves']}",
            flush=True,
        )
    return {
        "reallocations_per_1000_steps": noise["reallocations_per_1000_steps"],
        "worst_share_deviation": noise["worst_share_deviation"],
        "noise_steps": noise["steps"],
        "noise_moves": noise["moves"],
        "steps_to_recover": change.get("steps_to_recover"),
        "first_move_after": change.get("first_move_after"),
        "first_move_right_way": change.get("first_move_right_way"),
        "reversed": change.get("reversed"),
        "change_moves": change.get("moves"),
        "load": busy.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of scenario (a)")
    parser.add_argument("--change-steps", type=int, default=60, help="steps of scenario (b)")
    parser.add_argument("--seed", type=int, default=0, help="the neighbour's on/off pattern")
    parser.add_argument("--slow", type=float, default=0.35)
    parser.add_argument("--changed", type=float, default=0.7)
    parser.add_argument("--skip-change", action="store_true", help="run scenario (a) only")
    parser.add_argument(
        "--load",
        type=int,
        default=6,
        help="busy loops beside the loaded runs (0: quiet runs only)",
    )
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()
    if args.load < 0:
        parser.error(f"--load {args.load}: give 0 (quiet only) or more busy loops")
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-stability-"))
    root.mkdir(parents=True, exist_ok=True)
    machine = f"{hetero._cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}"
    print(f"machine: {machine}", flush=True)
    started = time.time()
    random.seed(args.seed)
    quiet = run_mode(root / "quiet", args, 0)
    loaded = run_mode(root / "loaded", args, args.load) if args.load else None
    result = {
        **{k: v for k, v in quiet.items() if k != "load"},
        "quiet": quiet,
        "loaded": loaded,
        "machine": machine,
        "wall_s": round(time.time() - started, 1),
        "runs": str(root),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
