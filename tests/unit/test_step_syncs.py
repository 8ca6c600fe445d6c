"""A steady-state Trainer step without host synchronisation, its batches built one step ahead.

In-process: a real world-size-1 gloo group (single_process_rendezvous), the real BERT task with
the small model. The synchronisations are counted with a ``TorchDispatchMode``
(:class:`~hetseq_hpc.train.sync_count.SyncCounter`): on a CPU nothing waits, but the calls it
counts are the ones that would on a GPU (tests/gpu asserts it with CUDA's sync debug mode).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.sync_count import SyncCounter
from hetseq_hpc.train.trainer import Trainer
from tests.helpers.trainers import one_rank_trainer

B = 8


@pytest.fixture
def make_trainer(tmp_path, token_cache):
    """``make_trainer(rdv, cap) -> Trainer`` on one CPU rank, micro-batches of at most ``cap``."""

    def _make(rdv, cap: int) -> Trainer:
        return one_rank_trainer(
            tmp_path, rdv, token_cache, "trainer.max_steps=6", global_batch=B, cap=cap
        )

    return _make


@pytest.mark.parametrize("cap", [B, 2], ids=["1-micro-batch", "4-micro-batches"])
def test_a_steady_state_step_synchronises_nothing_and_trains_the_same(make_trainer, cap):
    """Steps 2-4 read nothing from the device (0 counted calls, the previous step's loss read
    from its host copy included); their losses, read one step late, and the model are those
    of the same steps read at once."""
    with single_process_rendezvous() as rdv:
        late, now = make_trainer(rdv, cap), make_trainer(rdv, cap)
        assert late.can_defer()
        late.train_step(1, settle=False)
        counted = []
        records = []
        for step in (2, 3, 4):
            with SyncCounter() as counter:
                records.append(late.train_step(step, settle=False))
            counted.append(counter.summary())
        late.settle_pending()
        want = [now.train_step(step).loss for step in (1, 2, 3, 4)][1:]
    assert counted == [{}, {}, {}], counted
    assert [r.loss for r in records] == want
    for a, b in zip(late.model.parameters(), now.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cap", [B, 2], ids=["1-micro-batch", "4-micro-batches"])
def test_a_steady_state_fsdp_step_synchronises_nothing_and_trains_the_same(
    tmp_path, token_cache, cap
):
    """FSDP2 too: the gradient norm is all-reduced on the device from the shards (no
    ``full_tensor``, nothing read), so steps 2-4 count 0 synchronisations and train what the
    same steps read at once train."""
    with single_process_rendezvous() as rdv:
        late, now = (
            one_rank_trainer(
                tmp_path / name,
                rdv,
                token_cache,
                "trainer.max_steps=6",
                "trainer.grad_clip=0.5",
                global_batch=B,
                cap=cap,
                sharding="fsdp",
            )
            for name in ("late", "now")
        )
        assert late.parallel.sharded and late.can_defer()
        late.train_step(1, settle=False)
        counted, records = [], []
        for step in (2, 3, 4):
            with SyncCounter() as counter:
                records.append(late.train_step(step, settle=False))
            counted.append(counter.summary())
        late.settle_pending()
        want = [now.train_step(step) for step in (1, 2, 3, 4)][1:]
    assert counted == [{}, {}, {}], counted
    assert [r.loss for r in records] == [r.loss for r in want]
    assert [r.grad_norm for r in records] == [r.grad_norm for r in want]
    for a, b in zip(late.model.parameters(), now.model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_fsdp_with_cpu_offload_flag_faked_on_cpu_still_reads_every_step(tmp_path, token_cache):
    """``sharding.cpu_offload`` (GPUs only: its flag is set by hand here, on a CPU rank) keeps
    the shards and their norm on the CPU and the loss on the GPU: such a step is read at once."""
    with single_process_rendezvous() as rdv:
        trainer = one_rank_trainer(tmp_path, rdv, token_cache, global_batch=B, sharding="fsdp")
        assert trainer.can_defer()
        trainer.parallel.offload = True
        assert not trainer.can_defer()


def test_the_counter_sees_what_a_gpu_would_wait_for():
    """The counter itself: ``.item()``, a boolean mask and ``nonzero`` are counted, a gather by
    index is not."""
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.sum().item()
        _ = x[x > 2]
        _ = (x > 2).nonzero()
        _ = x.index_select(0, torch.tensor([1, 2]))
    assert counter.total == 3, counter.summary()


def test_a_split_changed_after_the_prefetch_rebuilds_the_batches(make_trainer):
    """Step 2's batches were built under the first split while step 1 ran; a re-balance to
    another split drops them: step 2 trains the new split's micro-batches (its loss is the
    mean over them, computed here from the model before step 2)."""
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, 2)
        trainer.train_step(1)
        assert trainer.batches._pending is not None  # step 2 is being built
        trainer.allocation = allocate([1.0], B, [3])  # micro-batches [3, 3, 2]
        before = copy.deepcopy(trainer.model)
        epoch, micro = trainer.sampler.rank_micro_batches(1, 0, [3, 3, 2])
        batches = [trainer.task.make_batch(list(p), epoch, "train") for p in micro]
        with torch.no_grad():
            total = sum(float(before(**b)) for b in batches)
        count = sum(trainer.task.count(b) for b in batches)
        rec = trainer.train_step(2)
    assert trainer.batches.rebuilt == 1
    assert rec.per_rank[0].count == count
    assert rec.loss == pytest.approx(total / count, rel=1e-6)


def test_a_nan_read_one_step_late_names_its_step_and_applies_nothing(make_trainer, tmp_path):
    """A NaN in step 3, a deferred step: the device skipped its update; step 4 reads it and
    stops, naming step 3; step 3's host state (the scheduler) is undone and step 2 is the
    model checkpointed."""
    from hetseq_hpc.errors import NonFiniteLoss
    from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint

    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, 2)
        calls = {"n": 0}

        def hook(module, args, kwargs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] == 2 * 4 + 1 else output

        trainer.model.register_forward_hook(hook, with_kwargs=True)
        with pytest.raises(NonFiniteLoss) as err:
            trainer.fit()
        assert calls["n"] == 4 * 4, "step 4 ran: step 3 was read one step late"
        lr_after_two = trainer.scheduler.get_last_lr()
    assert err.value.step == 3 and "at step 3: rank 0 (micro-batch 1, loss nan)" in str(err.value)
    (path,) = CheckpointManager(RunDir(tmp_path)).list()
    state = load_checkpoint(path)
    assert state["step"] == 2 and trainer.step == 2
    assert state["scheduler"]["last_epoch"] == 2 and lr_after_two == state["scheduler"]["_last_lr"]
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, state["model"][key]), key


def test_the_mlm_head_gathers_masked_tokens_by_index_with_the_same_loss(make_trainer):
    """BERT's batches carry ``masked_positions`` (built on the CPU): the head's gather by index
    gives the boolean-mask loss and gradients, and its forward and backward synchronise
    nothing (the boolean mask: 3 calls, two masks and a nonzero in the backward)."""
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, B)
    model = trainer.model
    batch = trainer.task.make_batch(list(range(B)), 0, "train")
    assert batch["masked_positions"].shape[0] == B
    plain = {k: v for k, v in batch.items() if k != "masked_positions"}
    with SyncCounter() as by_index:
        loss = model(**batch)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SyncCounter() as by_mask:
        want = model(**plain)
        want.backward()
    assert by_index.total == 0 and by_mask.total >= 2, (by_index.summary(), by_mask.summary())
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    for got, ref in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
