"""The data-preparation path in real runs cannot hang, blow up memory or fail with a traceback
(issue 26):

* rank 0 stopped (SIGSTOP) while it prepares: the waiting rank fails with a named error about
  rank 0's heartbeat (it gave up after the timeout without one, not when the 600 s prepare
  would have ended), and the launcher ends every rank, the stopped one too;
* a prepare longer than ``cluster.collective_timeout_s`` on a live rank 0 is waited for;
* ``prepare`` of a file without a newline stays in bounded memory, with the tokens of reading
  the whole file;
* a full disk, an unwritable or misplaced ``task.data.cache_dir``: one line naming the path and
  the fix, non-zero exit, no cache a run would trust; an existing cache is reported as such.

(The heartbeat wait with a fake clock, and the readers in-process:
tests/unit/test_prepare_safety.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest

from tests.helpers.runs import (
    REPO,
    SMALL_MODEL,
    cli_env,
    hetseq,
    hetseq_cmd,
    read_rows,
    run_processes,
    start_hetseq,
)
from tests.helpers.waits import wait_for

#: a tiny regression task whose prepare() records its pid, then sleeps task.args.prepare_s
SLOW_TASK = """
import os
import time

import torch
from torch import nn

from hetseq_hpc.tasks import Task


class SlowPrepare(Task):
    def prepare(self):
        folder = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(folder, "prepare.pid.tmp"), "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(os.path.join(folder, "prepare.pid.tmp"), os.path.join(folder, "prepare.pid"))
        time.sleep(float(self.cfg.args.get("prepare_s", 0)))

    def load(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    num_train = property(lambda self: 56)
    num_val = property(lambda self: 8)

    def make_batch(self, positions, epoch, split):
        rows = torch.as_tensor(list(positions), dtype=torch.long) + (56 if split == "val" else 0)
        return {"x": self.x[rows], "y": self.y[rows]}

    def count(self, batch):
        return int(batch["y"].shape[0])

    def build_model(self):
        return Net()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(1) - y) ** 2).sum()
"""


def _slow_task_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "usercode"
    folder.mkdir()
    (folder / "slow_task.py").write_text(SLOW_TASK)
    return folder


def _slow_run_args(folder: Path, run_dir: Path, prepare_s: float, timeout_s: int) -> List[str]:
    return [
        "task=custom",
        "task.target=slow_task.SlowPrepare",
        f"task.path={folder}",
        f"+task.args.prepare_s={prepare_s}",
        "cluster.ranks=2",
        f"cluster.collective_timeout_s={timeout_s}",
        "trainer.max_steps=2",
        "trainer.global_batch_size=16",
        "trainer.val_every=0",
        f"hydra.run.dir={run_dir}",
    ]


def _workers_of(run_dir: Path) -> List[int]:
    """Pids of live processes the launcher started for the run in ``run_dir``: its ranks and
    their template, if they were forked (from /proc: ``run_processes``)."""
    return [pid for pid, _, state in run_processes(run_dir) if state != "Z"]


# ----------------------------------------------------------------------- heartbeat, real runs


@pytest.mark.slow
def test_a_stopped_rank0_while_preparing_ends_the_run_with_a_named_error(tmp_path):
    """SIGSTOP rank 0 inside prepare(): rank 1 names rank 0's heartbeat within the timeout, the
    launcher stops every rank (the stopped one with SIGKILL) and exits non-zero."""
    folder, run_dir, timeout_s = _slow_task_dir(tmp_path), tmp_path / "run", 10
    proc = start_hetseq(
        *_slow_run_args(folder, run_dir, 600, timeout_s),
        token_cache=tmp_path / "cache",
        cwd=tmp_path,
    )
    rank0 = None
    try:  # startup on a loaded machine: the wait's bound is a guard, not a check
        wait_for((folder / "prepare.pid").exists, "rank 0's prepare()", proc=proc)
        rank0 = int((folder / "prepare.pid").read_text())
        os.kill(rank0, signal.SIGSTOP)
        _, err = proc.communicate(timeout=600)  # a guard against hangs, not a speed check
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _workers_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode not in (0, None), err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("hetseq-hpc: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 0 sent no heartbeat for" in lines[0] and "while preparing the data" in lines[0]
    assert "cluster.collective_timeout_s" in lines[0]
    assert _workers_of(run_dir) == [], "no worker may outlive the launcher"
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)


@pytest.mark.slow
def test_waiting_ranks_outlive_a_prepare_longer_than_the_collective_timeout(tmp_path):
    """Rank 0 prepares for 15 s (a slow custom task) while the other rank waits on the marker
    file and rank 0's heartbeat, not in a gloo barrier with the 10 s timeout."""
    folder, run_dir = _slow_task_dir(tmp_path), tmp_path / "run"
    proc = hetseq(
        *_slow_run_args(folder, run_dir, 15, 10), token_cache=tmp_path / "cache", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2]
    assert not list((run_dir / "logs").glob(".prepared-*"))
    assert not list((run_dir / "logs").glob(".preparing-*"))


def _peak_rss_mb_of_prepare(tmp_path: Path, data: Path, cache: Path) -> tuple:
    """Run ``hetseq-hpc prepare`` under a small Python parent; returns (proc, peak RSS in MB of
    the prepare process: ``ru_maxrss`` of the parent's children)."""
    script = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:])\n"
        "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
        "sys.exit(p.returncode)\n"
    )
    cmd = [
        sys.executable,
        "-c",
        script,
        *hetseq_cmd(
            "prepare",
            "task=bert",
            f"task.data.files=[{data}]",
            f"task.data.cache_dir={cache}",
            "task.model.max_seq_len=64",
        ),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=cli_env(tmp_path / "unused"),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    peak = [int(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.startswith("PEAK_KB")]
    return proc, peak[0] / 1024 if peak else None


@pytest.mark.slow
def test_prepare_of_a_file_without_newline_stays_in_bounded_memory(tmp_path):
    """12 MB of words and no newline: one "document" for the old reader (about 2.3 GB peak,
    ~110 bytes per byte of text; 24 GB for 200 MB); streamed in pieces it stays under 1 GB
    (about 0.4 GB measured), and the cache is complete."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    vocab = [bytes(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    data = tmp_path / "one-line.txt"
    with open(data, "wb") as fh:
        while fh.tell() < 12_000_000:
            fh.write(b" ".join(vocab[i] for i in rng.integers(0, len(vocab), 100_000)) + b" ")
    proc, peak_mb = _peak_rss_mb_of_prepare(tmp_path, data, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert peak_mb is not None and peak_mb < 1000, f"peak RSS {peak_mb:.0f} MB"
    meta = json.loads(next((tmp_path / "cache").glob("*/meta.json")).read_text())
    assert meta["rows"] > 40_000  # ~2.2 M words in rows of 62


# ----------------------------------------------------------------------- cache dir failures


def _prepare_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return hetseq(
        "prepare", "task=bert", *SMALL_MODEL, *overrides, token_cache=tmp_path / "default"
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hetseq-hpc: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_file_in_place_of_the_cache_dir_is_one_line(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("I am a file\n")
    for cache_dir in (blocker, blocker / "below"):
        line = _one_error_line(_prepare_cli(tmp_path, f"task.data.cache_dir={cache_dir}"))
        assert f"{str(blocker)!r} is a file, not a directory" in line, line
        assert line.endswith("set task.data.cache_dir (or $HETSEQ_CACHE) to a writable directory")
    assert blocker.read_text() == "I am a file\n"


def _mount(kind: str, target: Path, *options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a test filesystem needs root and mount(8)")
    proc = subprocess.run(
        ["mount", *options, target.as_posix()]
        if kind == "bind"
        else ["mount", "-t", kind, *options, kind, target.as_posix()],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here ({proc.stderr.strip()}): needs CAP_SYS_ADMIN")


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", target.as_posix()], capture_output=True)


def test_a_read_only_cache_dir_is_one_line(tmp_path):
    """A read-only bind mount (root ignores chmod): one line with the path and the fix."""
    cache = tmp_path / "ro-cache"
    cache.mkdir()
    _mount("bind", cache, "--bind", cache.as_posix())
    try:
        remount = subprocess.run(
            ["mount", "-o", "remount,bind,ro", cache.as_posix()], capture_output=True, text=True
        )
        if remount.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount ({remount.stderr.strip()})")
        line = _one_error_line(_prepare_cli(tmp_path, f"task.data.cache_dir={cache}"))
    finally:
        _umount(cache)
    assert f"cannot write the data cache '{cache}/" in line and "Read-only file system" in line
    assert line.endswith(
        "make it writable, or set task.data.cache_dir (or $HETSEQ_CACHE) to a writable directory"
    )
    assert list(cache.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_while_preparing_is_one_line_and_leaves_no_trusted_cache(tmp_path):
    """A real 2 MB tmpfs: the tokenizer fits, the ~5 MB of packed tokens do not."""
    from pydoc_data import topics

    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(t for _, t in sorted(topics.topics.items())) * 10)
    cache = tmp_path / "small-disk"
    cache.mkdir()
    _mount("tmpfs", cache, "-o", "size=2m")
    try:
        line = _one_error_line(
            _prepare_cli(
                tmp_path,
                f"task.data.cache_dir={cache}",
                f"task.data.files=[{data}]",
                "task.model.max_seq_len=16",
            )
        )
        left = [p for p in cache.rglob("*") if p.is_file()]
    finally:
        _umount(cache)
    assert f"no space left on {cache} while preparing the data" in line, line
    assert line.endswith(
        "free space there, or set task.data.cache_dir (or $HETSEQ_CACHE) to a disk with room"
    )
    assert not [p for p in left if p.name == "meta.json" or p.name.endswith(".tmp")], left


def test_an_existing_cache_is_reported_as_already_prepared(tmp_path):
    cache = tmp_path / "cache"
    first = _prepare_cli(tmp_path, f"task.data.cache_dir={cache}")
    assert first.returncode == 0 and "prepared task=bert in" in first.stdout, first.stderr[-3000:]
    again = _prepare_cli(tmp_path, f"task.data.cache_dir={cache}")
    assert again.returncode == 0, again.stderr[-3000:]
    where = next(cache.glob("*/meta.json")).parent
    assert again.stdout.strip() == (
        f"task=bert was already prepared: {where} (nothing to do; "
        "delete that directory to rebuild it)"
    )
