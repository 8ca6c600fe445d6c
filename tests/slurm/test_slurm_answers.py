"""What Slurm answers, against the real test cluster: ``sbatch`` that hangs, answers late,
answers garbage or bytes that are not UTF-8, and an admin's partition whose name is not UTF-8.

A hostile or broken ``sbatch`` cannot be produced with a healthy Slurm, so those tests put a
fake ``sbatch`` first on PATH (said in each test's name): a script that sleeps, prints
garbage, or wraps the real ``sbatch`` (which submits for real) and then hangs or adds bytes.
Everything else (sinfo, squeue, scancel, the controller) is the real cluster. The partition
with a non-UTF-8 name is real: ``scontrol create partitionname=$'hetseq\\xff\\xfe'``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Set

import pytest

from tests.helpers.runs import SMALL_MODEL, alive, cli_env, hetseq
from tests.helpers.slurm import squeue_state

#: cluster.submit_timeout_s of these tests (the default is 120 s)
BOUND = ["cluster.submit_timeout_s=4"]


def _queue() -> Set[str]:
    """Job ids squeue lists now (any state)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True)
    return {j.split("+")[0] for j in out.stdout.decode(errors="replace").split()}


def _fake_sbatch(tmp_path: Path, body: str) -> dict:
    """An environment whose PATH starts with a fake ``sbatch`` (``/bin/sh`` script ``body``;
    ``$REAL`` in it is the real sbatch)."""
    real = shutil.which("sbatch")
    assert real, "no sbatch on PATH"
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    script = fake_bin / "sbatch"
    script.write_text(f'#!/bin/sh\nREAL="{real}"\n{body}\n')
    script.chmod(0o755)
    env = cli_env(tmp_path / "cache")
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    return env


def _run(tmp_path: Path, env: dict, *overrides: str):
    """``hetseq-hpc cluster=testcluster`` into a new run directory ``tmp_path/run``."""
    return hetseq(
        "cluster=testcluster",
        *SMALL_MODEL,
        "trainer.max_steps=2",
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        env=env,
        timeout=300,
    )


def _last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


@pytest.mark.slurm
def test_a_hanging_sbatch_faked_is_stopped_and_nothing_is_submitted(tmp_path):
    """A fake sbatch that never answers (it waits on a child, as a site wrapper would): after
    cluster.submit_timeout_s, one line, exit 1; sbatch and its child are gone, no job reached
    the queue, the new run directory is removed."""
    pids = tmp_path / "pids"
    env = _fake_sbatch(tmp_path, f"echo $$ >> {pids}\nsleep 600 &\necho $! >> {pids}\nwait")
    before = _queue()
    proc = _run(tmp_path, env, *BOUND)
    started: List[int] = [int(p) for p in pids.read_text().split()]
    try:
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = _last_line(proc)
        assert line.startswith("hetseq-hpc: error: sbatch did not answer within 4 s"), line
        assert "nothing was submitted" in line, line
        assert len(started) == 2 and not any(alive(p) for p in started), started
        assert _queue() - before == set()
        assert not (tmp_path / "run").exists()
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.mark.slurm
def test_a_job_submitted_by_an_sbatch_that_answers_late_faked_is_cancelled(tmp_path):
    """A fake sbatch that runs the real one (the job reaches the queue) and then hangs
    without answering: the launcher stops it, finds the job by its script in squeue and
    cancels it, and its one line names the job; nothing is left to run."""
    said = tmp_path / "said"
    env = _fake_sbatch(tmp_path, f'"$REAL" "$@" > {said} 2>&1\nexec sleep 600')
    proc = _run(tmp_path, env, "cluster.submit_timeout_s=20")
    job = said.read_text().split()[-1]  # "Submitted batch job N"
    try:
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = _last_line(proc)
        assert line.startswith("hetseq-hpc: error: sbatch did not answer within 20 s"), line
        assert f"job {job}, which it had submitted, was cancelled: nothing is left" in line, line
        assert squeue_state(job) == "CANCELLED"
    finally:
        subprocess.run(["scancel", job], capture_output=True)


@pytest.mark.slurm
def test_a_garbage_sbatch_answer_faked_is_one_line_naming_it(tmp_path):
    """A fake sbatch that exits 0 with no job id (and a non-UTF-8 byte): one line quoting what
    it printed, saying nothing was submitted (squeue has no job of the script); exit 1, no
    traceback."""
    env = _fake_sbatch(tmp_path, r"printf 'all good \377 here\n'; exit 0")
    before = _queue()
    proc = _run(tmp_path, env, *BOUND)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc)
    assert line.startswith("hetseq-hpc: error: sbatch (") and "Traceback" not in proc.stderr
    assert "answered 'all good \ufffd here', which holds no job id" in line, line
    assert "nothing was submitted (squeue lists no job of it)" in line, line
    assert _queue() - before == set()


@pytest.mark.slurm
def test_non_utf8_bytes_from_sbatch_faked_do_not_lose_the_job(tmp_path):
    """A wrapper around the real sbatch that adds a site notice with non-UTF-8 bytes on stderr
    (what an admin's job-submit plugin may print): the job is submitted and known (job.json,
    the 'submitted' line), exit 0. Before, the launcher said 'sbatch refused the job' while the
    job sat in the queue. A refusal with such bytes is one line with sbatch's words."""
    env = _fake_sbatch(
        tmp_path, '"$REAL" "$@"; rc=$?\nprintf \'notice: caf\\351 \\377\\n\' >&2\nexit $rc'
    )
    proc = _run(tmp_path, env, *BOUND, "cluster.wait=false")
    job = ""
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        job = json.loads((tmp_path / "run" / "job.json").read_text())["job_id"]
        assert f"submitted het job {job}" in proc.stdout
    finally:
        if job:
            subprocess.run(["scancel", str(job)], capture_output=True)

    refusing = tmp_path / "refusing"
    refusing.mkdir()
    env = _fake_sbatch(
        refusing, r"printf 'sbatch: error: Batch job submission failed: \377 bad\n' >&2; exit 1"
    )
    proc = _run(refusing, env, *BOUND)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc)
    assert line.startswith(
        "hetseq-hpc: error: sbatch refused the job (sbatch: error: Batch job submission "
        "failed: \ufffd bad)"
    ), line


@pytest.fixture
def partition_named_in_bytes():
    """A real partition whose name is not UTF-8 (over n4), removed afterwards."""
    name = b"hetseq\xff\xfe"
    made = subprocess.run(
        [b"scontrol", b"create", b"partitionname=" + name, b"nodes=n4"], capture_output=True
    )
    assert made.returncode == 0, made.stderr
    try:
        yield name
    finally:
        subprocess.run([b"scontrol", b"delete", b"partitionname=" + name], capture_output=True)


@pytest.mark.slurm
def test_a_partition_with_a_non_utf8_name_real(tmp_path, partition_named_in_bytes):
    """sinfo prints the admin's partition name raw; ``plan --when`` ranks the mixes and ``run``
    submits (both ended with a UnicodeDecodeError traceback before)."""
    listed = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True).stdout
    assert partition_named_in_bytes in listed
    env = cli_env(tmp_path / "cache")
    plan = hetseq("plan", "--when", "cluster=testcluster", *SMALL_MODEL, env=env, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "cluster.choose=finish_first would submit" in plan.stdout
    proc = _run(tmp_path, env, "cluster.wait=false")
    job = ""
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        job = json.loads((tmp_path / "run" / "job.json").read_text())["job_id"]
    finally:
        if job:
            subprocess.run(["scancel", str(job)], capture_output=True)
    # a missing partition's line lists what sinfo has, the odd name included
    proc = _run(tmp_path / "x", env, "cluster.partitions.a100.partition=nope")
    assert proc.returncode == 2 and "hetseq\ufffd\ufffd" in _last_line(proc), proc.stderr[-2000:]
