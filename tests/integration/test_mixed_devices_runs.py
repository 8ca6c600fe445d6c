"""``cluster.devices`` in real runs (issue 43): each rank on the device the config names, the
whole job on gloo, exact against one rank; and a ``cuda`` rank where torch has no CUDA
refused at the command line before anything starts. (The GPU + CPU job itself:
tests/gpu/test_mixed_devices_cuda.py, on a lent GPU.)"""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import SMALL_MODEL, assert_ok, assert_same_losses, hetseq, losses

EXACT = [
    *SMALL_MODEL,
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.seed=7",
    "trainer.global_batch_size=32",
    "trainer.max_steps=12",
    "precision=fp32",
]


@pytest.mark.slow
def test_devices_cpu_cpu_runs_on_gloo_exact_against_one_rank(tmp_path, token_cache):
    """``cluster.devices=[cpu,cpu]`` (two ranks named by their devices, no cluster.ranks) with
    the measured split and accumulation logs the 1-rank run's loss at all 12 steps; the
    summary and allocation.json say where each rank ran, and each rank joined with gloo."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(hetseq(*EXACT, "cluster.ranks=1", f"hydra.run.dir={one}", token_cache=token_cache))
    assert_ok(
        hetseq(
            *EXACT,
            "cluster.devices=[cpu,cpu]",
            "balance.max_micro_batch=6",
            f"hydra.run.dir={two}",
            token_cache=token_cache,
        )
    )
    assert_same_losses(losses(one), losses(two), range(1, 13))
    alloc = json.loads((two / "allocation.json").read_text())
    assert [r["probe"]["kind"] for r in alloc["ranks"]] == ["cpu", "cpu"]
    assert sum(s["samples"] for s in alloc["allocation"]["shares"]) == 32
    assert alloc["allocation"]["source"] in ("cost_curve", "rebalanced")  # measured shares
    assert max(s["accum_steps"] for s in alloc["allocation"]["shares"]) >= 2
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert (
        all(r["device"].startswith("cpu ") for r in summary["ranks"])
        and summary["precisions"] == ["fp32"] * 2
    )
    for rank in (0, 1):
        assert "/2 joining" in (log := (two / "logs" / f"rank{rank}.log").read_text())
        assert " with gloo " in log


def test_a_cuda_rank_without_cuda_is_refused_at_the_command_line_no_cuda_here(tmp_path):
    run_dir = tmp_path / "run"
    proc = hetseq(
        *SMALL_MODEL, "cluster.devices=[cuda,cpu]", f"hydra.run.dir={run_dir}", timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error: cluster.devices=[cuda,cpu] puts a rank")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not run_dir.exists()
