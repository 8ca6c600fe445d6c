"""One rank trains the bare model, without a DDP wrapper
(:meth:`~hetseq_hpc.train.parallel.Replicated.start`): its all-reduce would be the identity.

In-process: a real world-size-1 gloo group and the small BERT. The paths whose hook changes the
gradients even on one rank (a compressed payload, Adasum) keep the wrapper.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from tests.helpers.trainers import one_rank_trainer


def test_one_rank_trains_the_bare_model_and_times_its_backward(tmp_path, token_cache):
    """No DDP on one rank; the step (2 micro-batches) still records its compute time (the
    Trainer marks the backward's end where no hook does) and trains every parameter."""
    with single_process_rendezvous() as rdv:
        trainer = one_rank_trainer(tmp_path, rdv, token_cache, global_batch=4, cap=2)
        assert trainer.parallel.module is trainer.model
        assert not isinstance(trainer.parallel.module, DDP)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        rec = trainer.train_step(1)
    mine = rec.per_rank[0]
    assert 0.0 < mine.compute_time_s <= mine.step_time_s
    assert rec.loss == rec.loss and rec.grad_norm > 0.0  # read, finite
    moved = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())]
    assert all(moved)


@pytest.mark.parametrize(
    "override", ["comm.grad_compression=bf16", "comm.grad_combine=adasum"], ids=["bf16", "adasum"]
)
def test_a_hook_that_changes_the_gradients_keeps_the_wrapper_on_one_rank(
    tmp_path, token_cache, override
):
    with single_process_rendezvous() as rdv:
        trainer = one_rank_trainer(tmp_path, rdv, token_cache, override)
        assert isinstance(trainer.parallel.module, DDP)
