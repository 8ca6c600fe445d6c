"""A full or read-only run directory (issue 40), on real tmpfs mounts: every write to it ends
the run with ONE line naming the mount point and "no space left" / "read-only" (no
traceback, no half-written file), or is refused before any rank starts.

* ``metrics.jsonl``: a row is written whole or not at all; a resume after freeing space reads
  the file and goes on.
* Rank logs and ``cli.log``: a log file never ends a run; the first record it cannot write
  closes it with one warning, and the run ends at the next write that matters (a row, a
  checkpoint) with the one line. Ending a run from inside a logging call (any line of any
  module, in the middle of a collective) would leave its peers waiting; a log is not a result.
* FSDP sharded checkpoints: no ``.shards.tmp`` nor unreferenced shard directory is left, the
  previous checkpoint still verifies and is the one a resume takes.
* A read-only (or full) run directory is refused before anything starts.

The disk is filled by :func:`tests.helpers.disk.fill` when a real event says so (the Nth
metrics row, a checkpoint's checksum file), never after a sleep. (The DDP checkpoint on a full
disk: tests/integration/test_checkpoint.py.)
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.errors import StorageError
from hetseq_hpc.rundir.logs import guard_log_files, setup_rank_logging
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from hetseq_hpc.train.metrics import MetricsWriter, read_metrics
from tests.helpers.disk import FILLER, fill, start_cli
from tests.helpers.runs import SMALL_MODEL, wait_rows
from tests.helpers.waits import wait_for

TWO_RANKS = [
    *SMALL_MODEL,
    "cluster.ranks=2",
    "trainer.val_every=0",
    "balance.calibration_steps=1",
    "trainer.global_batch_size=16",
    "optim.schedule_steps=1000",  # the same schedule whatever trainer.max_steps a resume sets
]


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "note": "x" * 1500}  # > 1 KiB: crosses pages


def _whole_rows(path: Path) -> list:
    """The rows of ``path``, checked: every line is a JSON object and the file ends with one."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a cut-off row: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The command's last stderr line, an error line with exit ``code`` and no traceback."""
    err = proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error:"), err[-3000:]
    return last


def _wait_for(pattern: str, folder: Path, proc: subprocess.Popen, timeout_s: float = 300) -> Path:
    """The first file matching ``pattern`` in ``folder`` once it exists (or fail if ``proc``
    ended first; the timeout guards against a hang, it is no speed check)."""
    found = wait_for(
        lambda: sorted(folder.glob(pattern)) if folder.is_dir() else [],
        f"no {pattern} in {folder}",
        timeout_s,
        proc=proc,
    )
    return found[0]


@pytest.fixture
def root_logging():
    """Restore the root logger's handlers and level after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


# ------------------------------------------------------------------ in-process, real tmpfs
def test_metrics_row_is_whole_or_absent_on_a_full_disk(tmpfs):
    """A row that finds the disk full mid-write is cut back: the file keeps whole rows only,
    the error is one StorageError line naming the mount; after freeing space a resume reads
    the file and appends."""
    disk = tmpfs("1m")
    run_dir = disk / "run"
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    writer.write(_row(1))
    filler = fill(disk)
    written = 1
    with pytest.raises(StorageError) as caught:
        for step in range(2, 100):  # the file's last page has room for a row or two
            writer.write(_row(step))
            written += 1
    writer.close()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on {disk} (run directory {run_dir}; writing "), (
        message
    )
    assert message.endswith(f"hydra.run.dir={run_dir} trainer.resume=auto"), message
    rows = _whole_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, written + 1))
    filler.unlink()
    resumed = MetricsWriter(run_dir / "metrics.jsonl", resume_step=written)
    resumed.write(_row(written + 1))
    resumed.close()
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, written + 2))


def test_rank_log_on_a_full_disk_warns_once_and_never_raises(tmpfs, root_logging, capsys):
    """A rank's log file on a full disk: one warning on the console naming the file and the
    mount, no "--- Logging error ---" traceback per record, the process goes on logging to the
    console."""
    disk = tmpfs("1m")
    run_dir = disk / "run"
    log_file = setup_rank_logging(0, RunDir(run_dir))
    fill(disk)
    log = logging.getLogger("hetseq_hpc.test")
    for i in range(200):  # far more than the file's last page holds
        log.info("line %d %s", i, "y" * 200)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err[-2000:]
    warnings = [line for line in err.splitlines() if "cannot write" in line]
    assert len(warnings) == 1, warnings
    assert f"cannot write {log_file} (no space left on {disk})" in warnings[0]
    assert "line 199" in err, "the console goes on"


def test_cli_log_on_a_full_disk_warns_once_and_never_raises(tmpfs, root_logging):
    """The launcher's ``cli.log`` as Hydra opens it (a plain FileHandler), guarded by
    :func:`guard_log_files`: the same single warning, on the launcher's console."""
    disk = tmpfs("1m")
    console = io.StringIO()
    root_logging.addHandler(logging.StreamHandler(console))
    root_logging.addHandler(logging.FileHandler(disk / "cli.log"))
    root_logging.setLevel(logging.INFO)
    guard_log_files()
    assert type(root_logging.handlers[-1]) is not logging.FileHandler
    fill(disk)
    for i in range(200):
        logging.getLogger("hetseq_hpc").info("launcher line %d %s", i, "z" * 200)
    text = console.getvalue()
    assert text.count("cannot write") == 1, text[-2000:]
    assert f"cannot write {disk / 'cli.log'} (no space left on {disk})" in text


# ------------------------------------------------------------------ real runs of the CLI
def test_read_only_run_dir_is_refused_before_start(tmpfs, run_cli):
    """A new run in a read-only filesystem: one line naming it read-only, exit 2, nothing
    created, no rank started."""
    ro = tmpfs("1m", readonly=True)
    proc = run_cli(ro / "run", "trainer.max_steps=1")
    last = _one_error_line(proc, 2)
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"hydra.run.dir={ro / 'run'} cannot be created ({ro} is read-only)" in last, last
    assert list(ro.iterdir()) == []


@pytest.mark.slow
def test_full_disk_at_a_metrics_row_ends_the_run_in_one_line(tmpfs, token_cache):
    """One run directory through a full disk: the disk fills after the 4th row of a resumed
    run; the run ends with one line (no traceback, no "Logging error"), the file keeps whole
    rows; a resume is refused while the disk is full and while it is read-only (one line
    each, nothing started); with space again it resumes from the checkpoint and the file
    reads as one run."""
    disk = tmpfs("64m")
    run_dir = disk / "run"
    first = start_cli(run_dir, token_cache, *TWO_RANKS, "trainer.max_steps=2")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    more = start_cli(
        run_dir, token_cache, "trainer.max_steps=1000", "trainer.checkpoint_every=1000"
    )
    try:
        wait_rows(run_dir, 4, more)
        filler = fill(disk)
        out, err = more.communicate(timeout=600)
    finally:
        if more.poll() is None:
            more.kill()
    proc = subprocess.CompletedProcess(more.args, more.returncode, out, err)
    last = _one_error_line(proc, 1)
    assert f"StorageError: no space left on {disk} (run directory {run_dir}" in last, last
    assert last.rstrip(")").split("); the other ranks")[0].endswith("trainer.resume=auto"), last
    assert err.count("logging to the console only") <= 2, "one warning per rank at most"
    rows = _whole_rows(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4

    full = start_cli(run_dir, token_cache, "trainer.max_steps=4")
    out, err = full.communicate(timeout=300)
    refused = _one_error_line(subprocess.CompletedProcess(full.args, full.returncode, out, err), 2)
    assert f"cannot be written (no space left on {disk})" in refused, refused

    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
        ro = start_cli(run_dir, token_cache, "trainer.max_steps=4")
        out, err = ro.communicate(timeout=300)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    refused = _one_error_line(subprocess.CompletedProcess(ro.args, ro.returncode, out, err), 2)
    assert f"hydra.run.dir={run_dir} cannot be written ({disk} is read-only)" in refused, refused
    assert err.count("\n") == 1, err

    filler.unlink()
    again = start_cli(run_dir, token_cache, "trainer.max_steps=4")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert "resumed from" in err and "step_00000002.pt at step 2" in err, err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]
    assert not (disk / FILLER).exists()


@pytest.mark.slow
def test_full_disk_at_a_sharded_checkpoint_keeps_the_previous_one(tmpfs, token_cache):
    """FSDP (sharding.mode=fsdp, sharded checkpoints): the disk fills once a checkpoint is
    committed; the next one fails on every rank with one line naming the mount; no
    ``.shards.tmp`` nor unreferenced shard directory is left; the previous checkpoint verifies,
    and a resume after freeing space takes it."""
    disk = tmpfs("48m")
    run_dir = disk / "run"
    run = start_cli(
        run_dir,
        token_cache,
        *TWO_RANKS,
        "sharding.mode=fsdp",
        "trainer.max_steps=1000",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=1",
        "trainer.log_every=1000",  # no rows: the checkpoint is the write that fails
    )
    try:
        _wait_for("step_*.pt.sha256", run_dir / "checkpoints", run)
        filler = fill(disk)
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    last = _one_error_line(subprocess.CompletedProcess(run.args, run.returncode, out, err), 1)
    # the ranks' own line (the launcher's names the same cause when no rank could write an
    # error file: os.statvfs of the run directory)
    assert f"no space left on {disk} (" in last and "trainer.resume=auto" in last, last
    assert f"CheckpointError: no space left on {disk} (writing checkpoint " in err, err[-3000:]
    folder = run_dir / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert not [n for n in names if n.endswith(".tmp")], names
    records = CheckpointManager(RunDir(run_dir)).list()
    assert records, names
    kept = load_checkpoint(records[-1])  # verifies the record and every shard's checksum
    assert [n for n in names if n.endswith(".shards")] == [kept["shards"]["dir"]], names
    assert f"the earlier checkpoint {records[-1].name} is kept" in err, err[-3000:]

    filler.unlink()
    step = kept["step"]
    again = start_cli(run_dir, token_cache, f"trainer.max_steps={step + 1}")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from {records[-1]} at step {step}" in err, err[-3000:]
