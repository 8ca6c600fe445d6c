#!/usr/bin/env python3
"""The planner's network term against the all-reduce time measured on shaped links (issue 46).

Starts a test cluster of its own in network-namespace mode (scripts/test-cluster.sh,
``HETSEQ_TESTCLUSTER_NETNS=1``; needs root), shapes every node's link to each rate in turn
(tbf, both ways) and runs the default BERT as ``cluster=testcluster`` (3 ranks on 3 nodes,
one sample per rank, a few steps). Measured: the median (and the minimum) over the steps
after the first of ``allreduce_s`` in the step rows (rank 0's time with a gradient bucket's all-reduce in flight,
:meth:`hetseq_hpc.train.ddp_hooks.HookState.comm_row`). Predicted: the planner's full ring
all-reduce (``Prediction.allreduce_s`` of :func:`hetseq_hpc.plan.planner.make_plan` with
``plan.link_gbps`` = the rate): ``2 (N-1)/N x gradient bytes / rate + 2 (N-1) x latency``.
``predicted_trained_s`` is the same formula on the gradient bytes of the model the run trained
(its last checkpoint's parameters, tied ones once): the planner sizes BERT's vocabulary from
``task.data.vocab_size``, the tokenizer may stop below it on a small corpus. Nothing is fitted
to this machine. Last line: one JSON object.

    .venv/bin/python scripts/bench_network.py [--rates 1,10] [--steps 8] [--keep]   # as root
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.env.hardware import _cpu_model
from hetseq_hpc.plan.planner import make_plan
from hetseq_hpc.plan.step_time import ring_allreduce_s
from hetseq_hpc.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "test-cluster.sh"
WITHIN = 0.20


def job_overrides(steps: int) -> List[str]:
    """The default BERT, one sample per rank, no validation or checkpoint."""
    return [
        "cluster=testcluster",
        "trainer.global_batch_size=3",
        f"trainer.max_steps={steps}",
        f"optim.schedule_steps={steps}",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
    ]


def predicted_s(steps: int, gbps: float) -> Dict[str, float]:
    """The planner's full ring all-reduce at ``gbps`` and the bytes it moves."""
    run = compose_run_config([*job_overrides(steps), f"plan.link_gbps={gbps}"])
    plan = make_plan(run)
    return {
        "predicted_s": plan.prediction.allreduce_s,
        "gradient_bytes": plan.model.gradient_bytes,
        "params": plan.model.param_count,
        "ring_gbps": plan.ring_gbps or plan.link_gbps,
        "latency_s": run.plan.latency_s,
    }


def trained_gradient_bytes(run_dir: Path) -> float:
    """fp32 bytes of the trained model's parameters (the run's last checkpoint; a tied
    weight, stored under two names on one storage, once)."""
    import torch

    (last,) = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1:]
    model = torch.load(last, map_location="cpu", weights_only=False)["model"]
    unique = {t.untyped_storage().data_ptr(): t for t in model.values() if t.is_floating_point()}
    return float(sum(t.numel() for t in unique.values()) * 4)


def cluster(env: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True)


def measure(env: Dict[str, str], run_dir: Path, steps: int) -> Dict[str, Any]:
    """One job on the shaped cluster -> its per-step measured all-reduce figures."""
    cmd = [sys.executable, "-m", "hetseq_hpc", *job_overrides(steps), "cluster.wait=true"]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_network: the job failed:\n{proc.stderr[-3000:]}")
    rows = [r for r in read_metrics(run_dir) if "allreduce_s" in r]
    steady = rows[1:] or rows
    return {
        "measured_s": statistics.median(r["allreduce_s"] for r in steady),
        # the fastest step: waiting for a peer still computing (shared cores) only adds
        "measured_min_s": min(r["allreduce_s"] for r in steady),
        "measured_exposed_s": statistics.median(r["allreduce_exposed_s"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "per_step_s": [r["allreduce_s"] for r in rows],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1,10", help="link rates, Gbit/s, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the runs and the cluster's logs")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hsq-bn-"))  # short: slurmstepd's socket path
    env = dict(os.environ)
    env.update(HETSEQ_TESTCLUSTER_DIR=str(work / "c"), HETSEQ_TESTCLUSTER_NETNS="1")
    env["HETSEQ_CACHE"] = str(work / "cache")
    env.pop("HETSEQ_TESTCLUSTER_LINKS", None)
    start = cluster(env, "start")
    if start.returncode != 0:
        print(start.stderr.strip().splitlines()[-1], file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return start.returncode
    env["SLURM_CONF"] = start.stdout.strip().splitlines()[-1].split("=", 1)[1]
    results = []
    try:
        for gbps in rates:
            rate = f"{gbps:g}gbit" if gbps >= 1 else f"{gbps * 1000:g}mbit"
            for node in ("n1", "n2", "n3", "n4"):
                shaped = cluster(env, "link", node, rate)
                if shaped.returncode != 0:
                    raise SystemExit(f"bench_network: {shaped.stderr.strip()}")
            got = {"link_gbps": gbps, **predicted_s(args.steps, gbps)}
            got.update(measure(env, work / f"run-{rate}", args.steps))
            got["trained_gradient_bytes"] = trained_gradient_bytes(work / f"run-{rate}")
            got["predicted_trained_s"] = ring_allreduce_s(
                got["trained_gradient_bytes"], 3, got["ring_gbps"], got["latency_s"]
            )
            got["error"] = got["measured_s"] / got["predicted_s"] - 1.0
            got["error_trained"] = got["measured_s"] / got["predicted_trained_s"] - 1.0
            print(
                f"{rate}: predicted {got['predicted_s'] * 1e3:.1f} ms "
                f"({got['predicted_trained_s'] * 1e3:.1f} ms on the trained model's bytes), "
                f"measured {got['measured_s'] * 1e3:.1f} ms ({got['error']:+.0%}, "
                f"{got['error_trained']:+.0%}); exposed {got['measured_exposed_s'] * 1e3:.1f} ms "
                f"of a {got['step_time_s'] * 1e3:.0f} ms step; fastest step {got['measured_min_s'] * 1e3:.1f} ms",
                file=sys.stderr,
            )
            results.append(got)
    finally:
        cluster(env, "stop")
        if args.keep:
            print(f"runs and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "machine": f"{os.cpu_count()} CPU {_cpu_model()}",
        "ranks": 3,
        "results": results,
        "within_20pct": all(abs(r["error"]) <= WITHIN for r in results),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
