#!/usr/bin/env python3
"""The planner's network term against the all-reduce measured on shaped links (issue 46).

Starts a namespaced test cluster of its own (scripts/test-cluster.sh, ``HETSEQ_TESTCLUSTER_NETNS=1``;
root), shapes every node's link to each rate (tbf, both ways) and runs the default BERT as
``cluster=testcluster`` (3 ranks, one sample each). Measured: the median and minimum
``allreduce_s`` of the step rows after the first. Predicted: the planner's ring all-reduce,
``2 (N-1)/N x gradient bytes / rate + 2 (N-1) x latency``, also on the trained model's bytes
(``predicted_trained_s``). Nothing is fitted to this machine. Last line: one JSON object.

``--balance``: two ranks (a100 n1 at full speed, v100 n3 slowed to ``--slow``), links at the
first rate, global batch ``--global-batch``: hetseq_hpc's own split against fixed splits around
the speed ratio and the equal one, interleaved in ``--rounds``; the ceiling is the round's best
fixed split; rates from the median step time of the last two thirds of the steps.

    .venv/bin/python scripts/bench_network.py [--rates 1,10] [--steps 8] [--keep]   # as root
    .venv/bin/python scripts/bench_network.py --balance [--rates 0.5] [--rounds 3]
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


def balance_run(
    env: Dict[str, str], run_dir: Path, args: argparse.Namespace, split: List[int]
) -> Dict[str, Any]:
    """One 2-rank job of ``--balance`` (``split``: a fixed split, or [] for hetseq_hpc's own)
    -> its steady step time, rate, final split and all-reduce share of the step."""
    steps = args.steps
    overrides = [
        "cluster=testcluster",
        "cluster.wait=true",
        "cluster.partitions.v100.nodes=1",
        f"cluster.partitions.v100.emulate_speed={args.slow}",
        f"trainer.global_batch_size={args.global_batch}",
        f"trainer.max_steps={steps}",
        f"optim.schedule_steps={steps}",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        *([f"balance.allocation=[{split[0]},{split[1]}]"] if split else []),
    ]
    cmd = [sys.executable, "-m", "hetseq_hpc", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_network: the job failed:\n{proc.stderr[-3000:]}")
    rows = [r for r in read_metrics(run_dir) if "step_time_s" in r and r.get("event") is None]
    steady = rows[len(rows) // 3 :]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    return {
        "split": list(rows[-1]["allocation"]),
        "step_time_s": step_s,
        "samples_per_s": args.global_batch / step_s,
        "allreduce_share": statistics.median(r.get("allreduce_s", 0.0) for r in steady) / step_s,
        "exposed_share": statistics.median(r.get("allreduce_exposed_s", 0.0) for r in steady)
        / step_s,
    }


def balance_rounds(env: Dict[str, str], work: Path, args: argparse.Namespace) -> Dict[str, Any]:
    """``--balance``: hetseq_hpc's split against fixed splits, interleaved in rounds."""
    batch = args.global_batch
    ideal = batch / (1.0 + args.slow)  # the fast rank's share at equal compute time
    fixed = sorted({max(1, min(batch - 1, round(ideal) + d)) for d in (-1, 0, 1, 2)})
    fixed = sorted({*fixed, batch // 2})
    rounds = []
    for index in range(args.rounds):
        got: Dict[str, Any] = {"own": balance_run(env, work / f"own-{index}", args, [])}
        for first in fixed:
            name = f"{first}-{batch - first}"
            got[name] = balance_run(env, work / f"{name}-{index}", args, [first, batch - first])
        ceiling = max(v["samples_per_s"] for k, v in got.items() if k != "own")
        equal = got[f"{batch // 2}-{batch - batch // 2}"]["samples_per_s"]
        got["efficiency"] = got["own"]["samples_per_s"] / ceiling
        got["equal_vs_ceiling"] = equal / ceiling
        got["best_fixed"] = max(
            (k for k in got if k not in ("own", "efficiency", "equal_vs_ceiling")),
            key=lambda k: got[k]["samples_per_s"],
        )
        print(
            f"round {index}: own split {got['own']['split']} "
            f"{got['own']['samples_per_s']:.1f} samples/s = {got['efficiency']:.3f} of the "
            f"ceiling ({got['best_fixed']}); equal {got['equal_vs_ceiling']:.3f}; all-reduce "
            f"{got['own']['allreduce_share']:.0%} of the step "
            f"({got['own']['exposed_share']:.0%} exposed)",
            file=sys.stderr,
        )
        rounds.append(got)
    return {
        "slow": args.slow,
        "global_batch": batch,
        "rounds": rounds,
        "efficiency_median": statistics.median(r["efficiency"] for r in rounds),
        "equal_vs_ceiling_median": statistics.median(r["equal_vs_ceiling"] for r in rounds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1,10", help="link rates, Gbit/s, comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (8; --balance 30)")
    ap.add_argument("--keep", action="store_true", help="keep the runs and the cluster's logs")
    ap.add_argument("--balance", action="store_true", help="the balancing on a slow link")
    ap.add_argument("--slow", type=float, default=0.4, help="--balance: the slow rank's speed")
    ap.add_argument("--global-batch", type=int, default=16, help="--balance: global batch")
    ap.add_argument("--rounds", type=int, default=2, help="--balance: interleaved rounds")
    args = ap.parse_args()
    args.steps = args.steps or (30 if args.balance else 8)
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
        if args.balance:  # one rate: every link shaped to it, then the rounds
            rate = f"{rates[0]:g}gbit" if rates[0] >= 1 else f"{rates[0] * 1000:g}mbit"
            for node in ("n1", "n2", "n3", "n4"):
                shaped = cluster(env, "link", node, rate)
                if shaped.returncode != 0:
                    raise SystemExit(f"bench_network: {shaped.stderr.strip()}")
            out = {"machine": f"{os.cpu_count()} CPU {_cpu_model()}", "link_gbps": rates[0]}
            out.update(balance_rounds(env, work, args))
            print(json.dumps(out))
            return 0
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
