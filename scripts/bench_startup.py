#!/usr/bin/env python3
"""Submit -> first step on the Slurm test cluster: how long a het job takes to start training.

Runs ``python -m hetseq_hpc cluster=testcluster task=bert`` (the default model) as a user would,
``--repeats`` times, and measures for each run:

- ``command_to_submit_s``: from starting the command to the job's submission (``job.json``);
- ``submit_to_first_step_s``: from submission to the end of rank 0's first optimizer step (the
  ``time`` of the first ``metrics.jsonl`` row);
- the worker's phases on rank 0 (``allocation.json`` -> ``startup``, written by
  :mod:`hetseq_hpc.worker`): ``scheduling`` (submission -> the rank's process start: Slurm, srun,
  the Python interpreter), ``imports``, ``probe``, ``rendezvous``, ``data``, ``model``,
  ``calibration``, ``allocation``, and ``first_step`` (trainer set-up and the first step).

Needs the test cluster: ``eval "$(scripts/test-cluster.sh start | tail -n1)"`` starts it and
exports the SLURM_CONF it prints. The last line is JSON: the median of the runs for every
figure, plus the runs themselves.

    python scripts/bench_startup.py [--repeats 3] [--out DIR] [extra overrides ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(run_dir: Path, extra: list, timeout_s: float) -> dict:
    """One submission; returns its figures (seconds)."""
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        "cluster=testcluster",
        "task=bert",
        "trainer.max_steps=2",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        sys.exit(f"submission failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    submitted = (run_dir / "job.json").stat().st_mtime
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            break
        time.sleep(0.05)
    else:
        sys.exit(f"no first step within {timeout_s} s: see {run_dir / 'logs'}")
    first = json.loads(metrics.read_text().splitlines()[0])
    phases = json.loads((run_dir / "allocation.json").read_text()).get("startup", {})
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    subprocess.run(["scancel", str(job_id)], capture_output=True)  # the figures are in
    out = {
        "command_to_submit_s": submitted - started,
        "submit_to_first_step_s": first["time"] - submitted,
    }
    if "process_start" in phases:
        out["scheduling_s"] = phases["process_start"] - submitted
    for name, value in phases.get("phases_s", {}).items():
        out[f"{name}_s"] = value
    if "allocated" in phases:
        out["first_step_s"] = first["time"] - phases["allocated"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="submissions (medians reported)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run, at most")
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    parser.add_argument("overrides", nargs="*", help="extra hetseq_hpc overrides")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-startup-"))
    runs = []
    for i in range(args.repeats):
        runs.append(one_run(root / f"run{i}", args.overrides, args.timeout))
        print(
            f"run {i + 1}/{args.repeats}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()),
            flush=True,
        )
    keys = list(runs[0])
    result = {k: round(statistics.median(r[k] for r in runs if k in r), 3) for k in keys}
    result["runs"] = runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
