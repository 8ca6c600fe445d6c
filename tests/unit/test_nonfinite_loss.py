"""A NaN/inf training loss, in-process (issue 40): a real world-size-1 gloo group, the real
BERT task with the small model, real checkpoint files. The step that produced it is not
applied; the one-line error names the step, the rank and the micro-batch, and advises by
when it happened (the start model: the model or data; after updates: the learning rate); the
last good step is checkpointed also with ``trainer.checkpoint_every=0``, and a resume with a
lowered ``optim.lr`` trains with it. (Two real ranks through the CLI:
tests/integration/test_nonfinite_loss_run.py.)"""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.distributed.rendezvous import StepStats, single_process_rendezvous
from hetseq_hpc.errors import NonFiniteLoss, exit_code
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from hetseq_hpc.train.metrics import read_metrics
from hetseq_hpc.train.nonfinite import nonfinite_error
from hetseq_hpc.train.trainer import Trainer
from tests.helpers.trainers import one_rank_trainer

B = 8  # global batch; micro-batch cap 3 -> micro-batches [3, 3, 2]


@pytest.fixture
def make_trainer(tmp_path, token_cache):
    """``make_trainer(rdv, *overrides) -> Trainer`` on one CPU rank, run dir ``tmp_path``,
    5 steps, no checkpoint but the last (``trainer.checkpoint_every=0``)."""

    def _make(rdv, *overrides: str) -> Trainer:
        return one_rank_trainer(
            tmp_path,
            rdv,
            token_cache,
            "trainer.max_steps=5",
            "trainer.checkpoint_every=0",
            "trainer.val_every=0",
            "trainer.plot=false",
            *overrides,
            global_batch=B,
            cap=3,
            precision="fp32",
        )

    return _make


def _nan_on_forward(model: torch.nn.Module, call: int) -> None:
    """A model whose forward returns NaN on its ``call``-th call (a bug on one input)."""
    seen = {"n": 0}

    def hook(module, args, kwargs, output):
        seen["n"] += 1
        return output * float("nan") if seen["n"] == call else output

    model.register_forward_hook(hook, with_kwargs=True)


def test_a_nan_from_the_start_model_blames_the_model_and_applies_nothing(make_trainer, tmp_path):
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv)
        _nan_on_forward(trainer.model, 2)  # step 1, micro-batch 2
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(NonFiniteLoss) as err:
            trainer.fit()
    message = str(err.value)
    assert "\n" not in message and exit_code(err.value) == 1
    assert "at step 1: rank 0 (micro-batch 2, loss nan)" in message, message
    assert "before any update, so not the learning rate" in message, message
    assert "model, loss or data" in message and "nothing was trained yet" in message, message
    assert trainer.step == 0 and not CheckpointManager(RunDir(tmp_path)).list()
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was updated by the NaN step"


def test_a_nan_after_updates_checkpoints_the_last_good_step_and_names_the_lr(
    make_trainer, tmp_path
):
    """NaN in micro-batch 2 of step 3 with ``trainer.checkpoint_every=0``: step 2 is
    checkpointed (the model as it was after step 2: step 3 was not applied), its rows kept, and
    the line says how to continue."""
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, "optim.lr=0.002")
        _nan_on_forward(trainer.model, 2 * 3 + 2)  # three micro-batches a step
        with pytest.raises(NonFiniteLoss) as err:
            trainer.fit()
    message = str(err.value)
    assert "\n" not in message and err.value.step == 3
    assert "at step 3: rank 0 (micro-batch 2, loss nan)" in message, message
    assert "after 2 update(s) the training diverged: lower optim.lr (now 0.002)" in message
    assert "in fp32" not in message, message  # the rank already trains in fp32
    assert "checkpoint of step 2 written" in message and "trainer.resume=auto" in message
    (path,) = CheckpointManager(RunDir(tmp_path)).list()
    state = load_checkpoint(path)  # verifies its checksum
    assert state["step"] == 2 and trainer.step == 2
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, state["model"][key]), key
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2]


def test_a_resume_with_a_lower_lr_trains_with_it(make_trainer, tmp_path):
    """The fix the line advises: the checkpoint of step 2 resumed with ``optim.lr`` halved
    continues the schedule at step 3 with the new peak (the checkpoint's optimizer and
    scheduler states kept the old one)."""
    with single_process_rendezvous() as rdv:
        first = make_trainer(rdv, "optim.lr=0.002")
        first.train_step(1)
        first.train_step(2)
        state = first.state_dict()
        same = make_trainer(rdv, "optim.lr=0.002")
        same.load_state_dict(state, "ckpt")
        lowered = make_trainer(rdv, "optim.lr=0.001")
        lowered.load_state_dict(state, "ckpt")
        assert lowered.step == 2
        want = same.scheduler.get_last_lr()[0] / 2
        assert lowered.scheduler.get_last_lr()[0] == pytest.approx(want, rel=1e-12)
        assert all(g["lr"] == pytest.approx(want) for g in lowered.optimizer.param_groups)
        assert same.scheduler.get_last_lr() == first.scheduler.get_last_lr()  # exact resume
        assert lowered.train_step(3).lr == pytest.approx(want, rel=1e-12)


def test_the_advice_names_a_low_precision_rank():
    table = [
        StepStats(1.0, 4, 4, 0.1, 0.1, 0.0),
        StepStats(float("inf"), 4, 4, 0.1, 0.1, 0.0, bad_micro=3),
    ]
    message = str(nonfinite_error(7, table, 6, 1e-3, 20, ["fp32", "bf16"]))
    assert "at step 7: rank 1 (micro-batch 3, loss inf)" in message, message
    assert "rank 0" not in message
    assert "or train rank(s) 1 in fp32 (they compute in bf16" in message, message
