"""The peak learning rate a run gets when the user sets none, and the start line that names it:
a transformers model from a random init (``task=hf task.model.config=...``) gets a
pre-training rate, not optim=finetune's fine-tuning one (issue 40: GPT-2 moved 7.60 -> 7.55 in
30 steps at 5e-5); ``optim.lr`` always wins; every run names its rate, where it comes from and
its schedule (:meth:`~hetseq_hpc.config.trainer.OptimConfig.describe`)."""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.config import compose_run_config, load_run_config, save_run_config
from hetseq_hpc.config.trainer import ADAMW_LR, FINETUNE_LR, RANDOM_INIT_LR, OptimConfig
from hetseq_hpc.train.optim import build_optimizer
from tests.helpers.hf_models import make_gpt2, write_text_files

#: transformers and datasets are imported by the module's first test, on the one worker this
#: group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("hf")


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    """Skips the test where transformers is not installed."""
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("lr")
    return {**write_text_files(root), "gpt2": make_gpt2(root / "gpt2")}


def hf(made, source: str, *extra: str):
    return compose_run_config(
        [
            "task=hf",
            f"task.model.{source}={made['gpt2']}",
            f"task.data.files=[{made['txt']}]",
            *extra,
        ]
    )


def test_a_random_init_gets_a_pretraining_learning_rate_unless_one_is_set(made, tmp_path):
    """task.model.config (random init): 3e-4, a pre-training rate six times optim=finetune's
    5e-5 for pretrained weights; the AdamW the ranks build starts from it; optim.lr and
    optim=adamw are kept as given; the saved run config holds the number."""
    assert RANDOM_INIT_LR == 3e-4 and FINETUNE_LR == 5e-5 and ADAMW_LR == 1e-3
    scratch, pretrained = hf(made, "config"), hf(made, "path")
    assert scratch.random_init and not pretrained.random_init
    assert scratch.optim.lr == RANDOM_INIT_LR and pretrained.optim.lr == FINETUNE_LR
    optimizer, _ = build_optimizer(torch.nn.Linear(4, 4), scratch)
    assert {group["initial_lr"] for group in optimizer.param_groups} == {RANDOM_INIT_LR}
    for source in ("config", "path"):
        assert hf(made, source, "optim.lr=1e-4").optim.lr == 1e-4
        assert hf(made, source, "optim=adamw").optim.lr == ADAMW_LR
        assert hf(made, source, "optim.lr=5e-5").optim.lr == 5e-5
    assert compose_run_config(["task=bert"]).optim.lr == ADAMW_LR
    saved = save_run_config(scratch, tmp_path / "hetseq_config.yaml")
    assert "lr: 0.0003" in saved.read_text()
    assert load_run_config(saved).optim.lr == RANDOM_INIT_LR


def test_the_start_line_names_the_rate_its_origin_and_schedule(made):
    """Default or set, warm-up or none, linear / cosine decay to 0 at trainer.max_steps or
    optim.schedule_steps, or constant."""
    run = hf(made, "config", "trainer.max_steps=200")
    assert run.optim.describe(run.trainer.max_steps, run.random_init) == (
        "AdamW, learning rate 0.0003 (the default for a random init; optim.lr sets it), "
        "linear warm-up over 10 steps, then linear decay to 0 at step 200 (trainer.max_steps)"
    )
    run = hf(made, "path", "trainer.max_steps=200")
    assert "learning rate 5e-05 (optim=finetune's default for pretrained weights; " in (
        run.optim.describe(200, run.random_init)
    )
    run = hf(made, "config", "optim.lr=5e-5")
    assert "learning rate 5e-05 (set by optim.lr)" in run.optim.describe(9, run.random_init)
    optim = OptimConfig(lr=2e-4, warmup_steps=0, schedule="cosine", schedule_steps=500)
    assert optim.describe(300, False) == (
        "AdamW, learning rate 0.0002 (set by optim.lr), no warm-up, cosine decay to 0 at step "
        "500 (optim.schedule_steps)"
    )
    assert OptimConfig(schedule="constant").describe(50, False) == (
        "AdamW, learning rate 0.001 (optim=adamw's default; optim.lr sets it), linear warm-up "
        "over 20 steps, then constant"
    )
