"""Every rank at its own precision, with ONE loss scale (hetseq_hpc.train.precision), in-process:
the precision a rank trains in, the job-wide loss scale (torch.amp.GradScaler's rule), no scale
without fp16, the overflow the test task injects, Adasum's power-of-two world. (End to end with
2 real worker processes: tests/integration/test_precision_runs.py.)
"""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.balance.placement import placement_for
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.config.rank_precision import PrecisionConfig
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.train.precision import (
    INIT_SCALE,
    GradientPath,
    LossScale,
    check_adasum_world,
    needs_loss_scale,
    resolve_precision,
)
from tests.helpers.fault_tasks import overflowing_backward


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
    cfg = compose_run_config(["precision.default=bf16"]).comm
    for precisions in (["fp32"], ["bf16", "fp32"], [None, None]):
        path = GradientPath(cfg, precisions, 0, len(precisions), 300.0)
        assert not path.loss_scale.enabled
        assert path.unscale_factor(297) == 1.0 / 297
        assert path.row() == {} and path.step_ok(float("nan"), 1) is True
    assert needs_loss_scale(["bf16", "fp16"]) and needs_loss_scale(["fp32"], "fp16")
    assert not needs_loss_scale(["bf16"], "bf16")


def test_injected_overflow_names_one_rank_and_step(monkeypatch):
    """The test task's overflow (tests/helpers/fault_tasks.py, rank 1 at step 5): only that
    rank's backward of that step gets a non-finite gradient, and its loss scale skips it."""
    monkeypatch.setattr(
        GradientPath, "backward", overflowing_backward(GradientPath.backward, rank=1, step=5)
    )
    cfg = compose_run_config(["precision.default=bf16"]).comm
    for rank, step, overflow in ((1, 5, True), (0, 5, False), (1, 6, False)):
        path = GradientPath(cfg, ["bf16", "fp16"], rank, 2, 300.0)
        weight = torch.ones(3, requires_grad=True)
        path.backward((weight * 2.0).sum(), step)
        norm = float(weight.grad.norm())
        assert path.step_ok(norm, step) is not overflow, (rank, step)


def test_adasum_refuses_a_world_that_is_not_a_power_of_two():
    for ok in (1, 2, 4, 8):
        check_adasum_world(ok)
    with pytest.raises(ConfigError) as err:
        check_adasum_world(3)
    assert "\n" not in str(err.value) and "comm.grad_combine=sum" in str(err.value)


def test_per_rank_and_per_partition_precision_overrides():
    run = compose_run_config(["cluster.ranks=2", "precision.ranks=[bf16,fp16]"])
    assert [placement_for(run, r, cores=2).precision for r in (0, 1)] == ["bf16", "fp16"]
    run = compose_run_config(
        ["cluster=mixed", "precision.default=fp32", "precision.partitions.v100=fp16"]
    )
    first_v100 = run.cluster.partitions["a100"].num_ranks  # srun numbers a100's ranks first
    assert placement_for(run, 0, cores=8).precision == "fp32"  # a100: precision.default
    assert placement_for(run, first_v100, cores=8).precision == "fp16"
    with pytest.raises(ConfigError, match=r"precision\.ranks"):
        compose_run_config(["cluster.ranks=2", "precision.ranks=[bf16,fp8]"])
    with pytest.raises(ConfigError, match="one precision per rank"):
        PrecisionConfig(ranks=["bf16", "fp16"]).check_world(3, [])
    with pytest.raises(ConfigError, match=r"precision\.partitions names p100, not a partition"):
        compose_run_config(["cluster=mixed", "++precision.partitions.p100=fp16"])


def test_old_precision_keys_still_work_and_name_their_new_place():
    """Precision has one source (the precision group); the three old places are rewritten."""
    run = compose_run_config(
        ["cluster=mixed", "trainer.precision=fp32", "cluster.partitions.v100.precision=fp16"]
    )
    assert run.precision.default == "fp32" and run.precision.partitions == {"v100": "fp16"}
    run = compose_run_config(["cluster.ranks=2", "cluster.precisions=[bf16,fp16]"])
    assert run.precision.ranks == ["bf16", "fp16"]
