#!/usr/bin/env python3
"""Chaos soak: one local job, faults injected at random every few steps, restarts on.

Issue 45. One run of ``--ranks`` local ranks (small BERT, dropout off, a seed) with
``trainer.elastic.restarts``; every few steps (seeded) one fault: ``kill9`` (any rank),
``sigstop`` (past the elastic timeout, then SIGCONT: left out, it stops without writing and is
replaced), ``checkpoint``, ``validation`` (a kill during either), ``reform`` (a second kill
while the survivors re-form), ``join`` (a newcomer killed while admitted), ``two`` (two at
once). The survivors train on while a replacement starts, so after the last fault the launcher
gets SIGTERM (exit 130) and an uninterrupted run of the same schedule trains to the same step.
Checked: every step's loss (within 1e-6, or within the drift of an uninterrupted run on one rank
fewer: fp32 summation order alone), every step once in metrics.jsonl, the newest checkpoint,
the fence audit (stamped records only), no worker left.

    python scripts/chaos_soak.py --faults 100

Last line: one JSON object (``faults``, ``survived``, ``max_rel_loss_diff``, ``missing_steps``,
``repeated_steps``, ``orphans``, medians, the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.fence_audit import writes_after_fence  # noqa: E402
from tests.helpers.runs import (  # noqa: E402
    SMALL_MODEL,
    cli_env,
    processes,
    read_rows,
    worker_pids,
)

#: the fault kinds and how many faults each injects
KINDS = {
    "kill9": 1,
    "sigstop": 1,
    "checkpoint": 1,
    "validation": 1,
    "reform": 2,
    "join": 2,
    "two": 2,
}
#: the learning-rate schedule's length for both runs (neither reaches it)
SCHEDULE_STEPS = 100_000
COMMON = [
    *SMALL_MODEL,
    f"optim.schedule_steps={SCHEDULE_STEPS}",
    "task.model.max_seq_len=32",
    "task.model.dropout=0.0",
    "trainer.seed=45",
    "trainer.val_every=7",
    "trainer.checkpoint_every=5",
    "trainer.plot=false",
]
TOL = 1e-6


# ------------------------------------------------------------------ the checks (unit-tested)
def schedule(seed: int, faults: int, every: Sequence[int], kinds: Sequence[str]) -> List[tuple]:
    """``[(steps after the last recovery, kind), ...]`` until ``faults`` faults are planned
    (a kind counts :data:`KINDS` faults); the same for the same arguments."""
    rng = random.Random(seed)
    plan, planned = [], 0
    while planned < faults:
        kind = rng.choice(list(kinds))
        plan.append((rng.randint(every[0], every[1]), kind))
        planned += KINDS[kind]
    return plan


def step_counts(rows: Sequence[Dict[str, Any]]) -> Dict[int, int]:
    """step -> how many training rows (rows with a ``loss``, not events) metrics.jsonl has."""
    counts: Dict[int, int] = {}
    for row in rows:
        if "loss" in row and row.get("event") is None:
            counts[int(row["step"])] = counts.get(int(row["step"]), 0) + 1
    return counts


def missing_and_repeated(counts: Dict[int, int], steps: int) -> tuple:
    """``(missing, repeated)`` steps of 1..``steps`` in ``counts`` (:func:`step_counts`)."""
    missing = [s for s in range(1, steps + 1) if counts.get(s, 0) == 0]
    repeated = sorted(s for s, n in counts.items() if n > 1)
    return missing, repeated


def max_rel_diff(reference: Dict[int, float], got: Dict[int, float]) -> Optional[float]:
    """The largest relative loss difference over the steps both have, or None."""
    both = [s for s in reference if s in got]
    return max((abs(got[s] - reference[s]) / abs(reference[s]) for s in both), default=None)


def within_drift(rel: Optional[float], control: Optional[float]) -> bool:
    """Whether the faulted run's largest relative loss difference ``rel`` is within
    :data:`TOL`, or no larger than ``control``'s: an uninterrupted run on another split,
    which differs from the reference by fp32 summation order alone (it grows over thousands
    of steps). None (nothing compared, no control) is not within."""
    if rel is None:
        return False
    return rel <= TOL or (control is not None and rel <= control)


# ------------------------------------------------------------------ the run
def _losses(run_dir: Path) -> Dict[int, float]:
    return {
        int(r["step"]): float(r["loss"])
        for r in read_rows(run_dir)
        if "loss" in r and r.get("event") is None
    }


def _start(run_dir: Path, cache: Path, steps: int, *extra: str) -> subprocess.Popen:
    """Start the launcher; its output (and its ranks': they inherit it) goes to
    ``<run_dir>.out``, a file: a pipe nobody reads while the soak waits fills up (64 KiB), and
    every process writing a log line to it then blocks -- the job hangs."""
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        *COMMON,
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    with _output(run_dir).open("w") as out:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=cli_env(cache),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def _output(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".out")


def _tail(run_dir: Path, chars: int = 3000) -> str:
    path = _output(run_dir)
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


class Soak:
    """The faulted run: waits, injections and what each fault cost."""

    def __init__(self, run_dir: Path, proc: subprocess.Popen, ranks: int, timeout_s: float):
        self.run_dir, self.proc, self.ranks, self.timeout_s = run_dir, proc, ranks, timeout_s
        self.rng = random.Random(0)
        self.records: List[Dict[str, Any]] = []
        self.left_out: List[tuple] = []  # (rank, time_ns it came back)
        self.killed: set = set()  # pids killed: gone, even while the kernel still tears one down

    def rows(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        return sum('"loss"' in line for line in path.read_text().splitlines())

    def wait(self, what: str, ready: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run ended before {what} (exit {self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:g} s")
            time.sleep(0.02)

    def live(self) -> Dict[int, int]:
        """rank -> pid of the live workers, leaving out those this soak killed."""
        pids = worker_pids(self.run_dir, live=True)
        return {rank: pid for rank, pid in pids.items() if pid not in self.killed}

    def members(self) -> set:
        """The member ids of the live worker processes (a replacement's from its environment)."""
        run = str(self.run_dir).encode()
        return {
            int(env.get(b"HETSEQ_MEMBER", env[b"RANK"]))
            for pid, argv, env, state in processes()
            if b"hetseq_hpc.worker" in argv
            and b"RANK" in env
            and run in b" ".join(argv)
            and state not in ("Z", "T")
            and pid not in self.killed
        }

    def whole(self) -> bool:
        """The newest membership row names exactly the live processes' members, all
        ``ranks`` of them, and a step was trained since: not merely three processes up (a
        left-out rank may still be on its way out, the survivors' row not yet written)."""
        live = self.members()
        if len(live) < self.ranks:
            return False
        rows = read_rows(self.run_dir) if (self.run_dir / "metrics.jsonl").exists() else []
        last_event = max(
            (i for i, r in enumerate(rows) if r.get("event") == "membership"), default=-1
        )
        joined = [r for r in rows[last_event + 1 :] if "loss" in r and r.get("event") is None]
        members = (
            set(rows[last_event].get("members", ())) if last_event >= 0 else set(range(self.ranks))
        )
        return members == live and len(joined) >= 1

    def kill(self, rank: Optional[int] = None, sig: int = signal.SIGKILL) -> int:
        pids = self.live()
        rank = self.rng.choice(sorted(pids)) if rank is None else rank
        self.killed.add(pids[rank])
        os.kill(pids[rank], sig)
        return rank

    def cli_says(self, text: str, more_than: int = 0) -> bool:
        """Whether cli.log says ``text`` more than ``more_than`` times."""
        return self.cli_count(text) > more_than

    def cli_count(self, text: str) -> int:
        path = self.run_dir / "cli.log"
        return path.read_text(errors="replace").count(text) if path.is_file() else 0

    def dump_stacks(self) -> Optional[Path]:
        """On a hang: every live process's Python stacks (launcher and ranks) into
        ``stacks.txt`` beside the run directory, with py-spy where it is installed."""
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.is_file():
            return None
        out = self.run_dir.parent / "stacks.txt"
        with out.open("w") as f:
            pids = {"launcher": self.proc.pid, **{f"rank {r}": p for r, p in self.live().items()}}
            for who, pid in pids.items():
                f.write(f"==== {who} (pid {pid})\n")
                f.flush()
                subprocess.run(
                    [str(spy), "dump", "--pid", str(pid)], stdout=f, stderr=f, timeout=60
                )
        return out

    def inject(self, kind: str) -> Dict[str, Any]:
        """One fault of ``kind``; returns what was done (ranks, seconds to the next step)."""
        at, t0 = self.rows(), time.monotonic()
        record: Dict[str, Any] = {"kind": kind, "step": at}
        if kind == "kill9":
            record["ranks"] = [self.kill()]
        elif kind == "sigstop":
            pids = self.live()
            rank = self.rng.choice(sorted(r for r in pids if r != 0) or sorted(pids))
            said = f"rank {rank} was left out by the others"
            before = self.cli_count(said)
            os.kill(pids[rank], signal.SIGSTOP)
            self.wait(f"rank {rank} left out", lambda: self.cli_says(said, before), 120)
            with_ns = time.time_ns()
            os.kill(pids[rank], signal.SIGCONT)
            self.left_out.append((rank, with_ns))
            record["ranks"] = [rank]
        elif kind == "checkpoint":  # rank 0 writes it: killed once a temporary file appears
            ckpt = self.run_dir / "checkpoints"
            self.wait(
                "a checkpoint write",
                lambda: (
                    any(p.name.endswith(".tmp") for p in ckpt.glob("*")) or self.rows() > at + 6
                ),
                120,
            )
            record["ranks"] = [self.kill(0)]
        elif kind == "validation":  # right after a step row of a validation step (val_every 7)
            self.wait("a validation step", lambda: self.rows() % 7 == 0 and self.rows() > at, 120)
            record["ranks"] = [self.kill()]
        elif kind == "reform":
            first = self.kill()
            time.sleep(self.timeout_s / 2 + self.rng.uniform(0.0, 1.0))  # while they re-form
            record["ranks"] = [first, self.kill()]
        elif kind == "join":
            pids = self.live()
            first = self.rng.choice(sorted(pids))
            said = f"rank {first} was lost"
            before = self.cli_count(said)
            self.kill(first)
            self.wait("a restart", lambda: self.cli_says(said, before), 120)
            # the newcomer, once it runs and asks to join
            self.wait("the newcomer", lambda: first in self.live(), 120)
            time.sleep(self.rng.uniform(0.5, 3.0))
            record["ranks"] = [first, self.kill(first)]
        elif kind == "two":
            pids = self.live()
            pair = self.rng.sample(sorted(pids), 2)
            for rank in pair:
                self.killed.add(pids[rank])
                os.kill(pids[rank], signal.SIGKILL)
            record["ranks"] = pair
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.wait("the next step", lambda: self.rows() > at, 300)
        record["to_next_step_s"] = round(time.monotonic() - t0, 2)
        self.wait("the whole world back", self.whole, 300)
        record["to_whole_s"] = round(time.monotonic() - t0, 2)
        return record


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=100, help="faults to inject (100)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--every", default="3,6", help="steps between faults, min,max (3,6)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, comma-separated")
    parser.add_argument("--timeout-s", type=float, default=6.0, help="trainer.elastic.timeout_s")
    parser.add_argument("--max-minutes", type=float, default=90.0, help="stop injecting after")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=24,
        help="trainer.global_batch_size (24); larger: slower steps, fewer of them between "
        "faults (fp32 losses of two splits drift apart over thousands of steps)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    every = [int(x) for x in args.every.split(",")]
    if args.ranks < 3 or any(k not in KINDS for k in kinds) or len(every) != 2:
        parser.error(f"use --ranks >= 3, --kinds of {list(KINDS)}, --every MIN,MAX")
    plan = schedule(args.seed, args.faults, every, kinds)
    root = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    cache = root / "cache"
    extra = [
        f"cluster.ranks={args.ranks}",
        f"trainer.global_batch_size={args.global_batch}",
        f"trainer.elastic.timeout_s={args.timeout_s:g}",
        f"trainer.elastic.restarts={args.faults * 2}",
    ]
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; {len(plan)} faults planned; runs under {root}",
        flush=True,
    )
    run_dir = root / "soak"
    started = time.monotonic()
    proc = _start(run_dir, cache, SCHEDULE_STEPS - 1, *extra)
    soak = Soak(run_dir, proc, args.ranks, args.timeout_s)
    soak.rng = random.Random(args.seed + 1)
    error = None
    try:
        soak.wait("the first steps", lambda: soak.rows() >= 2, 300)
        for index, (gap, kind) in enumerate(plan):
            if time.monotonic() - started > args.max_minutes * 60:
                print(f"--max-minutes reached after {index} faults", flush=True)
                break
            target = soak.rows() + gap
            soak.wait(f"step {target}", lambda t=target: soak.rows() >= t, 300)
            record = soak.inject(kind)
            soak.records.append(record)
            print(json.dumps({"fault": index, **record}), flush=True)
        target = soak.rows() + 3
        soak.wait(f"step {target}", lambda: soak.rows() >= target, 300)
        os.kill(proc.pid, signal.SIGTERM)  # the ranks checkpoint after their step and stop
        proc.wait(timeout=300)
    except Exception as exc:  # a hang or a run that ended: counted, the run is stopped
        error = str(exc)
        print(f"chaos_soak: {error}", flush=True)
        if proc.poll() is None:
            stacks = soak.dump_stacks()
            if stacks is not None:
                print(f"chaos_soak: the processes' stacks are in {stacks}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = read_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    steps = max(step_counts(rows), default=0)
    ref = root / "reference"
    reference: Dict[int, float] = {}
    if steps:
        ref_proc = _start(ref, cache, steps, *extra)
        if ref_proc.wait() != 0:
            print(_tail(ref), file=sys.stderr)
            print("chaos_soak: error: the uninterrupted run failed", file=sys.stderr)
            return 1
        reference = _losses(ref)
    orphans = sorted(worker_pids(run_dir, live=True).values())
    for pid in orphans:  # counted above; the ranks have a process group of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    missing, repeated = missing_and_repeated(step_counts(rows), steps)
    rel = max_rel_diff(reference, _losses(run_dir))
    control = None
    if rel is not None and rel > TOL:
        # fp32 losses of two splits drift apart over thousands of steps (summation order):
        # an uninterrupted run on one rank fewer measures how far, with no fault at all
        control_dir = root / "control"
        control_extra = [*extra, f"cluster.ranks={args.ranks - 1}"]
        if _start(control_dir, cache, steps, *control_extra).wait() == 0:
            control = max_rel_diff(reference, _losses(control_dir))
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    checkpoint_ok: Any = None
    if newest:
        from hetseq_hpc.train.checkpoint.manager import load_checkpoint

        try:
            load_checkpoint(newest[-1])
            checkpoint_ok = newest[-1].name
        except Exception as exc:  # reported, not raised
            checkpoint_ok = f"FAILED: {exc}"
    # stamped rows, events and checkpoints only: the replacement writes the same log file
    fenced = sum(
        len([w for w in writes_after_fence(run_dir, rank, since) if not w.startswith("logs/")])
        for rank, since in soak.left_out
    )
    joins = [r.get("join_s") for r in rows if r.get("event") == "membership" and r.get("joined")]
    faults = sum(KINDS[r["kind"]] for r in soak.records)
    survived_all = (
        error is None
        and proc.returncode == 130  # stopped by the SIGTERM above, after its checkpoint
        and not missing
        and not repeated
        and rel is not None
        and within_drift(rel, control)
        and not orphans
        and fenced == 0
    )
    counts: Dict[str, int] = {}
    for r in soak.records:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    summary = {
        "faults": faults,
        "survived": faults if survived_all else 0,
        "max_rel_loss_diff": rel,
        "control_max_rel_loss_diff": control,
        "missing_steps": missing,
        "repeated_steps": repeated,
        "orphans": orphans,
        "writes_after_fence": fenced,
        "newest_checkpoint": checkpoint_ok,
        "exit": proc.returncode,
        "error": error,
        "fault_to_step_s_median": statistics.median([r["to_next_step_s"] for r in soak.records])
        if soak.records
        else None,
        "join_s_median": statistics.median([j for j in joins if j is not None])
        if any(j is not None for j in joins)
        else None,
        "kinds": counts,
        "steps": steps,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "load": os.getloadavg()},
    }
    if not survived_all:
        print(_tail(run_dir), file=sys.stderr)
    if survived_all and not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary))
    return 0 if survived_all else 1


if __name__ == "__main__":
    sys.exit(main())
