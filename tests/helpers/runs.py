"""Running the real CLI in a subprocess with a small model, and reading what a run left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from hetseq_hpc.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent.parent

#: A small BERT so multi-process runs take seconds on 2 CPU cores.
SMALL_MODEL = [
    "task.model.hidden_size=64",
    "task.model.num_layers=2",
    "task.model.num_heads=2",
    "task.model.intermediate_size=128",
    "task.model.max_seq_len=64",
]

#: relative tolerance of the loss equivalence tests (derived in the docstring of
#: tests/integration/test_training.py)
REL_TOL = 1e-5


def cli_env(token_cache: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["HETSEQ_CACHE"] = str(token_cache)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def hetseq(*args: str, token_cache: Path | None = None, cwd: Path = REPO, env=None, timeout=600):
    """``python -m hetseq_hpc ARGS`` -> CompletedProcess (text)."""
    env = env or (cli_env(token_cache) if token_cache else None)
    return subprocess.run(
        [sys.executable, "-m", "hetseq_hpc", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_ok(proc) -> None:
    """``proc`` exited 0 (else its output's tails)."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    )


def snapshot(run_dir: Path, skip=(".hetseq.lock",)) -> Dict[str, bytes]:
    """Every file under ``run_dir`` (relative path -> bytes) but those whose relative path
    starts with one of ``skip`` (the lock file records its last holder's pid)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(Path(run_dir).rglob("*"))
        if p.is_file() and not str(p.relative_to(run_dir)).startswith(tuple(skip))
    }


def read_rows(run_dir: Path) -> List[dict]:
    """Rows of a run's metrics.jsonl (:func:`hetseq_hpc.train.metrics.read_metrics`)."""
    return read_metrics(run_dir)


def losses(run_dir: Path) -> Dict[int, float]:
    """step -> training loss of a run (step rows only: not a membership event's row)."""
    return {row["step"]: row["loss"] for row in read_rows(run_dir) if "loss" in row}


def assert_same_losses(a: dict, b: dict, steps) -> None:
    """The losses of ``steps`` agree to :data:`REL_TOL` relative."""
    for step in steps:
        assert step in a and step in b, f"step {step} missing"
        rel = abs(a[step] - b[step]) / abs(a[step])
        assert rel <= REL_TOL, f"step {step}: {a[step]} vs {b[step]} (relative {rel:.2e})"


def wait_rows(
    run_dir: Path, n: int, proc: Optional[subprocess.Popen] = None, timeout_s: float = 300
) -> None:
    """Wait until ``run_dir/metrics.jsonl`` has ``n`` rows (or ``proc`` ended, or the timeout:
    a guard against hangs, not a speed check)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{metrics} did not reach {n} rows")


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a CLI the test will Ctrl-C: SIGINT back to its default action.

    A shell without job control starts background commands with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: a suite started as ``(bash scripts/run-tests.sh
    &)`` would hand that to every CLI it starts, and a test's Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def worker_pids(run_dir: Path) -> dict:
    """rank -> pid of the worker processes of ``run_dir`` (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hetseq_hpc.worker" in cmdline and str(run_dir).encode() in b" ".join(cmdline):
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
    return found
