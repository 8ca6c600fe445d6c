#!/usr/bin/env python3
"""Partition drills: cut a non-master rank off mid-run, N times, and check nothing split.

Each drill starts a real run (3 ranks, a small BERT, ``trainer.elastic``), cuts rank 1 or 2 off
at a random step, lets it come back once the others re-formed without it, and checks that the
survivors kept the uninterrupted run's losses and that the rank wrote nothing into the run
directory after the re-form (file by file: tests/helpers/fence_audit.py).

    python scripts/partition_drills.py                  # 10 drills, --mode sigstop
    python scripts/partition_drills.py --mode netns     # a namespaced test cluster of its own
    python scripts/partition_drills.py --mode netns --cut master --down-s 30

``--mode sigstop``: a SIGSTOP of the rank stands in for the cut, a SIGCONT for the return.
``--mode netns``: ``scripts/test-cluster.sh link nX down|up`` on the rank's node, back once the
others went on (``--down-s``: later), on a cluster with Slurm's default ``SlurmdTimeout`` of
300 s (a longer cut is a node failure: the job is requeued and resumes from its checkpoint).
``--cut master``: rank 0's node, the batch host with the job's store, is cut instead (rank 0
goes on; ranks 1 and 2 are audited; the newest checkpoint must verify). Last line: one JSON
object with ``runs``, ``survived``, ``writes_after_fence`` (must be 0), ``max_rel_loss_diff``.
Slurm's capture of a rank's stderr and submitit's result (in ``submitit/``) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetseq_hpc.errors import CheckpointError  # noqa: E402
from hetseq_hpc.launch.template import PR_SET_PDEATHSIG, libc_prctl  # noqa: E402
from hetseq_hpc.rundir.paths import RunDir  # noqa: E402
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, verified_run_id  # noqa: E402
from tests.helpers.fence_audit import writes_after_fence  # noqa: E402
from tests.helpers.runs import SMALL_MODEL, cli_env, losses, step_rows, worker_pids  # noqa: E402

#: where each mode's runs go: 3 local ranks, or the test cluster's het job (a100 x 1 + v100 x 2)
RUNS = {
    "sigstop": ["cluster.ranks=3"],
    "netns": ["cluster=testcluster", "cluster.wait=true"],
}
COMMON = [
    *SMALL_MODEL,
    "task.model.max_seq_len=32",
    "task.model.dropout=0.0",
    "trainer.global_batch_size=24",
    "trainer.seed=5",
    "trainer.val_every=0",
    "trainer.checkpoint_every=4",
]
TOL = 1e-6


#: the launchers this script started that may still run: killed when it ends, however it ends
_LIVE: Set[subprocess.Popen] = set()


#: libc's prctl, looked up here once (a preexec_fn must not run ldconfig between fork and exec)
_PRCTL = libc_prctl()
_SCRIPT_PID = os.getpid()


def _dies_with_this_script() -> None:
    """In the launcher before it execs: SIGTERM when this script dies (even by SIGKILL), which
    the launcher turns into stopping its ranks; its own session keeps it out of a Ctrl-C."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != _SCRIPT_PID:  # the script died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def _kill_live() -> None:
    """SIGKILL every launcher still running (its ranks follow: their parent-death signal)."""
    for proc in list(_LIVE):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _LIVE.discard(proc)


def _start(
    run_dir: Path, cache: Path, steps: int, *extra: str, env: Optional[Dict[str, str]] = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        *COMMON,
        f"trainer.max_steps={steps}",
        f"optim.schedule_steps={steps}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(cli_env(cache), **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_dies_with_this_script,
    )
    _LIVE.add(proc)
    return proc


def _wait(what: str, ready, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before {what} (exit {proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.05)


def _said(path: Path, text: str) -> bool:
    return path.is_file() and text in path.read_text(encoding="utf-8", errors="replace")


def _end(proc: subprocess.Popen, timeout_s: float = 600.0) -> str:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out + err


class SigStop:
    """The cut is a SIGSTOP of the rank's process; the link back, a SIGCONT."""

    name = "sigstop"

    def __init__(self, run_dir: Path, rank: int):
        self.pid = worker_pids(run_dir)[rank]

    def down(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def up(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


SCRIPT = REPO / "scripts" / "test-cluster.sh"


def netns_unavailable() -> Optional[str]:
    """Why ``--mode netns`` cannot run here, or None."""
    text = SCRIPT.read_text(encoding="utf-8", errors="replace") if SCRIPT.is_file() else ""
    if "link NODE down|up" not in text:
        return (
            "--mode netns is not available yet: scripts/test-cluster.sh has no "
            "`link nX down|up` (the namespaced test cluster, issue 46); use --mode sigstop"
        )
    if shutil.which("sbatch") is None or os.geteuid() != 0:
        return "--mode netns needs root and Slurm (scripts/test-cluster.sh); use --mode sigstop"
    return None


class NetnsCluster:
    """A test cluster of its own in network-namespace mode (scripts/test-cluster.sh), for the
    drills' Slurm runs; ``link(node, "down"|"up")`` cuts or restores a node's link."""

    def __init__(self, slurmd_timeout_s: int = 300) -> None:
        self.state = tempfile.mkdtemp(prefix="hsq-")  # short: slurmstepd's socket path
        self.env = dict(
            os.environ,
            HETSEQ_TESTCLUSTER_DIR=self.state,
            HETSEQ_TESTCLUSTER_NETNS="1",
            HETSEQ_TESTCLUSTER_SLURMD_TIMEOUT=str(slurmd_timeout_s),
        )
        self.conf = ""

    def start(self) -> None:
        done = subprocess.run(
            [str(SCRIPT), "start"], env=self.env, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"the netns test cluster did not start: {done.stderr[-2000:]}")
        self.conf = done.stdout.strip().splitlines()[-1].split("=", 1)[1]

    def link(self, node: str, how: str) -> None:
        done = subprocess.run(
            [str(SCRIPT), "link", node, how], env=self.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"link {node} {how} failed: {done.stderr.strip()[-500:]}")

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "stop"], env=self.env, capture_output=True, text=True)
        shutil.rmtree(self.state, ignore_errors=True)


class LinkDown:
    """The cut is the rank's node's link set down (scripts/test-cluster.sh link NODE down);
    the link back, ``up``, ``down_s`` seconds after the cut."""

    name = "netns"

    def __init__(self, cluster: NetnsCluster, run_dir: Path, rank: int):
        ranks = json.loads((run_dir / "allocation.json").read_text())["ranks"]
        self.node, self.cluster = ranks[rank]["node"], cluster
        if rank != 0 and self.node == ranks[0]["node"]:
            raise RuntimeError(f"rank {rank} shares rank 0's node {self.node}: not a drill")

    def down(self) -> None:
        self.cluster.link(self.node, "down")

    def up(self) -> None:
        self.cluster.link(self.node, "up")


def _lost(run_dir: Path, rank: int) -> bool:
    """Whether a membership row of ``run_dir`` says the others went on without ``rank``."""
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return False
    return any(
        r.get("event") == "membership" and rank in [x["rank"] for x in r["lost"]] for r in rows
    )


def _newest_verifies(run_dir: Path) -> bool:
    """Whether the run directory's newest checkpoint verifies (checksum, run id)."""
    try:
        kept = CheckpointManager(RunDir(run_dir)).list()
        return bool(kept) and bool(verified_run_id(kept[-1]))
    except (CheckpointError, OSError):
        return False


def drill(
    index: int,
    args: argparse.Namespace,
    reference: Dict[int, float],
    cache: Path,
    root: Path,
    cluster: Optional[NetnsCluster] = None,
) -> Dict[str, Any]:
    """One drill: start, cut rank ``victim`` at step ``at``, bring it back once it was left
    out, let the run end; what happened."""
    rng = random.Random(args.seed * 1000 + index)
    # netns: the survivors must still train when the link comes back (--down-s after the cut)
    at = rng.randint(2, args.steps - 6 if cluster is None else max(3, args.steps // 4))
    victim = rng.randint(1, 2)
    master = args.cut == "master"
    # --cut master: rank 0's node, the batch host with the job's store, is cut off from the
    # others; rank 0 keeps the store, so the others are the ones left out (and audited)
    audited = [1, 2] if master else [victim]
    run_dir = root / f"drill{index}"
    started = time.monotonic()
    where = RUNS[args.mode]
    env = {"SLURM_CONF": cluster.conf} if cluster is not None else None
    proc = _start(run_dir, cache, args.steps, *where, *args.extra, env=env)
    result: Dict[str, Any] = {"drill": index, "step": at, "rank": 0 if master else victim}
    try:
        _wait(f"step {at}", lambda: step_rows(run_dir) >= at, proc)
        if cluster is not None:
            cut: Any = LinkDown(cluster, run_dir, 0 if master else victim)
            result["node"] = cut.node
        else:
            cut = SigStop(run_dir, victim)
        cut.down()
        cut_ns = time.time_ns()
        if cluster is None:  # the launcher's word, at once (it kills a stopped rank later)
            cli_log = run_dir / "cli.log"
            _wait(
                f"rank {victim} left out",
                lambda: _said(cli_log, f"rank {victim} was left out by the others"),
                proc,
            )
        else:  # the survivors' membership row, then the link stays down --down-s in all
            _wait(
                f"rank(s) {audited} left out",
                lambda: all(_lost(run_dir, r) for r in audited),
                proc,
            )
            time.sleep(max(0.0, args.down_s - (time.time_ns() - cut_ns) / 1e9))
        came_back = time.time_ns()
        cut.up()
        out = _end(proc)
    except Exception as exc:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        result.update(exit=None, error=str(exc), survived=False)
        return result
    got = losses(run_dir) if (run_dir / "metrics.jsonl").is_file() else {}
    # a Slurm job that ended a rank still cut off may be requeued: then it did not survive
    # in-job, and a new process of that rank writes its log (not the fenced one)
    rank0_log = run_dir / "logs" / "rank0.log"
    starts = (
        rank0_log.read_text(errors="replace").count("joining tcp://") if rank0_log.is_file() else 0
    )
    complete = sorted(got) == list(range(1, args.steps + 1))
    rel = max((abs(got[s] - reference[s]) / abs(reference[s]) for s in got), default=None)
    if cluster is not None:  # the rank's stderr is its Slurm task's log
        out += "".join(
            p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.err")
        )
    said = [
        line
        for line in out.splitlines()
        for r in audited
        if f"rank {r} was left out: the others" in line
        or f"rank {r} cannot reach the job's store" in line
    ]
    # a SIGSTOPped rank writes nothing until it comes back; a cut-off one computes on, and
    # no write of it is allowed once its lease (stale_s / 2, from before the cut) ran out
    since = came_back if cluster is None else cut_ns + int(args.timeout_s / 4 * 1e9)
    fenced = [w for r in audited for w in writes_after_fence(run_dir, r, since)]
    # not the run's records: Slurm's capture of the task's stdout/stderr (its one line) and
    # submitit's result of the task, which the Slurm launcher reads (listed, not counted)
    scheduler = sorted(
        p.name
        for r in audited
        for p in (run_dir / "submitit").glob(f"*_{r}_*")
        if p.stat().st_mtime_ns >= since
    )
    result.update(
        exit=proc.returncode,
        survived=(
            proc.returncode == 0 and complete and rel is not None and rel <= TOL and starts == 1
        ),
        restarted=starts > 1,
        max_rel_loss_diff=rel,
        ended_itself=(
            f"rank {victim} ended itself after it was left out (exit 4)" in out
            if cluster is None
            else bool(said)
        ),
        said=said[0].split(": ", 1)[-1] if said else None,
        last_checkpoint_verified=_newest_verifies(run_dir),
        writes_after_fence=fenced,
        scheduler_files_after_fence=scheduler,
        seconds=round(time.monotonic() - started, 1),
    )
    if not args.keep and result["survived"] and not fenced and result["ended_itself"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="how many drills (default 10)")
    parser.add_argument("--mode", choices=("sigstop", "netns"), default="sigstop")
    parser.add_argument(
        "--cut",
        choices=("other", "master"),
        default="other",
        help="netns: cut rank 1 or 2's node (other, default) or rank 0's, the batch host with "
        "the job's store (master: rank 0 keeps the store and goes on, the others stop)",
    )
    parser.add_argument("--ranks", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps of each run (default 24; netns 80)"
    )
    parser.add_argument("--seed", type=int, default=46, help="seed of the cut steps and ranks")
    parser.add_argument("--keep", action="store_true", help="keep every run directory")
    parser.add_argument("--first", type=int, default=0, help="index of the first drill (0)")
    parser.add_argument(
        "--down-s",
        type=float,
        default=0.0,
        help="netns: seconds from the cut to the link's return, at least until the others "
        "went on without the rank (default 0: at once then; a cut longer than "
        "--slurmd-timeout is a node failure to Slurm, which ends the step)",
    )
    parser.add_argument(
        "--slurmd-timeout",
        type=int,
        default=300,
        help="netns: the drills' cluster's SlurmdTimeout in s (default 300, Slurm's own)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=8.0, help="trainer.elastic.timeout_s (8)"
    )
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args(argv)
    if args.cut == "master" and args.mode != "netns":
        parser.error("--cut master needs --mode netns (the local launcher's store: the tests)")
    if args.mode == "netns" and netns_unavailable():
        print(f"partition_drills: error: {netns_unavailable()}", file=sys.stderr)
        return 2
    if args.ranks != 3 or (args.steps or 24) < 10 or args.runs < 1:
        parser.error("use --ranks 3 (the test cluster's het job), --steps >= 10, --runs >= 1")
    args.steps = args.steps or (80 if args.mode == "netns" else 24)
    args.extra = [f"trainer.elastic.timeout_s={args.timeout_s:g}", *args.extra]
    root = Path(tempfile.mkdtemp(prefix="partition-drills-"))
    cache = root / "cache"
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; runs under {root}",
        flush=True,
    )
    ref_dir = root / "reference"  # 3 local ranks: the trajectory does not depend on where
    proc = _start(ref_dir, cache, args.steps, *RUNS["sigstop"], *args.extra)
    out = _end(proc)
    if proc.returncode != 0:
        print(out[-3000:], file=sys.stderr)
        print("partition_drills: error: the uninterrupted run failed", file=sys.stderr)
        return 1
    reference = losses(ref_dir)
    results = []
    cluster = NetnsCluster(args.slurmd_timeout) if args.mode == "netns" else None
    try:
        if cluster is not None:
            cluster.start()
        for index in range(args.first, args.first + args.runs):
            result = drill(index, args, reference, cache, root, cluster)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    diffs = [r["max_rel_loss_diff"] for r in results if r.get("max_rel_loss_diff") is not None]
    summary = {
        "mode": args.mode,
        "cut": args.cut,
        "down_s": args.down_s,
        "slurmd_timeout_s": args.slurmd_timeout if args.mode == "netns" else None,
        "runs": len(results),
        "survived": sum(bool(r["survived"]) for r in results),
        "ended_itself": sum(bool(r.get("ended_itself")) for r in results),
        "writes_after_fence": sum(len(r.get("writes_after_fence") or []) for r in results),
        "last_checkpoint_verified": sum(bool(r.get("last_checkpoint_verified")) for r in results),
        "max_rel_loss_diff": max(diffs) if diffs else None,
        "drills": [
            {k: r.get(k) for k in ("step", "rank", "exit", "seconds", "error") if r.get(k)}
            for r in results
        ],
    }
    print(json.dumps(summary))
    ok = summary["survived"] == summary["runs"] and summary["writes_after_fence"] == 0
    return 0 if ok else 1


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the finally blocks run: the cluster stops, no launcher left


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    try:
        sys.exit(main())
    finally:
        _kill_live()
