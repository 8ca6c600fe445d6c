"""Every rank at its own precision in one job, with ONE loss scale (hetseq_hpc.train.precision).

End to end on CPU (torch's cpu autocast runs bf16 and fp16): 2 real worker processes,
``balance.allocation=[24,8]``, ``precision.ranks=[bf16,fp16]``.

Tolerance of the mixed run against the fp32 1-rank run, per step, relative: ``MIXED_REL_TOL =
2.5e-4``. Derivation: parameters, gradients and AdamW stay fp32, so the difference comes from
the forward/backward arithmetic; the 24-sample rank runs bf16, whose unit roundoff is 2**-8 =
3.9e-3 (8 significand bits; fp16's 2**-11 on the 8-sample rank is smaller). The logged loss is
the mean of ~300 per-token losses of a global batch (32 sequences x ~9.3 masked tokens), whose
rounding errors are independent, so the mean's relative error is about u / sqrt(300) = 2.3e-4.
Measured: at most 1.8e-5 over 20 steps (the 1-rank fp32 run vs this one). A semantic error is
larger: one skipped update (what a wrongly shared or missing loss scale causes) moves the loss by
~3.6e-3, and weighting the ranks' mean losses equally by > 1e-3 (test_exact_gradients.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetseq_hpc.train.precision import (
    INIT_SCALE,
)
from tests.helpers.fault_tasks import overflow_at
from tests.helpers.runs import SMALL_MODEL, losses, read_rows, run_ok
from tests.helpers.shared import built_once

MIXED_REL_TOL = 2.5e-4
#: grad_compression=bf16 vs none: every summed gradient element is rounded to bf16 (relative
#: error u = 2**-8) before the update; to first order the loss's total decrease over the run
#: (8.35 -> 7.67 here, 8.9 % of the final loss) is then off by at most u of itself: 3.5e-4.
#: Measured: 1.9e-6 (bf16), 7.5e-8 (fp16), at 712,768 instead of 1,425,536 bytes per rank/step.
COMPRESSION_REL_TOL = 3.5e-4
EXACT = [
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.seed=7",
    "trainer.global_batch_size=32",
]
MIXED = [
    "cluster.ranks=2",
    "balance.allocation=[24,8]",
    "balance.max_micro_batch=5",
    "precision.ranks=[bf16,fp16]",
    "trainer.checkpoint_every=10",
]


# ---------------------------------------------------------------- end to end
def _run(run_dir: Path, token_cache: Path, *overrides: str, task=tuple(SMALL_MODEL)) -> None:
    run_ok(run_dir, token_cache, *task, *EXACT, *overrides)


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory, token_cache):
    """The fp32 1-rank run (made once, shared by the xdist workers)."""

    def build(run_dir: Path) -> None:
        _run(run_dir, token_cache, "cluster.ranks=1", "trainer.max_steps=20")

    return built_once(tmp_path_factory, "precision-fp32-reference", build)


@pytest.mark.slow
def test_bf16_and_fp16_ranks_track_the_fp32_run(tmp_path, token_cache, fp32_reference):
    _run(tmp_path, token_cache, *MIXED, "trainer.max_steps=20")
    ref, got = losses(fp32_reference), losses(tmp_path)
    for step in range(1, 21):
        rel = abs(got[step] - ref[step]) / abs(ref[step])
        assert rel <= MIXED_REL_TOL, f"step {step}: {got[step]} vs fp32 {ref[step]} ({rel:.2e})"
    rows = read_rows(tmp_path)
    assert all([r["precision"] for r in row["ranks"]] == ["bf16", "fp16"] for row in rows)
    assert all(row["loss_scale"] == INIT_SCALE and not row["step_skipped"] for row in rows)
    alloc = json.loads((tmp_path / "allocation.json").read_text())
    assert [r["precision"] for r in alloc["ranks"]] == ["bf16", "fp16"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precisions"] == ["bf16", "fp16"] and summary["exact_global_batch_update"]
    assert "loss_scale" not in read_rows(fp32_reference)[0]  # fp32: no scale at all


@pytest.mark.slow
def test_overflow_on_one_rank_skips_the_step_everywhere_and_resume_is_exact(tmp_path, token_cache):
    """The test task of overflow_at(1, 5) (tests/helpers/fault_tasks.py) puts inf into rank 1's
    scaled loss at step 5 (the logged loss stays finite): both ranks see the non-finite SUMMED
    gradient, skip step 5 and halve the scale; training goes on. A run stopped at step 10 and
    resumed repeats steps 11-20 exactly, loss scale and skip count too."""
    inject = overflow_at(1, 5)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, token_cache, *MIXED, "trainer.max_steps=20", task=inject)
    rows = {r["step"]: r for r in read_rows(whole)}
    assert [s for s, r in rows.items() if r["step_skipped"]] == [5]
    assert rows[5]["loss_scale"] == INIT_SCALE
    assert all(rows[s]["loss_scale"] == INIT_SCALE / 2 for s in range(6, 21))
    assert rows[20]["skipped_steps"] == 1 and rows[20]["loss"] < rows[4]["loss"]
    for rank in (0, 1):  # each rank decided the skip itself, from the all-reduced gradient
        log_text = (whole / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank}: step 5 skipped" in log_text and "scale now 32768" in log_text
    _run(
        resumed, token_cache, *MIXED, "trainer.max_steps=10", "optim.schedule_steps=20", task=inject
    )
    _run(resumed, token_cache, *MIXED, "trainer.max_steps=20", task=inject)
    again = {r["step"]: r for r in read_rows(resumed)}
    assert sorted(again) == list(range(1, 21))
    for step in range(11, 21):
        for key in ("loss", "loss_scale", "skipped_steps", "grad_norm"):
            assert again[step][key] == rows[step][key], (step, key)
    assert "resumed from" in (resumed / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_bf16_compressed_allreduce_stays_within_tolerance_of_none(tmp_path, token_cache):
    plain = [
        "cluster.ranks=2",
        "balance.allocation=[24,8]",
        "balance.max_micro_batch=5",
        "trainer.max_steps=20",
    ]
    _run(tmp_path / "none", token_cache, *plain)
    _run(
        tmp_path / "bf16", token_cache, *plain, "comm.grad_compression=bf16", "comm.bucket_cap_mb=1"
    )
    ref, got = losses(tmp_path / "none"), losses(tmp_path / "bf16")
    for step in range(1, 21):
        rel = abs(got[step] - ref[step]) / abs(ref[step])
        assert rel <= COMPRESSION_REL_TOL, f"step {step}: {got[step]} vs {ref[step]} ({rel:.2e})"
    rows = read_rows(tmp_path / "bf16")
    params = rows[0]["allreduce_bytes"] // 2  # bf16: 2 bytes per gradient element
    assert all(r["allreduce_bytes"] == 2 * params for r in rows)
    assert "allreduce_bytes" not in read_rows(tmp_path / "none")[0]
    assert "loss_scale" not in rows[0]  # bf16 payloads keep fp32's range: no scale needed
