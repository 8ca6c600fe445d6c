#!/usr/bin/env python3
"""Does the calibrated cost curve predict a micro-batch size it never timed? (CPU, in-process)

Calibrates the small BERT as a rank does (:func:`hetseq_hpc.balance.calibrate.calibrate`: timed
passes at ``m``, ``m / 4`` and ``m / 16``, the fastest of each size, fitted by
``t(m) = a + max(c m, h + g m)``), then times held-out sizes between them (``3m/4``, ``m/2``,
``m/8``) the same way (forward+backward on real samples, batches built before the clock, the
fastest of ``--repeats`` passes, sizes interleaved) and prints the relative error of each
prediction. The issue's target: within 10 % (``equal``: the calibration times as many passes
per size as the held-out sizes get, so both are the fastest of equally many; ``runtime``: with
``balance.calibration_steps`` passes, as a rank calibrates at start-up). Repeat ``--rounds``
times (a fresh calibration each round: the machine is shared and noisy); the median error of
each size is reported.
Last line: one JSON object.

    python scripts/bench_curve.py [--micro-batch 32] [--rounds 3] [--repeats 7] [--runtime-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetseq_hpc.balance.calibrate import calibrate
from hetseq_hpc.balance.curves import CostCurve
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.contract import checked_batch


def timed_pass_s(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> float:
    """Seconds of one forward+backward pass of ``batch`` (gradients dropped after)."""
    t0 = time.perf_counter()
    model(**batch).backward()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def one_round(task, micro: int, repeats: int, steps: int) -> Dict[str, Dict[str, float]]:
    """Calibrate a fresh model with ``steps`` timed passes, then time the held-out sizes
    ``repeats`` times each: ``{size: {predicted_s, measured_s, error}}``."""
    torch.manual_seed(0)
    model = task.build_model()

    def make(n: int) -> Dict[str, torch.Tensor]:
        return checked_batch(task, list(range(n)), 0, "train")

    cal = calibrate(model, make, torch.device("cpu"), micro, steps, 8e9, step_fixed=False)
    curve = CostCurve(cal.overhead_s, cal.per_sample_s, 0.0, cal.host_s, cal.host_per_sample_s)
    sizes = sorted({max(1, 3 * micro // 4), max(1, micro // 2), max(1, micro // 8)})
    batches = {m: make(m) for m in sizes}
    for m in sizes:  # warm-up: first shapes
        timed_pass_s(model, batches[m])
    best = {m: float("inf") for m in sizes}
    for _ in range(repeats):
        for m in sizes:
            best[m] = min(best[m], timed_pass_s(model, batches[m]))
    out = {}
    for m in sizes:
        predicted = curve.micro_s(m)
        out[str(m)] = {
            "predicted_s": round(predicted, 6),
            "measured_s": round(best[m], 6),
            "error": round(predicted / best[m] - 1.0, 4),
        }
    out["curve"] = {k: round(v, 7) for k, v in curve.to_dict().items()}  # type: ignore[assignment]
    out["timed"] = sorted({int(m) for m, _ in cal.timings})  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--runtime-steps", type=int, default=None, help="default: balance.calibration_steps"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = compose_run_config(
            [
                "task.model.hidden_size=128",
                "task.model.num_layers=2",
                "task.model.num_heads=2",
                "task.model.intermediate_size=512",
                "task.model.max_seq_len=64",
                "task.model.dropout=0.0",
                f"task.data.cache_dir={tmp}",
            ]
        )
        task = build_task(run.task, 0)
        task.prepare()
        task.load()
        # "equal": as many timed passes per calibrated size as each held-out size gets (the
        # form's own error); "runtime": balance.calibration_steps, as a rank calibrates
        runtime = args.runtime_steps or run.balance.calibration_steps
        modes = {"equal": 3 * args.repeats, "runtime": runtime}
        rounds: Dict[str, List[Dict[str, Dict[str, float]]]] = {m: [] for m in modes}
        for i in range(args.rounds):
            for mode, steps in modes.items():  # interleaved
                rounds[mode].append(one_round(task, args.micro_batch, args.repeats, steps))
                print(f"round {i + 1} {mode}: {json.dumps(rounds[mode][-1])}", flush=True)
    out: Dict[str, object] = {}
    for mode in modes:
        sizes = [k for k in rounds[mode][0] if k.isdigit()]
        errors = {m: statistics.median(r[m]["error"] for r in rounds[mode]) for m in sizes}
        out[mode] = {
            "calibration_steps": modes[mode],
            "median_error_by_size": errors,
            "max_abs_median_error": max(abs(e) for e in errors.values()),
        }
    out["within_10pct"] = out["equal"]["max_abs_median_error"] <= 0.10  # type: ignore[index]
    out["rounds"] = rounds
    out["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load": os.getloadavg()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
