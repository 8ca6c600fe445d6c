"""The main job end to end: real worker processes, real gloo rendezvous, real BERT on real text.

Float tolerance of the equivalence tests: 1e-5 relative (REL_TOL, tests/helpers/runs.py). Runs that differ only in how the
global batch is split (1 rank vs [24, 8] with accumulation) add the same per-token losses in a
different order, in fp32, with different thread counts: measured differences are ~2e-7 after
20 AdamW steps. A semantic error is orders of magnitude larger: weighting the ranks' mean
losses equally (what plain DDP does with uneven batches) changes the loss by > 1e-3 within a
few steps (see test_plain_ddp_mean_is_not_exact in test_exact_gradients.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import (
    SMALL_MODEL,
    assert_same_losses,
    hetseq,
    losses,
    read_rows,
    sigint_as_in_a_terminal,
    start_hetseq,
    wait_rows,
    worker_pids,
)
from tests.helpers.shared import built_once

pytestmark = pytest.mark.slow

EXACT = ["task.model.dropout=0.0", "trainer.val_every=0", "trainer.seed=7"]


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, token_cache):
    """An uninterrupted 20-step run on ONE rank, global batch 32 (shared by three tests and
    the xdist workers)."""

    def build(run_dir: Path) -> None:
        proc = hetseq(
            *SMALL_MODEL,
            *EXACT,
            "cluster.ranks=1",
            "trainer.global_batch_size=32",
            "trainer.max_steps=20",
            "trainer.checkpoint_every=10",
            f"hydra.run.dir={run_dir}",
            token_cache=token_cache,
        )
        _ok(proc)

    return built_once(tmp_path_factory, "training-reference", build)


def test_main_job_end_to_end(tmp_path, run_cli):
    """Default local cluster (2 ranks): loss falls, and every promised artefact is written."""
    proc = run_cli(
        tmp_path,
        "trainer.max_steps=12",
        "optim.warmup_steps=2",
        "optim.lr=3e-3",
        "trainer.val_every=6",
        "trainer.checkpoint_every=6",
    )
    _ok(proc)
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("step", "loss", "lr", "samples_per_s", "ranks"):
        assert all(key in r for r in rows), key
    assert len(rows[0]["ranks"]) == 2
    for rank_row in rows[0]["ranks"]:
        for key in ("rank", "device", "micro_batch", "accum_steps", "samples", "step_time_s"):
            assert key in rank_row, key
    assert sum(r["samples"] for r in rows[0]["ranks"]) == 32
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.3, f"loss did not fall: {first} -> {last}"
    assert "val_loss" in rows[5] and "val_ppl" in rows[-1]
    alloc = json.loads((tmp_path / "allocation.json").read_text())
    assert sum(alloc["allocation"]["shares"][i]["samples"] for i in range(2)) == 32
    assert len({r["probe"]["kind"] for r in alloc["ranks"]}) == 1
    assert all(r["calibration"]["samples_per_s"] > 0 for r in alloc["ranks"])
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == [
        "step_00000006.pt",
        "step_00000006.pt.sha256",
        "step_00000012.pt",
        "step_00000012.pt.sha256",
    ]  # each with its SHA-256 sidecar, no temp file
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["validation"]["val_loss"] > 0
    assert (tmp_path / "logs" / "rank1.log").is_file()


def test_one_rank_equals_uneven_two_ranks(tmp_path, run_cli, reference_run):
    """1 rank x 32 and 2 ranks x [24, 8] (with gradient accumulation on both) log the same loss
    at every one of 20 steps: one update == one step on the whole global batch."""
    proc = run_cli(
        tmp_path,
        *EXACT,
        "cluster.ranks=2",
        "trainer.global_batch_size=32",
        "balance.allocation=[24,8]",
        "balance.max_micro_batch=5",
        "trainer.max_steps=20",
    )
    _ok(proc)
    alloc = json.loads((tmp_path / "allocation.json").read_text())["allocation"]
    assert [s["samples"] for s in alloc["shares"]] == [24, 8]
    assert [s["accum_steps"] for s in alloc["shares"]] == [5, 2]
    assert_same_losses(losses(reference_run), losses(tmp_path), range(1, 21))


def test_resume_repeats_uninterrupted_run(tmp_path, run_cli, reference_run):
    """Stopped after step 10 and resumed with trainer.resume=auto -- on a different hardware
    mix (2 ranks instead of 1) -- the run logs the same losses for steps 11-20."""
    first = run_cli(
        tmp_path, *EXACT, "cluster.ranks=2", "trainer.max_steps=10", "optim.schedule_steps=20"
    )
    _ok(first)
    assert max(losses(tmp_path)) == 10
    second = run_cli(
        tmp_path, *EXACT, "cluster.ranks=2", "trainer.max_steps=20", "trainer.resume=auto"
    )
    _ok(second)
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, 21)), "metrics.jsonl should read as one run"
    assert_same_losses(losses(reference_run), resumed, range(11, 21))
    assert "resumed from" in (tmp_path / "logs" / "rank0.log").read_text()


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path, run_cli):
    """A damaged latest checkpoint: one-line error naming it and the fix; the file is untouched."""
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    bad = ckpt_dir / "step_00000004.pt"
    bad.write_bytes(b"PK\x03\x04 definitely not a torch checkpoint")
    proc = run_cli(tmp_path, "trainer.max_steps=6", "trainer.resume=auto")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("hetseq-hpc: error:") and "step_00000004.pt" in last and "corrupt" in last
    )
    assert bad.read_bytes() == b"PK\x03\x04 definitely not a torch checkpoint"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_dead_rank_stops_the_job_with_a_clear_error(tmp_path, token_cache):
    """With ``trainer.elastic.enabled=false`` (a lost rank survived in-job:
    tests/integration/test_elastic.py), SIGKILL rank 1 mid-training: the launcher stops rank 0
    (which would wait in a collective) and reports which rank died and why, instead of hanging. A 0.03 GiB rank on a machine with
    GiBs free, killed by the user, is not called out of memory (its cgroup counter did not move;
    the kernel log, where readable, does not name the process)."""
    proc = start_hetseq(
        *SMALL_MODEL,
        "cluster.ranks=2",
        "trainer.max_steps=100000",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        "trainer.elastic.enabled=false",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
    )
    try:
        wait_rows(tmp_path, 2, proc)
        pids = worker_pids(tmp_path)
        assert set(pids) == {0, 1}, f"workers not found: {pids}"
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # a hang would time out here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "SIGKILL" in last, last
    not_oom = "killed by SIGKILL (by a user, the scheduler, or the OOM killer)"
    assert f"rank 1 failed ({not_oom})" in last, last
    assert "out of memory" not in last and "memory_budget_gb" not in last, last
    assert not worker_pids(tmp_path), "a worker outlived the launcher"


def test_rebalancing_keeps_exact_semantics_and_switches_all_ranks_together(
    tmp_path, run_cli, reference_run
):
    """Start badly split ([28, 4] on equal ranks) with re-balancing every 2 steps: the
    allocation changes mid-run, every rank switches at the same step, and the losses still
    equal the 1-rank run at every step."""
    proc = run_cli(
        tmp_path,
        *EXACT,
        "cluster.ranks=2",
        "balance.allocation=[28,4]",
        "balance.rebalance_every=2",
        "trainer.max_steps=20",
    )
    _ok(proc)
    rows = read_rows(tmp_path)
    moves = [r for r in rows if "reallocation" in r]
    assert moves, "no re-allocation happened"
    first = moves[0]["reallocation"]
    assert first["from"] == [28, 4] and sum(first["to"]) == 32
    for row in rows:  # every rank ran the row's allocation: nobody switched early or late
        assert [r["samples"] for r in row["ranks"]] == row["allocation"]
        if row["step"] < first["at_step"]:
            assert row["allocation"] == [28, 4]
        elif row["step"] == first["at_step"]:
            assert row["allocation"] == first["to"]
    assert_same_losses(losses(reference_run), losses(tmp_path), range(1, 21))
    # the finished run leaves what a plan needs: the refitted curves and, when the last split
    # ran 3 steps or more (re-balancing every 2 steps may move it late), the measured sync
    final = json.loads((tmp_path / "allocation.json").read_text())
    assert len(final["fitted_curves"]) == 2
    last = [r["allocation"] for r in rows]
    measured = final.get("measured_step")
    assert (measured is not None) == (last[-4:] == [last[-1]] * 4), (measured, last)
    if measured is not None:
        assert measured["samples"] == last[-1] and measured["steps"] >= 3
        assert measured["sync_s"] >= 0


def test_ctrl_c_checkpoints_and_resumes(tmp_path, token_cache):
    """Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it): the
    workers ignore it, the launcher stops them with SIGTERM, they checkpoint after their current
    step, and the run continues from there with trainer.resume=auto."""
    proc = start_hetseq(
        *SMALL_MODEL,
        "cluster.ranks=2",
        "trainer.max_steps=100000",
        "optim.schedule_steps=100000",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
        new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        wait_rows(tmp_path, 3, proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-2000:]
    assert "trainer.resume=auto" in stderr.strip().splitlines()[-1]
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*.pt"))
    assert ckpts, "no checkpoint written on Ctrl-C"
    stopped_at = int(ckpts[-1].stem.split("_")[1])
    assert stopped_at >= 3 and max(losses(tmp_path)) == stopped_at
    resumed = hetseq(
        *SMALL_MODEL,
        "cluster.ranks=2",
        f"trainer.max_steps={stopped_at + 2}",
        "optim.schedule_steps=100000",
        "trainer.val_every=0",
        "trainer.resume=auto",
        f"hydra.run.dir={tmp_path}",
        token_cache=token_cache,
    )
    _ok(resumed)
    assert sorted(losses(tmp_path)) == list(range(1, stopped_at + 3))
