#!/usr/bin/env python3
"""Fault drills on ``cluster=local``: break a real run on purpose and time what happens.

Each drill starts ``python -m hetseq_hpc`` (2 ranks, a small BERT), injects one fault, and
prints what the user sees (exit code, the one error line) and how long it took. The fault
drills of docs/benchmarks.md come from this script (what each fault does: docs/running.md); the tests in tests/integration/test_checkpoint.py and
tests/integration/test_launch_local.py check the same behaviour without timing it.

    python scripts/fault_drills.py            # all drills, about 2-4 minutes on 2 cores
    python scripts/fault_drills.py --only sigkill_launcher,flipped_bytes

The last line is JSON: ``{"<drill>": {"ok": bool, "seconds": float, "said": "..."}, ...}``.
Times are wall-clock on this machine and include the ranks' current step; the machine is
printed first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "task.model.hidden_size=64",
    "task.model.num_layers=2",
    "task.model.num_heads=2",
    "task.model.intermediate_size=128",
    "task.model.max_seq_len=64",
    "trainer.val_every=0",
    "optim.warmup_steps=2",
]


def _env(cache: Path) -> Dict[str, str]:
    env = dict(os.environ, HETSEQ_CACHE=str(cache), PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _start(run_dir: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetseq_hpc", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _run(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hetseq_hpc", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(cache), capture_output=True, text=True, timeout=600
    )


def _rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_rows(run_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if _rows(run_dir) >= n:
            return
        time.sleep(0.1)
    raise RuntimeError(f"run in {run_dir} did not reach {n} metrics rows")


def _workers(run_dir: Path) -> List[int]:
    """PIDs of live worker processes of this run (their command line names the run dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"hetseq_hpc.worker" in cmd and str(run_dir).encode() in b" ".join(cmd):
            pids.append(int(entry.name))
    return pids


def _said(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "hetseq-hpc:" in ln]
    return lines[-1].strip() if lines else (stderr.strip().splitlines() or [""])[-1]


def drill_sigterm_launcher(tmp: Path, cache: Path) -> dict:
    """`kill <launcher>` mid-run: ranks checkpoint after their current step and exit."""
    run_dir = tmp / "sigterm"
    proc = _start(run_dir, cache, "trainer.max_steps=100000", "trainer.checkpoint_every=0")
    _wait_rows(run_dir, 3, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    return {
        "ok": bool(ckpts) and not _workers(run_dir),
        "seconds": round(seconds, 2),
        "exit": proc.returncode,
        "checkpoint": ckpts[-1].name if ckpts else None,
        "said": _said(err),
    }


def drill_sigkill_launcher(tmp: Path, cache: Path) -> dict:
    """`kill -9 <launcher>`: nothing can checkpoint; the ranks must not train on as orphans."""
    run_dir = tmp / "sigkill"
    proc = _start(run_dir, cache, "trainer.max_steps=100000", "trainer.checkpoint_every=0")
    _wait_rows(run_dir, 3, proc)
    before = _workers(run_dir)
    t0 = time.monotonic()
    proc.kill()
    proc.wait()
    while _workers(run_dir) and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    return {
        "ok": bool(before) and not _workers(run_dir),
        "seconds": round(seconds, 2),
        "workers_before": len(before),
    }


def drill_dead_rank(tmp: Path, cache: Path) -> dict:
    """SIGKILL one rank without in-job recovery: the others are stopped and the dead rank is
    named."""
    run_dir = tmp / "dead_rank"
    proc = _start(
        run_dir,
        cache,
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=0",
        "trainer.elastic.enabled=false",
    )
    _wait_rows(run_dir, 3, proc)
    victims = sorted(_workers(run_dir))
    t0 = time.monotonic()
    os.kill(victims[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    return {
        "ok": proc.returncode not in (0, None) and "rank" in _said(err),
        "seconds": round(time.monotonic() - t0, 2),
        "exit": proc.returncode,
        "said": _said(err),
    }


def _lose_a_rank(
    tmp: Path,
    cache: Path,
    name: str,
    victim: int,
    how: int,
    *overrides: str,
    delay_s: float = 0.0,
    checkpoint_every: int = 0,
) -> dict:
    """3 ranks, 30 steps; at step 10 ``how`` (SIGKILL / SIGSTOP) hits rank ``victim``: with
    in-job recovery (the default) the run finishes. Reports seconds from the signal to the next
    completed step (from metrics.jsonl's row times) and the steps lost (re-done steps beyond
    the interrupted one; 0 = the survivors went on from where the run was; under FSDP the
    steps since the reloaded checkpoint, ``steps_redone``)."""
    run_dir = tmp / name
    proc = _start(
        run_dir,
        cache,
        "cluster.ranks=3",
        "trainer.max_steps=30",
        f"trainer.checkpoint_every={checkpoint_every}",
        "task.model.dropout=0.0",
        *overrides,
    )
    _wait_rows(run_dir, 10, proc)
    time.sleep(delay_s)
    pids = {}
    for pid in _workers(run_dir):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        pids[rank] = pid
    done_before = _rows(run_dir)
    t_signal = time.time()
    os.kill(pids[victim], how)
    _, err = proc.communicate(timeout=300)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "loss" in r]
    after = [r["time"] for r in steps if r["time"] > t_signal]
    event = next((r for r in rows if r.get("event") == "membership"), {})
    lost = (
        max(0, done_before - event.get("resumed_at_step", done_before + 1) + 1) if event else None
    )
    if event and "steps_redone" in event:  # FSDP: back to the last checkpoint
        lost = event["steps_redone"]
    return {
        "ok": proc.returncode == 0 and len({r["step"] for r in steps}) == 30 and bool(event),
        "seconds": round(min(after) - t_signal, 2) if after else None,
        "steps_lost": lost,
        "exit": proc.returncode,
        "said": f"lost {event.get('lost')} at step {event.get('step')}; went on with "
        f"{event.get('world_size')} ranks, split {event.get('split')}"
        if event
        else _said(err),
    }


def drill_elastic_kill_rank1(tmp: Path, cache: Path) -> dict:
    """kill -9 of rank 1 at step 10 of 30: the other two finish the run."""
    return _lose_a_rank(tmp, cache, "elastic_kill1", 1, signal.SIGKILL)


def drill_elastic_kill_rank0(tmp: Path, cache: Path) -> dict:
    """kill -9 of rank 0 (it writes the metrics): the others finish the run."""
    return _lose_a_rank(tmp, cache, "elastic_kill0", 0, signal.SIGKILL)


def drill_elastic_kill_in_checkpoint(tmp: Path, cache: Path) -> dict:
    """kill -9 of rank 1, 15 ms after step 10's row, with validation and a checkpoint after
    every step: the kill lands in a checkpoint or a validation, which the others redo."""
    return _lose_a_rank(
        tmp,
        cache,
        "elastic_kill_ckpt",
        1,
        signal.SIGKILL,
        "trainer.val_every=1",
        "trainer.checkpoint_every=1",
        delay_s=0.015,
    )


def drill_elastic_fsdp_kill(tmp: Path, cache: Path) -> dict:
    """kill -9 of rank 1 at step 10 of an FSDP run checkpointing every 5 steps: the survivors
    reload the last checkpoint re-sharded over 2 ranks and train the steps since it again."""
    return _lose_a_rank(
        tmp, cache, "elastic_fsdp", 1, signal.SIGKILL, "sharding.mode=fsdp", checkpoint_every=5
    )


def drill_elastic_sigstop(tmp: Path, cache: Path) -> dict:
    """SIGSTOP of rank 2 (a hang): left out after trainer.elastic.timeout_s, then ended."""
    return _lose_a_rank(tmp, cache, "elastic_stop", 2, signal.SIGSTOP)


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def drill_flipped_bytes(tmp: Path, cache: Path) -> dict:
    """64 flipped bytes in the newest checkpoint: auto-resume falls back to the one before."""
    run_dir = tmp / "flipped"
    first = _run(run_dir, cache, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    if first.returncode != 0:
        return {"ok": False, "said": _said(first.stderr)}
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    _flip(newest)
    t0 = time.monotonic()
    again = _run(run_dir, cache, "trainer.max_steps=6", "trainer.checkpoint_every=2")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    fallback = next((r["resume_fallback"] for r in rows if "resume_fallback" in r), None)
    log = (run_dir / "logs" / "rank0.log").read_text()
    line = next((ln for ln in log.splitlines() if newest.name in ln and "WARNING" in ln), "")
    return {
        "ok": again.returncode == 0 and fallback is not None,
        "seconds": round(time.monotonic() - t0, 2),
        "fallback": fallback,
        "said": line.split(" - ")[-1].strip()[:300],
    }


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path(tempfile.gettempdir()) / "hetseq-drill-payload-ran"


def drill_payload_checkpoint(tmp: Path, cache: Path) -> dict:
    """A crafted pickle passed as trainer.resume: refused, and its code never runs."""
    MARKER.unlink(missing_ok=True)
    bad = tmp / "payload.pt"
    bad.write_bytes(pickle.dumps({"model": _Payload()}))
    # with a matching checksum file, so that the loader itself must refuse the pickle
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    (tmp / "payload.pt.sha256").write_text(f"{digest}  payload.pt\n")
    t0 = time.monotonic()
    proc = _run(tmp / "payload_run", cache, "trainer.max_steps=2", f"trainer.resume={bad}")
    return {
        "ok": proc.returncode != 0 and not MARKER.exists(),
        "seconds": round(time.monotonic() - t0, 2),
        "exit": proc.returncode,
        "payload_ran": MARKER.exists(),
        "said": _said(proc.stderr),
    }


def drill_second_run_same_dir(tmp: Path, cache: Path) -> dict:
    """A second run started in a run directory that a live run uses: turned away."""
    run_dir = tmp / "busy"
    first = _start(run_dir, cache, "trainer.max_steps=100000", "trainer.checkpoint_every=0")
    try:
        _wait_rows(run_dir, 2, first)
        t0 = time.monotonic()
        second = _run(run_dir, cache, "trainer.max_steps=2", "trainer.seed=5")
        seconds = time.monotonic() - t0
        alive = first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    return {
        "ok": second.returncode != 0 and alive,
        "seconds": round(seconds, 2),
        "exit": second.returncode,
        "first_run_unharmed": alive,
        "said": _said(second.stderr),
    }


DRILLS: Dict[str, Callable[[Path, Path], dict]] = {
    "sigterm_launcher": drill_sigterm_launcher,
    "sigkill_launcher": drill_sigkill_launcher,
    "dead_rank": drill_dead_rank,
    "elastic_kill_rank1": drill_elastic_kill_rank1,
    "elastic_kill_rank0": drill_elastic_kill_rank0,
    "elastic_kill_in_checkpoint": drill_elastic_kill_in_checkpoint,
    "elastic_sigstop": drill_elastic_sigstop,
    "elastic_fsdp_kill": drill_elastic_fsdp_kill,
    "flipped_bytes": drill_flipped_bytes,
    "payload_checkpoint": drill_payload_checkpoint,
    "second_run_same_dir": drill_second_run_same_dir,
}


def main(argv: Optional[List[str]] = None) -> int:
    """Run the drills; print one line per drill and a JSON line last. Exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated drill names")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(DRILLS)
    unknown = sorted(set(names) - set(DRILLS))
    if unknown:
        parser.error(f"unknown drill(s) {unknown}: choose from {sorted(DRILLS)}")
    from hetseq_hpc.env.hardware import _cpu_model

    print(f"machine: {_cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="hetseq-drills-") as tmp_name:
        tmp = Path(tmp_name)
        cache = tmp / "cache"
        for name in names:
            try:
                results[name] = DRILLS[name](tmp, cache)
            except Exception as exc:  # a drill that breaks is a finding, not a crash
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(json.dumps(results))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
