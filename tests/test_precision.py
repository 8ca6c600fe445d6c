"""Every rank at its own precision in one job, with ONE loss scale (hetseq_hpc.train.precision).

End to end on CPU (torch's cpu autocast runs bf16 and fp16): 2 real worker processes,
``trainer.allocation=[24,8]``, ``cluster.precisions=[bf16,fp16]``.

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
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SMALL_MODEL, cli_env, losses, read_rows
from hetseq_hpc.balance.placement import placement_for
from hetseq_hpc.config.cluster import LocalClusterConfig
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.train.precision import (
    INIT_SCALE,
    INJECT_ENV,
    GradientPath,
    LossScale,
    injected_overflow,
    needs_loss_scale,
    resolve_precision,
)

MIXED_REL_TOL = 2.5e-4
#: grad_compression=bf16 vs none: every summed gradient element is rounded to bf16 (relative
#: error u = 2**-8) before the update; to first order the loss's total decrease over the run
#: (8.35 -> 7.67 here, 8.9 % of the final loss) is then off by at most u of itself: 3.5e-4.
#: Measured: 1.9e-6 (bf16), 7.5e-8 (fp16), at 712,768 instead of 1,425,536 bytes per rank/step.
COMPRESSION_REL_TOL = 3.5e-4
EXACT = ["task.model.dropout=0.0", "trainer.val_every=0", "trainer.seed=7",
         "trainer.global_batch_size=32"]
MIXED = ["cluster.ranks=2", "trainer.allocation=[24,8]", "trainer.max_micro_batch=5",
         "cluster.precisions=[bf16,fp16]", "trainer.checkpoint_every=10"]


# ---------------------------------------------------------------- units
def test_auto_precision_per_compute_capability_fake_gpu_capabilities():
    """No GPU here: the capabilities are given, the rule is the product's."""
    assert resolve_precision("auto", "cuda", (9, 0)) == ("bf16", None)
    assert resolve_precision("auto", "cuda", (8, 0)) == ("bf16", None)
    assert resolve_precision("auto", "cuda", (7, 5)) == ("fp16", None)  # Turing (T4)
    assert resolve_precision("auto", "cuda", (7, 0)) == ("fp16", None)  # Volta (V100)
    assert resolve_precision("auto", "cuda", (6, 1)) == ("fp32", None)  # Pascal
    assert resolve_precision("auto", "cpu", None) == ("fp32", None)
    precision, warning = resolve_precision("bf16", "cuda", (7, 0))
    assert precision == "fp16" and "7.0" in warning and "\n" not in warning
    # explicit overrides are honoured on the CPU: that is how the end-to-end tests run them
    assert resolve_precision("fp16", "cpu") == ("fp16", None)
    assert resolve_precision("bf16", "cpu") == ("bf16", None)


def test_loss_scale_follows_gradscaler_rule_and_round_trips():
    scale = LossScale(enabled=True, growth_interval=3)
    assert scale.factor() == INIT_SCALE == 2.0**16
    assert scale.update(found_inf=True) is True and scale.scale == 2.0**15
    for _ in range(3):
        assert scale.update(found_inf=False) is False
    assert scale.scale == 2.0**16 and scale.growth_tracker == 0 and scale.skipped_steps == 1
    scale.update(found_inf=False)
    restored = LossScale(enabled=True, growth_interval=3)
    restored.load_state_dict(scale.state_dict())
    assert restored == scale
    off = LossScale(enabled=False)
    assert off.factor() == 1.0 and off.update(found_inf=True) is False and off.skipped_steps == 0


def test_scale_is_absent_without_fp16(tmp_path):
    """fp32/bf16 everywhere: no scale, the unscale factor is exactly 1/count, nothing logged."""
    cfg = compose_run_config(["trainer.precision=bf16"]).trainer
    for precisions in (["fp32"], ["bf16", "fp32"], [None, None]):
        path = GradientPath(cfg, precisions, 0, len(precisions), 300.0)
        assert not path.loss_scale.enabled
        assert path.unscale_factor(297) == 1.0 / 297
        assert path.row() == {} and path.step_ok(float("nan"), 1) is True
    assert needs_loss_scale(["bf16", "fp16"]) and needs_loss_scale(["fp32"], "fp16")
    assert not needs_loss_scale(["bf16"], "bf16")


def test_injection_hook_names_one_rank_and_step():
    env = {INJECT_ENV: "1:5"}
    assert injected_overflow(1, 5, env) and not injected_overflow(0, 5, env)
    assert not injected_overflow(1, 6, env) and not injected_overflow(1, 5, {})


def test_per_rank_and_per_partition_precision_overrides():
    run = compose_run_config(["cluster.ranks=2", "cluster.precisions=[bf16,fp16]"])
    assert [placement_for(run, r, cores=2).precision for r in (0, 1)] == ["bf16", "fp16"]
    run = compose_run_config(["cluster=mixed", "trainer.precision=fp32",
                              "cluster.partitions.v100.precision=fp16"])
    first_v100 = run.cluster.partitions["a100"].num_ranks  # srun numbers a100's ranks first
    assert placement_for(run, 0, cores=8).precision == "fp32"  # a100: trainer.precision
    assert placement_for(run, first_v100, cores=8).precision == "fp16"
    with pytest.raises(ConfigError, match=r"cluster\.precisions"):
        compose_run_config(["cluster.ranks=2", "cluster.precisions=[bf16,fp8]"])
    with pytest.raises(ConfigError, match="one precision per rank"):
        LocalClusterConfig(ranks=3, precisions=["bf16", "fp16"]).check_world(3)


# ---------------------------------------------------------------- end to end
def _run(run_dir: Path, token_cache: Path, *overrides: str, env_extra=None) -> None:
    env = cli_env(token_cache)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "hetseq_hpc", *SMALL_MODEL, *EXACT, *overrides,
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory, token_cache):
    run_dir = tmp_path_factory.mktemp("fp32")
    _run(run_dir, token_cache, "cluster.ranks=1", "trainer.max_steps=20")
    return run_dir


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
    """HETSEQ_INJECT_OVERFLOW=1:5 puts inf into rank 1's scaled loss at step 5: both ranks see
    the non-finite SUMMED gradient, skip step 5 and halve the scale; training goes on. A run
    stopped at step 10 and resumed repeats steps 11-20 exactly, loss scale and skip count too."""
    inject = {INJECT_ENV: "1:5"}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _run(whole, token_cache, *MIXED, "trainer.max_steps=20", env_extra=inject)
    rows = {r["step"]: r for r in read_rows(whole)}
    assert [s for s, r in rows.items() if r["step_skipped"]] == [5]
    assert rows[5]["loss_scale"] == INIT_SCALE
    assert all(rows[s]["loss_scale"] == INIT_SCALE / 2 for s in range(6, 21))
    assert rows[20]["skipped_steps"] == 1 and rows[20]["loss"] < rows[4]["loss"]
    for rank in (0, 1):  # each rank decided the skip itself, from the all-reduced gradient
        log_text = (whole / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank}: step 5 skipped" in log_text and "scale now 32768" in log_text
    _run(resumed, token_cache, *MIXED, "trainer.max_steps=10", "optim.schedule_steps=20",
         env_extra=inject)
    _run(resumed, token_cache, *MIXED, "trainer.max_steps=20", env_extra=inject)
    again = {r["step"]: r for r in read_rows(resumed)}
    assert sorted(again) == list(range(1, 21))
    for step in range(11, 21):
        for key in ("loss", "loss_scale", "skipped_steps", "grad_norm"):
            assert again[step][key] == rows[step][key], (step, key)
    assert "resumed from" in (resumed / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_bf16_compressed_allreduce_stays_within_tolerance_of_none(tmp_path, token_cache):
    plain = ["cluster.ranks=2", "trainer.allocation=[24,8]", "trainer.max_micro_batch=5",
             "trainer.max_steps=20"]
    _run(tmp_path / "none", token_cache, *plain)
    _run(tmp_path / "bf16", token_cache, *plain, "trainer.grad_compression=bf16",
         "trainer.bucket_cap_mb=1")
    ref, got = losses(tmp_path / "none"), losses(tmp_path / "bf16")
    for step in range(1, 21):
        rel = abs(got[step] - ref[step]) / abs(ref[step])
        assert rel <= COMPRESSION_REL_TOL, f"step {step}: {got[step]} vs {ref[step]} ({rel:.2e})"
    rows = read_rows(tmp_path / "bf16")
    params = rows[0]["allreduce_bytes"] // 2  # bf16: 2 bytes per gradient element
    assert all(r["allreduce_bytes"] == 2 * params for r in rows)
    assert "allreduce_bytes" not in read_rows(tmp_path / "none")[0]
    assert "loss_scale" not in rows[0]  # bf16 payloads keep fp32's range: no scale needed
