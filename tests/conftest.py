"""Shared fixtures: run the real CLI in a subprocess with a small model and a shared token cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from hetseq_hpc.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent

#: A small BERT so multi-process runs take seconds on 2 CPU cores.
SMALL_MODEL = [
    "task.model.hidden_size=64",
    "task.model.num_layers=2",
    "task.model.num_heads=2",
    "task.model.intermediate_size=128",
    "task.model.max_seq_len=64",
]


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (built by the first run)."""
    return tmp_path_factory.mktemp("token-cache")


def cli_env(token_cache: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["HETSEQ_CACHE"] = str(token_cache)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture
def run_cli(token_cache):
    """``run_cli(run_dir, *overrides, timeout=...) -> CompletedProcess`` of
    ``python -m hetseq_hpc`` with the small model."""

    def _run(run_dir: Path, *overrides: str, timeout: float = 600, small: bool = True):
        cmd = [sys.executable, "-m", "hetseq_hpc", *(SMALL_MODEL if small else []), *overrides,
               f"hydra.run.dir={run_dir}"]
        return subprocess.run(cmd, cwd=REPO, env=cli_env(token_cache), capture_output=True,
                              text=True, timeout=timeout)

    return _run


def read_rows(run_dir: Path) -> List[dict]:
    """Rows of a run's metrics.jsonl (:func:`hetseq_hpc.train.metrics.read_metrics`)."""
    return read_metrics(run_dir)


def losses(run_dir: Path) -> Dict[int, float]:
    """step -> training loss of a run."""
    return {row["step"]: row["loss"] for row in read_rows(run_dir)}


def wait_rows(run_dir: Path, n: int, proc: Optional[subprocess.Popen] = None, timeout_s: float = 300) -> None:
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

