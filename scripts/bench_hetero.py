#!/usr/bin/env python3
"""Side-by-side benchmark: do a fast and a slow device train at (nearly) the SUM of their speeds?

Two ranks, one throttled to ~0.35 by a cgroup CPU quota, train the BERT task's default model:
standalone and co-running ceilings, equal split, hetseq_hpc's allocation, a speed change, and
plain DDP against hetseq_hpc, in interleaved rounds. Last line: one JSON object.
What each run measures and every JSON key: docs/benchmarks.md, "How the scripts measure".

    python scripts/bench_hetero.py [--global-batch 128] [--rounds 3] [--pairs 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetseq_hpc.train.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_load import BusyLoad  # a sibling script, not a package

REPO = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 128  # set from --global-batch in main()
MICRO_BATCH = 32  # the same micro-batch cap everywhere (set from --micro-batch)
COMMON = [
    "trainer.val_every=0",
    "trainer.checkpoint_every=0",
    "trainer.keep_checkpoints=1",
    "cluster.threads_per_rank=1",
]


def start_cli(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """Start ``python -m hetseq_hpc`` (not waiting)."""
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        *COMMON,
        f"trainer.global_batch_size={GLOBAL_BATCH}",
        f"balance.max_micro_batch={MICRO_BATCH}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish_cli(proc: subprocess.Popen, run_dir: Path, what: str) -> list:
    """Wait for a run started by :func:`start_cli`; its metrics rows."""
    out = proc.communicate()[0]
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({what}):\n{out[-3000:]}")
    return read_metrics(run_dir / "metrics.jsonl")


def run_cli(run_dir: Path, *overrides: str, on_row=None) -> list:
    """Run ``python -m hetseq_hpc`` to the end; ``on_row(rows)`` is called as metrics arrive."""
    proc = start_cli(run_dir, *overrides)
    metrics = run_dir / "metrics.jsonl"
    seen = 0
    while on_row is not None and proc.poll() is None:
        if metrics.exists():
            rows = read_metrics(metrics)
            if len(rows) > seen:
                seen = len(rows)
                on_row(rows)
        time.sleep(0.1)
    return finish_cli(proc, run_dir, " ".join(overrides))


def step_times(rows: list, warmup: int) -> list:
    """Wall-clock seconds between consecutive step ends, for steps after ``warmup``."""
    return [b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] > warmup]


def low_quartile(values: list) -> float:
    """25th percentile (inclusive method) of a list of step times."""
    return (
        statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]
    )


def throughput(rows: list, warmup: int) -> float:
    """Global batch / median step time (s) over steps after ``warmup``."""
    return GLOBAL_BATCH / statistics.median(step_times(rows, warmup))


def balance_error(rows: list, warmup: int) -> float:
    """Median over steps of (max - min) of the ranks' busy time (compute + per-step tail) over
    the step's wall time: the longest wait any rank had, as a share of the step."""
    shares = []
    for row in rows:
        if row["step"] <= warmup or not row.get("step_time_s"):
            continue
        busy = [r["compute_time_s"] + r.get("tail_time_s", 0.0) for r in row["ranks"]]
        shares.append((max(busy) - min(busy)) / row["step_time_s"])
    return statistics.median(shares) if shares else float("nan")


def in_job_rates(rows: list, warmup: int) -> list:
    """Each rank's own rate inside the job: per step, its samples over its busy time (compute +
    per-step tail, no waiting), median over the steps after ``warmup``. Their sum is what the
    ranks deliver together if none of them ever waited and a step cost nothing beyond their own
    work -- the ceiling that leaves out only balancing and synchronisation."""
    per_rank = {}
    for row in rows:
        if row["step"] <= warmup:
            continue
        for i, r in enumerate(row["ranks"]):
            busy = r["compute_time_s"] + r.get("tail_time_s", 0.0)
            if busy > 0:
                per_rank.setdefault(i, []).append(r["samples"] / busy)
    return [statistics.median(per_rank[i]) for i in sorted(per_rank)]


def corunning(
    root: Path,
    speeds: tuple,
    steps: int,
    warmup: int,
    alone: dict,
    batches: dict | None = None,
    suffix: str = "",
) -> dict:
    """Rates (samples/s) of single-rank runs at ``speeds`` started together, counting only the
    steps that ended while every one of them was past its warm-up and still running. Each run's
    step is ``batches[speed]`` samples (default: the global batch), in micro-batches of at most
    the cap; ``suffix`` ends the run directories' names (a second run of the same pair)."""
    batches = batches or {s: GLOBAL_BATCH for s in speeds}
    expected = {s: batches[s] / alone[s] for s in speeds}  # seconds per step, roughly
    longest = max(expected.values())
    procs = {}
    for s in speeds:  # shorter steps run more of them so that all overlap the longest run
        n = max(steps, math.ceil(steps * longest / expected[s]) + warmup)
        tag = "-".join(map(str, speeds)) + (f"-b{batches[s]}" if batches[s] != GLOBAL_BATCH else "")
        run_dir = root / f"corun-{tag}{suffix}-{s}"
        procs[s] = (
            run_dir,
            start_cli(
                run_dir,
                "cluster.ranks=1",
                f"cluster.speeds=[{s}]",
                f"trainer.max_steps={n}",
                f"trainer.global_batch_size={batches[s]}",
            ),
        )
    rows = {s: finish_cli(p, d, f"co-running at {s}") for s, (d, p) in procs.items()}
    begin = max(r[min(warmup, len(r) - 1)]["time"] for r in rows.values())
    end = min(r[-1]["time"] for r in rows.values())
    out = {}
    for s, r in rows.items():
        inside = [
            b["time"] - a["time"]
            for a, b in itertools.pairwise(r)
            if a["time"] >= begin and b["time"] <= end
        ]
        if len(inside) < 3:  # too little overlap: fall back to the steps after warm-up
            inside = step_times(r, warmup)
        out[s] = batches[s] / statistics.median(inside)
    return out


def best_split_ceiling(points: list, batch: int) -> tuple:
    """The co-running ceiling AT a global batch: ``(samples/s, split)`` of the best integer
    split of ``batch`` over the ranks, each rank's step time for ``n`` samples interpolated
    linearly (``t(n) = alpha + beta * n``) through its two co-running measurements
    ``points[i] = ((n1, rate1), (n2, rate2))`` -- one on the whole global batch, one on the share
    the job gave it. Two ranks; every rank keeps at least one sample.

    Why: the plain ceiling credits each rank with its rate on the whole global batch, a
    micro-batch no split gives it; a rank's rate depends on its micro-batch (issue 11), so the
    best any split of this batch can reach is this figure, balancing and synchronisation aside.
    """

    def curve(pts):
        (n1, r1), (n2, r2) = pts
        t1, t2 = n1 / r1, n2 / r2
        if n1 == n2:
            return lambda n: n * (t1 + t2) / (n1 + n2)
        beta = (t2 - t1) / (n2 - n1)
        return lambda n: t1 + beta * (n - n1)

    t0, t1 = curve(points[0]), curve(points[1])
    step, n0 = min((max(t0(n), t1(batch - n)), n) for n in range(1, batch))
    return batch / step, [n0, batch - n0]


def plain_ddp_step_times(steps: int, warmup: int) -> list:
    """Step times (s) after ``warmup`` of textbook DDP (scripts/plain_ddp.py) on the same
    model, data and equal split, 2 unthrottled ranks x 1 thread."""
    out = Path(tempfile.mkdtemp()) / "plain.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "plain_ddp.py"),
            "--steps",
            str(steps),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            str(MICRO_BATCH),
            "--out",
            str(out),
        ],
        cwd=REPO,
        check=True,
    )
    return json.loads(out.read_text())[warmup:]


def overhead_pairs(root: Path, pairs: int, steps: int, warmup: int) -> list:
    """Per pair: ``(hetseq_hpc / plain DDP lower-quartile step time, the same for medians,
    hetseq_hpc's, plain DDP's)``, both unthrottled, equal split; the order inside a pair
    alternates so that a drifting machine biases neither side."""
    half = GLOBAL_BATCH // 2
    out = []
    for i in range(pairs):

        def hetseq(i=i):
            rows = run_cli(
                root / f"unthrottled-{i}",
                "cluster.ranks=2",
                f"balance.allocation=[{half},{GLOBAL_BATCH - half}]",
                f"trainer.max_steps={steps}",
            )
            return step_times(rows, warmup)

        if i % 2:
            mine, ddp = hetseq(), plain_ddp_step_times(steps, warmup)
        else:
            ddp = plain_ddp_step_times(steps, warmup)
            mine = hetseq()
        q_mine, q_ddp = low_quartile(mine), low_quartile(ddp)
        m_mine, m_ddp = statistics.median(mine), statistics.median(ddp)
        out.append((q_mine / q_ddp, m_mine / m_ddp, q_mine, q_ddp))
        print(
            f"    pair {i + 1}/{pairs}: step time lower quartile / median: plain DDP "
            f"{q_ddp * 1000:.1f} / {m_ddp * 1000:.1f} ms, hetseq_hpc {q_mine * 1000:.1f} / "
            f"{m_mine * 1000:.1f} ms, ratio {q_mine / q_ddp:.4f} / {m_mine / m_ddp:.4f}",
            flush=True,
        )
    return out


def _cpu_model() -> str:
    from hetseq_hpc.env.hardware import _cpu_model as model

    return model()


def recovery(rows: list, at_step: int, ceiling: float) -> int | None:
    """Steps after ``at_step`` until a 4-step window's median runs at >= 0.9 of ``ceiling``."""
    after = [r for r in rows if r["step"] > at_step]
    for i in range(1, len(after) - 2):
        window = after[i - 1 : i + 3]
        if GLOBAL_BATCH / statistics.median(step_times(window, 0)) / ceiling >= 0.9:
            return window[0]["step"] - at_step
    return None


def first_move_after(rows: list, at_step: int, faster_rank: int) -> dict:
    """The re-balancer's answer to a speed change at ``at_step`` (rank ``faster_rank`` got
    faster): ``first_move_after`` (steps from the change to the first re-allocation after it,
    None if none), ``first_move_right_way`` (it gave that rank more samples) and ``reversed``
    (a later move took that rank below where it was before the change)."""
    split = {row["step"]: [r["samples"] for r in row["ranks"]] for row in rows}
    before = split.get(at_step) or (split[max(split)] if split else None)
    moves = [
        (r["reallocation"]["at_step"], r["reallocation"]["to"])
        for r in rows
        if "reallocation" in r and r["reallocation"]["at_step"] > at_step
    ]
    if not moves or before is None:
        return {"first_move_after": None, "first_move_right_way": None, "reversed": None}
    first_step, first_to = moves[0]
    return {  # a move decided after step s takes effect at s + 1
        "first_move_after": first_step - 1 - at_step,
        "first_move_right_way": first_to[faster_rank] > before[faster_rank],
        "reversed": any(to[faster_rank] < before[faster_rank] for _, to in moves),
    }


def one_round(root: Path, r: int, args, alone: dict, steps: list) -> dict:
    """One interleaved round: (a') co-running, (c) hetseq_hpc with (a'') right after it, (a')
    again, and (b) equal split last in even rounds, first in odd ones; every ratio of the round
    is taken between its own runs, the ceiling from the mean of the two (a') runs around (c)."""
    speeds = f"cluster.speeds=[1.0,{args.slow}]"
    half = GLOBAL_BATCH // 2
    got = {}

    def co(key: str = "co", batches: dict | None = None, suffix: str = ""):
        got[key] = corunning(
            root / f"round{r}",
            (1.0, args.slow),
            args.alone_steps,
            min(args.warmup, args.alone_steps // 3),
            alone,
            batches,
            suffix,
        )

    def equal():
        rows = run_cli(
            root / f"round{r}" / "equal",
            "cluster.ranks=2",
            speeds,
            f"balance.allocation=[{half},{GLOBAL_BATCH - half}]",
            f"trainer.max_steps={args.equal_steps}",
        )
        got["equal"] = throughput(rows, args.warmup)

    def auto():
        rows = run_cli(
            root / f"round{r}" / "auto",
            "cluster.ranks=2",
            speeds,
            "balance.rebalance_every=10",
            "trainer.plot=true",
            *steps,
        )
        got["auto"] = throughput(rows, args.warmup)
        got["balance_error"] = balance_error(rows, args.warmup)
        got["in_job"] = in_job_rates(rows, args.warmup)
        alloc = json.loads((root / f"round{r}" / "auto" / "allocation.json").read_text())
        got["split"] = [s["samples"] for s in alloc["allocation"]["shares"]]
        got["first_split"] = next(row["allocation"] for row in rows if "allocation" in row)
        # (a'') right after (c): the co-running rates on the shares (c) ended with
        co("co_split", batches=dict(zip((1.0, args.slow), got["split"])))

    # (a') brackets (c): once before, once after (and after (a'')), the ceiling the mean of the
    # two, so that a drift of the VM during the round cancels to first order (the same pair's
    # rates minutes apart differed by -13 % .. +21 % here); (b) alternates before and after
    order = [co, auto, lambda: co("co_after", suffix="-co_after"), equal]
    for fn in order if r % 2 == 0 else order[-1:] + order[:-1]:
        fn()
    got["drift"] = {s: got["co_after"][s] / got["co"][s] - 1 for s in (1.0, args.slow)}
    got["co"] = {s: (got["co"][s] + got["co_after"][s]) / 2 for s in (1.0, args.slow)}
    got["ceiling"] = got["co"][1.0] + got["co"][args.slow]
    got["efficiency_corunning"] = got["auto"] / got["ceiling"]
    got["ceiling_at_batch"], got["best_split"] = best_split_ceiling(
        [
            ((GLOBAL_BATCH, got["co"][s]), (n, got["co_split"][s]))
            for s, n in zip((1.0, args.slow), got["split"])
        ],
        GLOBAL_BATCH,
    )
    got["efficiency_at_batch"] = got["auto"] / got["ceiling_at_batch"]
    got["efficiency_in_job"] = got["auto"] / sum(got["in_job"])
    # how much slower each rank works inside the job than free-running beside the other (lock
    # step; at small batches also its smaller micro-batches)
    got["in_job_slowdown"] = [
        got["co"][1.0] / got["in_job"][0] - 1,
        got["co"][args.slow] / got["in_job"][1] - 1,
    ]
    got["speedup"] = got["auto"] / got["equal"]
    drift = ", ".join(f"{got['drift'][x]:+.0%}" for x in (1.0, args.slow))
    print(
        f"    round {r + 1}/{args.rounds}: co-running ceiling {got['ceiling']:.1f} (runs after "
        f"(c) vs before, per rank: {drift}), equal "
        f"{got['equal']:.1f}, hetseq_hpc {got['auto']:.1f} samples/s (split "
        f"{got['first_split']} -> {got['split']}): efficiency {got['efficiency_corunning']:.3f}"
        f", speedup {got['speedup']:.2f}x, balance error {got['balance_error']:.3f}; in-job "
        f"rates {[round(x, 1) for x in got['in_job']]} (slower than co-running: "
        f"{[f'{x:+.0%}' for x in got['in_job_slowdown']]}), efficiency in job "
        f"{got['efficiency_in_job']:.3f}; co-running on the final shares "
        f"{[round(got['co_split'][x], 1) for x in (1.0, args.slow)]} -> ceiling at this batch "
        f"{got['ceiling_at_batch']:.1f} (best split {got['best_split']}): efficiency "
        f"{got['efficiency_at_batch']:.3f}",
        flush=True,
    )
    return got


def speed_change(root: Path, args, alone: dict, ceiling: dict | None) -> dict:
    """Scenario 2: the slow rank's quota goes from ``--slow`` to ``--changed`` half-way through
    a re-balanced run of ``2 x --steps`` steps (in ``root``). ``ceiling``: the co-running
    rates of the new pair (None: measured here, right before, under the same conditions)."""
    root.mkdir(parents=True, exist_ok=True)
    speeds = f"cluster.speeds=[1.0,{args.slow}]"
    alone_warmup = min(args.warmup, args.alone_steps // 3)
    if ceiling is None:
        ceiling = corunning(root, (1.0, args.changed), args.alone_steps, alone_warmup, alone)
    change_at = args.steps // 2
    changed: dict = {}

    def maybe_change(rows):
        if not changed and len(rows) >= change_at:
            emu = json.loads((root / "run" / "logs" / "rank1.emulation.json").read_text())
            from hetseq_hpc.env.emulation import emulated_cpus, set_quota

            threads = max(1, round(emu["cpus"] / emu["speed"]))  # the rank's thread count
            set_quota(emu["control"], emulated_cpus(args.changed, threads))
            changed["step"] = rows[-1]["step"]
            changed["method"] = emu["method"]

    rows = run_cli(
        root / "run",
        "cluster.ranks=2",
        speeds,
        "balance.rebalance_every=5",
        "trainer.plot=true",
        f"trainer.max_steps={args.steps * 2}",
        on_row=maybe_change,
    )
    at = changed.get("step", 10**9)
    return {
        "changed": changed,
        "steps_to_recover": recovery(rows, at, ceiling[1.0] + ceiling[args.changed]),
        "steps_to_recover_standalone": recovery(rows, at, alone[1.0] + alone[args.changed]),
        "reallocations": [r["reallocation"] for r in rows if "reallocation" in r],
        **first_move_after(rows, at, faster_rank=1),
    }


def _brief(change: dict) -> dict:
    """The JSON figures of one :func:`speed_change` run."""
    return {
        "changed_at_step": change["changed"].get("step"),
        "steps_to_recover": change["steps_to_recover"],
        "steps_to_recover_standalone": change["steps_to_recover_standalone"],
        "first_move_after": change["first_move_after"],
        "first_move_right_way": change["first_move_right_way"],
        "reversed": change["reversed"],
        "moves": [(r["at_step"], r["to"]) for r in change["reallocations"]],
        **({"load": change["load"]} if "load" in change else {}),
    }


def change_only(root: Path, args, started: float, alone_warmup: int) -> None:
    """``--change-only``: the speed-change scenario alone, quiet and beside ``--load`` busy
    loops (each with its own standalone rates and co-running ceiling, measured under the same
    conditions right before it); prints the summary and the JSON line."""
    out = {}
    for tag, load in (("quiet", 0), ("loaded", args.load)):
        if tag == "loaded" and not load:
            out[tag] = None
            continue
        with BusyLoad(load) as busy:
            alone = {
                speed: throughput(
                    run_cli(
                        root / tag / f"alone-{speed}",
                        "cluster.ranks=1",
                        f"cluster.speeds=[{speed}]",
                        f"trainer.max_steps={args.alone_steps}",
                    ),
                    alone_warmup,
                )
                for speed in (1.0, args.changed)
            }
            change = speed_change(root / tag, args, alone, None)
        out[tag] = {**_brief(change), "load": busy.summary()}
        print(f"[{tag}] speed change {args.slow} -> {args.changed}: {out[tag]}", flush=True)
    result = {
        **out,
        "global_batch": GLOBAL_BATCH,
        "machine": f"{os.cpu_count()} CPU {_cpu_model()}",
        "wall_s": round(time.time() - started, 1),
        "runs": str(root),
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--global-batch", type=int, default=128, help="global batch, every scenario"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=32,
        help="micro-batch cap, every scenario (larger ones run slower per sample on CPU)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of (a') co-running, (b) equal, (c) hetseq_hpc",
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per (c) run")
    parser.add_argument("--equal-steps", type=int, default=16, help="steps per (b) run")
    parser.add_argument("--alone-steps", type=int, default=12, help="steps per standalone run")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--pairs", type=int, default=8, help="interleaved DDP/hetseq_hpc pairs (d)")
    parser.add_argument("--pair-steps", type=int, default=40, help="steps per run in (d)")
    parser.add_argument("--slow", type=float, default=0.35, help="speed of the slow rank")
    parser.add_argument(
        "--changed", type=float, default=0.7, help="slow rank's speed after the change"
    )
    parser.add_argument(
        "--load",
        type=int,
        default=6,
        help="busy loops beside a second speed-change run (0: the quiet one only)",
    )
    parser.add_argument(
        "--change-only",
        action="store_true",
        help="run only the speed-change scenario (quiet and --load), not (a)-(d)",
    )
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()
    if args.load < 0:
        parser.error(f"--load {args.load}: give 0 (quiet only) or more busy loops")
    global GLOBAL_BATCH, MICRO_BATCH
    GLOBAL_BATCH, MICRO_BATCH = args.global_batch, args.micro_batch
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    steps = [f"trainer.max_steps={args.steps}"]
    started = time.time()
    alone_warmup = min(args.warmup, args.alone_steps // 3)
    speeds = f"cluster.speeds=[1.0,{args.slow}]"

    # (a) standalone throughput at each speed
    alone = {}
    if args.change_only:
        change_only(root, args, started, alone_warmup)
        return
    for speed in (1.0, args.slow, args.changed):
        rows = run_cli(
            root / f"alone-{speed}",
            "cluster.ranks=1",
            f"cluster.speeds=[{speed}]",
            f"trainer.max_steps={args.alone_steps}",
        )
        alone[speed] = throughput(rows, alone_warmup)
    ideal = alone[1.0] + alone[args.slow]
    # (a') co-running ceiling, (b) equal split, (c) hetseq_hpc: interleaved rounds
    print(f"(a'), (b), (c) in {args.rounds} interleaved rounds ...", flush=True)
    rounds = [one_round(root, r, args, alone, steps) for r in range(args.rounds)]

    def med(key):
        return statistics.median(g[key] for g in rounds)

    thr_auto, thr_equal, ceiling = med("auto"), med("equal"), med("ceiling")
    co = {s: statistics.median(g["co"][s] for g in rounds) for s in (1.0, args.slow)}
    co_changed = corunning(root, (1.0, args.changed), args.alone_steps, alone_warmup, alone)
    # the planner's prediction for (c), from the median round's allocation.json (its curves)
    mid = sorted(range(len(rounds)), key=lambda r: rounds[r]["auto"])[len(rounds) // 2]
    probe = root / f"round{mid}" / "auto" / "allocation.json"
    plan_out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetseq_hpc.plan",
            "cluster.ranks=2",
            speeds,
            f"trainer.global_batch_size={GLOBAL_BATCH}",
            f"balance.max_micro_batch={MICRO_BATCH}",
            f"plan.probe={probe}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    predicted = None
    if plan_out.returncode == 0:
        predicted = json.loads(plan_out.stdout.strip().splitlines()[-1])["predicted_samples_per_s"]
    else:
        print(f"planner failed: {plan_out.stderr.strip()[-500:]}", file=sys.stderr)
    alloc = json.loads(probe.read_text())

    # (d) plain DDP vs hetseq_hpc, both unthrottled, equal split, interleaved pairs
    print(f"(d) {args.pairs} interleaved pairs of {args.pair_steps} steps ...", flush=True)
    pairs = overhead_pairs(root, args.pairs, args.pair_steps, args.warmup)
    ratios = sorted(q for q, _, _, _ in pairs)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3

    # scenario 2: the slow rank's quota changes mid-run, quiet and (--load) beside busy loops
    change = speed_change(root / "change", args, alone, co_changed)
    loaded = None
    if args.load:
        with BusyLoad(args.load) as busy:
            loaded = speed_change(root / "change-loaded", args, alone, None)
        loaded["load"] = busy.summary()
    recovered, recovered_alone = change["steps_to_recover"], change["steps_to_recover_standalone"]
    reallocs, changed = change["reallocations"], change["changed"]

    result = {
        "efficiency_equal": thr_equal / ideal,
        "efficiency_balanced": thr_auto / ideal,
        "efficiency_corunning": med("efficiency_corunning"),
        "efficiency_corunning_rounds": [round(g["efficiency_corunning"], 4) for g in rounds],
        "efficiency_equal_corunning": statistics.median(g["equal"] / g["ceiling"] for g in rounds),
        "ceiling_drift_rounds": [
            [round(g["drift"][x], 4) for x in (1.0, args.slow)] for g in rounds
        ],
        "efficiency_at_batch": med("efficiency_at_batch"),
        "efficiency_at_batch_rounds": [round(g["efficiency_at_batch"], 4) for g in rounds],
        "ceiling_at_batch": med("ceiling_at_batch"),
        "best_splits": [g["best_split"] for g in rounds],
        "efficiency_in_job": med("efficiency_in_job"),
        "efficiency_in_job_rounds": [round(g["efficiency_in_job"], 4) for g in rounds],
        "in_job_slowdown": [
            round(statistics.median(g["in_job_slowdown"][i] for g in rounds), 4) for i in (0, 1)
        ],
        "balance_error": med("balance_error"),
        "speedup": med("speedup"),
        "speedup_rounds": [round(g["speedup"], 3) for g in rounds],
        "splits": [[g["first_split"], g["split"]] for g in rounds],
        "overhead_vs_ddp": statistics.median(ratios) - 1,
        "overhead_iqr": [quartiles[0] - 1, quartiles[2] - 1],
        "overhead_pairs": [round(q - 1, 4) for q, _, _, _ in pairs],
        "overhead_vs_ddp_median_step": statistics.median(m for _, m, _, _ in pairs) - 1,
        "steps_to_recover": recovered,
        "steps_to_recover_standalone": recovered_alone,
        "speed_change": {"quiet": _brief(change), "loaded": _brief(loaded) if loaded else None},
        "planner_error": (predicted / thr_auto - 1) if predicted else None,
        "global_batch": GLOBAL_BATCH,
        "rounds": args.rounds,
        "standalone_sum": ideal,
        "corunning_ceiling": ceiling,
        "machine": f"{os.cpu_count()} CPU {_cpu_model()}",
        "emulation": alloc["ranks"][1].get("emulation", {}).get("method"),
    }
    half = GLOBAL_BATCH // 2
    line = "-" * 72
    print(line)
    print(
        f"hetseq_hpc heterogeneous benchmark: BERT default model, global batch {GLOBAL_BATCH}, "
        f"{args.rounds} rounds, medians after {args.warmup} steps; {result['machine']}"
    )
    print(line)
    print(f"(a) standalone   speed 1.00: {alone[1.0]:7.1f} samples/s   co-running {co[1.0]:7.1f}")
    print(
        f"                 speed {args.slow:.2f}: {alone[args.slow]:7.1f} samples/s   co-running "
        f"{co[args.slow]:7.1f}"
    )
    print(
        f"                 sum standalone {ideal:7.1f}, co-running ceiling {ceiling:7.1f} "
        "(median of rounds)"
    )
    print(
        f"(b) equal split  {half}/{GLOBAL_BATCH - half}:       {thr_equal:7.1f} samples/s   "
        f"efficiency {result['efficiency_equal']:.3f} (co-running "
        f"{result['efficiency_equal_corunning']:.3f})"
    )
    print(
        f"(c) hetseq_hpc   splits {result['splits']} (first -> final per round): "
        f"{thr_auto:7.1f} samples/s   efficiency {result['efficiency_balanced']:.3f} "
        f"(co-running {result['efficiency_corunning']:.3f}, rounds "
        f"{result['efficiency_corunning_rounds']})   speedup {result['speedup']:.2f}x   "
        f"balance error {result['balance_error']:.3f}"
    )
    print(
        f"    against the co-running ceiling AT this global batch (each rank's co-running "
        f"rate on its final share and on the whole batch, best integer split "
        f"{result['best_splits']}): {result['ceiling_at_batch']:.1f} samples/s, efficiency "
        f"{result['efficiency_at_batch']:.3f} (rounds {result['efficiency_at_batch_rounds']})"
    )
    print(
        f"    against the ranks' own in-job rates (no waiting, no sync): efficiency "
        f"{result['efficiency_in_job']:.3f} (rounds {result['efficiency_in_job_rounds']}); "
        f"in lock-step the ranks computed {result['in_job_slowdown'][0]:+.1%} / "
        f"{result['in_job_slowdown'][1]:+.1%} slower per sample than co-running free"
    )
    if predicted:
        print(
            f"    planner predicted {predicted:7.1f} samples/s for (c): "
            f"{result['planner_error']:+.1%} off the measurement"
        )
    print(
        f"(d) unthrottled  hetseq_hpc / plain DDP step time (lower quartile) over {args.pairs} "
        f"pairs: median {result['overhead_vs_ddp']:+.3f}, quartiles "
        f"{result['overhead_iqr'][0]:+.3f} .. {result['overhead_iqr'][1]:+.3f}, pairs "
        f"{result['overhead_pairs']}; by median step time "
        f"{result['overhead_vs_ddp_median_step']:+.3f}"
    )
    print(
        f"scenario 2: slow rank {args.slow} -> {args.changed} at step {changed.get('step')} "
        f"({changed.get('method')}); re-allocations {[(r['at_step'], r['to']) for r in reallocs]}; "
        f"back above 0.9 after {recovered} steps (co-running ceiling), {recovered_alone} "
        "(standalone sum)"
    )
    print(
        f"runs in {root}; plots {probe.parent / 'ranks.png'}, {root / 'change' / 'run' / 'ranks.png'}; "
        f"{time.time() - started:.0f} s"
    )
    print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
