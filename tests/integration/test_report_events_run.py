"""The report tells a Ctrl-C and a resume apart from noise, end to end: a real 2-rank run
stopped with Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it),
resumed on one rank (another allocation), then ``hetseq-hpc report``: its summary names the
stop, its cause and the resume with their steps. (What the Figure draws from the same rows:
tests/unit/test_report_events.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.runs import (
    SMALL_MODEL,
    hetseq,
    sigint_as_in_a_terminal,
    start_hetseq,
    wait_rows,
)

pytestmark = pytest.mark.slow


def test_report_names_a_ctrl_c_stop_and_the_resume(tmp_path, token_cache, run_cli):
    common = [*SMALL_MODEL, "optim.schedule_steps=100000", "trainer.val_every=0"]
    proc = start_hetseq(
        *common,
        "cluster.ranks=2",
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=0",
        "trainer.plot=false",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
        new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        wait_rows(tmp_path, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-2000:]
    stopped_at = int(sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1].stem.split("_")[1])
    resumed = run_cli(
        tmp_path,
        *common[len(SMALL_MODEL) :],
        "cluster.ranks=1",
        f"trainer.max_steps={stopped_at + 1}",
        "trainer.resume=auto",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = hetseq("report", str(tmp_path), timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    out = report.stdout
    assert (
        f"stopped after step {stopped_at} by Ctrl-C (SIGINT) to the launcher, after its "
        "checkpoint" in out
    ), out
    assert f"resumed at step {stopped_at} from " in out and "on 1 rank(s)" in out, out
    assert f"checkpoints at step(s) {stopped_at}, {stopped_at + 1} (2 in all)" in out, out
