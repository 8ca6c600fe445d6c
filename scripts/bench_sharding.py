#!/usr/bin/env python3
"""Sharded (FSDP2) against replicated (DDP) data parallelism, on this machine's CPU cores.

(a) step time where both fit, (b) memory per rank, (c) the largest model under an emulated
budget, (d) FSDP accumulation kept gathered against resharded. Last line: one JSON object.
What each part runs: docs/benchmarks.md, "How the scripts measure".

    python scripts/bench_sharding.py [--pairs 4] [--steps 20] [--budget-gb 0.03]
                                     [--ladder 1,2,4,8,16] [--micro 4] [--only-accumulation]
                                     [--only-throughput] [--precision fp32|bf16]
                                     [--units auto|per_unit|one] [--out DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hetero as hetero  # the CLI runner and step-time helpers

from hetseq_hpc.train.metrics import read_metrics

MODEL = [
    "task=bert",
    "task.model.num_heads=2",
    "task.model.max_seq_len=64",
    "task.model.dropout=0.0",
]


def model_args(hidden: int, layers: int) -> list:
    return [
        *MODEL,
        f"task.model.hidden_size={hidden}",
        f"task.model.num_layers={layers}",
        f"task.model.intermediate_size={4 * hidden}",
    ]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        "cluster.ranks=2",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        "trainer.plot=false",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.run(cmd, cwd=hetero.REPO, capture_output=True, text=True, timeout=1800)


def step_median(run_dir: Path, warmup: int) -> float:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return statistics.median(hetero.step_times(rows, warmup))


def throughput_pairs(root: Path, args) -> dict:
    """(a) and (b): interleaved DDP/FSDP pairs at the same split."""
    ratios, memory = [], {}
    for i in range(args.pairs):
        steps = {}
        order = ("none", "fsdp") if i % 2 == 0 else ("fsdp", "none")
        for mode in order:
            run_dir = root / f"pair{i}-{mode}"
            proc = train(
                run_dir,
                *model_args(args.hidden, args.layers),
                f"sharding.mode={mode}",
                f"trainer.max_steps={args.steps}",
                "trainer.global_batch_size=32",
                "balance.allocation=[16,16]",
                f"precision.default={args.precision}",
                f"sharding.units={args.units}",
            )
            if proc.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{proc.stderr[-2000:]}")
            steps[mode] = step_median(run_dir, warmup=4)
            memory[mode] = json.loads((run_dir / "summary.json").read_text())["memory"]
        ratios.append(steps["fsdp"] / steps["none"])
        print(
            f"  pair {i + 1}/{args.pairs}: step DDP {steps['none'] * 1e3:.1f} ms, FSDP "
            f"{steps['fsdp'] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    whole = memory["none"][0]["state_bytes"]  # a replica's state, measured on a DDP rank
    return {
        "fsdp_step_over_ddp": round(statistics.median(ratios), 4),
        # FSDP's samples/s over DDP's at the same split (issue 43's goal: >= 0.8)
        "fsdp_throughput_over_ddp": round(1.0 / statistics.median(ratios), 4),
        "ratio_pairs": [round(r, 4) for r in ratios],
        "precision": args.precision,
        "state_bytes_ddp": [int(m["state_bytes"]) for m in memory["none"]],
        "state_bytes_fsdp": [int(m["state_bytes"]) for m in memory["fsdp"]],
        "state_bytes_whole_over_world": int(whole / 2),
        "peak_rss_mb_ddp": [round(m["peak_rss_bytes"] / 2**20) for m in memory["none"]],
        "peak_rss_mb_fsdp": [round(m["peak_rss_bytes"] / 2**20) for m in memory["fsdp"]],
    }


def accumulation_pairs(root: Path, args) -> dict:
    """(d): interleaved pairs of FSDP runs with accumulation, kept gathered against resharded."""
    ratios, steps, peaks = [], {}, {}
    modes = ("keep_unsharded", "reshard")
    for i in range(args.pairs):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            run_dir = root / f"accum{i}-{mode}"
            proc = train(
                run_dir,
                *model_args(args.hidden, args.layers),
                "sharding.mode=fsdp",
                f"sharding.between_micro_batches={mode}",
                f"balance.max_micro_batch={args.micro}",
                f"trainer.max_steps={args.steps}",
                "trainer.global_batch_size=32",
                "balance.allocation=[16,16]",  # an emulated budget: torch's own peak
                "cluster.memory_budget_gb=1",
            )
            if proc.returncode != 0:
                raise SystemExit(f"FSDP {mode} run failed:\n{proc.stderr[-2000:]}")
            summary = json.loads((run_dir / "summary.json").read_text())
            used = summary["sharding"].get("between_micro_batches")
            if used != mode:  # e.g. a worker that never decides (an older checkout)
                raise SystemExit(f"asked for {mode}, the run used {used}")
            steps[mode] = step_median(run_dir, warmup=6)  # after the profiled steps
            peaks[mode] = [round(m["measured_peak_bytes"] / 2**20, 2) for m in summary["memory"]]
        ratios.append(steps["keep_unsharded"] / steps["reshard"])
        print(
            f"  pair {i + 1}/{args.pairs}: step resharded {steps['reshard'] * 1e3:.1f} ms, "
            f"kept gathered {steps['keep_unsharded'] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    return {
        "passes_per_step": 16 // args.micro,
        "kept_step_over_resharded": round(statistics.median(ratios), 4),
        "ratio_pairs": [round(r, 4) for r in ratios],
        "peak_mib_kept": peaks["keep_unsharded"],
        "peak_mib_resharded": peaks["reshard"],
    }


def param_count(hidden: int, layers: int) -> int:
    """Parameters of the BERT model with these settings (built on the meta device)."""
    import torch

    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM

    run = compose_run_config(model_args(hidden, layers))
    with torch.device("meta"):
        model = BertMaskedLM(run.task.model, int(run.task.data.vocab_size))
    return sum(p.numel() for p in model.parameters())


def planner_largest(args, mode: str) -> int:
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        "plan",
        "cluster.ranks=2",
        *model_args(args.hidden, args.ladder[0]),
        f"cluster.memory_budget_gb={args.budget_gb}",
        f"sharding.mode={mode}",
    ]
    proc = subprocess.run(cmd, cwd=hetero.REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return -1
    modes = json.loads(lines[-1]).get("modes", {})
    return int(modes.get("fsdp" if mode == "fsdp" else "ddp", {}).get("largest_params", -1))


def largest_that_trains(root: Path, args) -> dict:
    """(c): the ladder of model sizes under the budget, in each mode."""
    out = {}
    for mode in ("none", "fsdp"):
        fitted, params = 0, 0
        for layers in args.ladder:
            run_dir = root / f"fit-{mode}-{layers}"
            proc = train(
                run_dir,
                *model_args(args.hidden, layers),
                f"sharding.mode={mode}",
                f"cluster.memory_budget_gb={args.budget_gb}",
                "trainer.max_steps=2",
                "trainer.global_batch_size=8",
            )
            ok = proc.returncode == 0
            print(
                f"  {mode:5s} {layers:3d} layers: {'trains' if ok else 'refused'}"
                + ("" if ok else f" ({proc.stderr.strip().splitlines()[-1][:140]})"),
                flush=True,
            )
            if not ok:
                break
            fitted, params = layers, param_count(args.hidden, layers)
        out[mode] = {
            "largest_layers_trained": fitted,
            "parameters": params,
            "planner_largest_params": planner_largest(args, mode),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4, help="layers of the (a) model")
    parser.add_argument("--budget-gb", type=float, default=0.03)
    parser.add_argument(
        "--ladder", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16]
    )
    parser.add_argument("--micro", type=int, default=4, help="(d): samples per pass")
    parser.add_argument("--only-accumulation", action="store_true", help="run (d) alone")
    parser.add_argument("--only-throughput", action="store_true", help="run (a)+(b) alone")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="(a)+(b): every rank's"
    )
    parser.add_argument(
        "--units",
        choices=("auto", "per_unit", "one"),
        default="auto",
        help="(a)+(b): sharding.units of the FSDP runs (auto groups this model's layers)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    machine = f"{hetero._cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}"
    print(f"machine: {machine}", flush=True)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-sharding-"))
    started = time.monotonic()
    if args.only_throughput:
        print(f"(a)+(b) {args.pairs} interleaved DDP/FSDP pairs, {args.precision} ...", flush=True)
        result = throughput_pairs(root, args)
        result.update(machine=machine, seconds=round(time.monotonic() - started))
        print(json.dumps(result))
        return
    print(
        f"(d) {args.pairs} interleaved FSDP pairs with accumulation ({16 // args.micro} "
        "passes per step), kept gathered / resharded between micro-batches ...",
        flush=True,
    )
    accumulation = accumulation_pairs(root, args)
    if args.only_accumulation:
        print(
            json.dumps(
                {
                    "accumulation": accumulation,
                    "machine": machine,
                    "seconds": round(time.monotonic() - started),
                }
            )
        )
        return
    print(
        f"(a)+(b) {args.pairs} interleaved DDP/FSDP pairs, hidden {args.hidden}, "
        f"{args.layers} layers, {args.steps} steps ...",
        flush=True,
    )
    result = throughput_pairs(root, args)
    print(f"(c) largest model under {args.budget_gb} GiB per rank ...", flush=True)
    result["largest"] = largest_that_trains(root, args)
    result["accumulation"] = accumulation
    result.update(machine=machine, seconds=round(time.monotonic() - started))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
