"""One Trainer step in-process: a real world-size-1 gloo group (single_process_rendezvous), the
real BERT task with the small model, and state_dict / load_state_dict through real checkpoint
files. (The exchange on two real processes: tests/integration/test_rendezvous_two_ranks.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from hetseq_hpc.distributed.rendezvous import StepStats, single_process_rendezvous
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, load_checkpoint
from hetseq_hpc.train.parallel import Replicated
from hetseq_hpc.train.trainer import Trainer
from tests.helpers.trainers import one_rank_trainer

B = 8  # global batch; micro-batch cap 3 -> micro-batches [3, 3, 2] accumulated under no_sync


@pytest.fixture
def make_trainer(tmp_path, token_cache):
    """``make_trainer(rdv, *overrides) -> Trainer`` on one CPU rank, run dir ``tmp_path``."""

    def _make(rdv, *overrides: str) -> Trainer:
        return one_rank_trainer(tmp_path, rdv, token_cache, *overrides, global_batch=B, cap=3)

    return _make


def test_one_step_is_the_mean_loss_of_the_global_batch(make_trainer):
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv)
        assert trainer.allocation.shares[0].micro_sizes == [3, 3, 2]
        before = copy.deepcopy(trainer.model)
        _, positions = trainer.sampler.global_batch(0)
        batch = trainer.task.make_batch(positions, 0, "train")
        with torch.no_grad():
            want = float(before(**batch)) / trainer.task.count(batch)
        rec = trainer.train_step(1)
    assert rec.step == 1 and trainer.step == 1 and rec.stop_code == 0
    (stats,) = rec.per_rank
    assert isinstance(stats, StepStats) and stats.samples == B
    assert stats.count == trainer.task.count(batch) and isinstance(stats.count, int)
    assert rec.loss == pytest.approx(want, rel=1e-6)
    assert stats.loss_sum == pytest.approx(want * stats.count, rel=1e-6)
    changed = [
        not torch.equal(a, b) for a, b in zip(before.parameters(), trainer.model.parameters())
    ]
    assert any(changed), "the optimizer did not step"


def test_state_dict_round_trip_repeats_the_next_step(make_trainer, tmp_path):
    """save_checkpoint(trainer.state_dict()) / trainer.load_state_dict(load_checkpoint(...)):
    a fresh trainer resumed after step 1 computes step 2 exactly like the original."""
    with single_process_rendezvous() as rdv:
        first = make_trainer(rdv)
        first.train_step(1)
        path = CheckpointManager(RunDir(tmp_path), keep=2).write(first.state_dict(), 1)
        want = first.train_step(2).loss
        second = make_trainer(rdv)
        second.load_state_dict(load_checkpoint(path), str(path))
        assert second.step == 1
        got = second.train_step(2).loss
    assert got == want


def test_load_state_dict_checks_the_run(make_trainer, tmp_path):
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv)
        state = trainer.state_dict()
        other = make_trainer(rdv, "trainer.seed=2")
        with pytest.raises(CheckpointError) as err:
            other.load_state_dict(state, "ckpt.pt")
        message = str(err.value)
        assert "\n" not in message
        assert "trained with trainer.seed=1; this run has trainer.seed=2" in message
        assert "trainer.allow_resume_mismatch=true" in message
        allowed = make_trainer(rdv, "trainer.seed=2", "trainer.allow_resume_mismatch=true")
        allowed.load_state_dict(state, "ckpt.pt")  # an explicit override continues
        no_model = {k: v for k, v in state.items() if k != "model"}
        with pytest.raises(CheckpointError, match=r"'ckpt\.pt' has no model entry"):
            trainer.load_state_dict(no_model, "ckpt.pt")


def test_measured_step_sync_is_the_median_wall_beyond_the_slowest_ranks_busy_time():
    """Synthetic step records: walls of 0.30 s, busy 0.20 + 0.05 and 0.25 + 0.02 s -> sync
    0.03 s; the step after a switch and the steps of the old split are left out."""
    from types import SimpleNamespace

    from hetseq_hpc.train.metrics import measured_step_sync

    def rec(end_s, samples, busy=((0.20, 0.05), (0.25, 0.02))):
        per_rank = [
            StepStats(
                loss_sum=0.0,
                count=b,
                samples=b,
                step_time_s=0.0,
                data_time_s=0.0,
                compute_time_s=c,
                tail_time_s=t,
            )
            for b, (c, t) in zip(samples, busy)
        ]
        return SimpleNamespace(per_rank=per_rank, ended_s=end_s)

    old = [rec(1.0 * i, [16, 16], ((0.9, 0.0), (0.9, 0.0))) for i in range(1, 4)]
    new = [rec(3.0 + 0.5, [24, 8]), *(rec(3.5 + 0.3 * i, [24, 8]) for i in range(1, 6))]
    got = measured_step_sync(old + new, [24, 8])
    assert got["steps"] == 5 and got["samples"] == [24, 8]
    assert got["step_s"] == pytest.approx(0.30) and got["busy_s"] == [0.25, 0.27]
    assert got["sync_s"] == pytest.approx(0.03)
    assert measured_step_sync(old + new[:3], [24, 8]) is None  # two steps only


def test_cpu_ranks_post_their_statistics_when_the_last_bucket_is_ready(make_trainer, monkeypatch):
    """The exchange overlaps the gradient all-reduce: the statistics are posted from the DDP
    hook of the step's last bucket (inside the last backward pass), once per step, with the
    compute time measured up to that bucket, and the loss is still the global batch's. (One
    rank is wrapped in DDP here, as a world of several is, to run its hooks in-process.)"""
    monkeypatch.setattr(Replicated, "wrap_one_rank", True)
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, "comm.bucket_cap_mb=0.05")  # several buckets
        events = []
        post, backward = rdv.post_step_stats, trainer.grad_path.backward

        def recording_post(stats):
            events.append(("post", trainer.hook_state.last_ready_s, stats))
            return post(stats)

        def recording_backward(*args, **kwargs):
            backward(*args, **kwargs)
            events.append(("backward", None, None))

        rdv.post_step_stats = recording_post
        trainer.grad_path.backward = recording_backward
        for step in (1, 2):
            rec = trainer.train_step(step)
            kinds = [kind for kind, _, _ in events]
            # three micro-batches: the post comes inside the third (last) backward pass
            assert kinds == ["backward", "backward", "post", "backward"], kinds
            ((_, ready_s, stats),) = [e for e in events if e[0] == "post"]
            assert ready_s > 0 and stats.compute_time_s <= stats.step_time_s
            assert rec.per_rank[0].count == stats.count and rec.per_rank[0].samples == B
            events.clear()


def test_no_rebalancing_decision_after_the_last_step_or_a_stop(make_trainer):
    """A split decided when no step follows would never run, yet it would become the run's final
    allocation.json (and the split whose synchronisation it reports): no decision is taken at
    ``trainer.max_steps`` nor at a stop request's step."""
    with single_process_rendezvous() as rdv:
        trainer = make_trainer(rdv, "trainer.max_steps=3", "balance.rebalance_every=1")
        asked = []

        class Always:
            def record(self, per_rank):
                pass

            def speed_changed(self, allocation):
                return True

            def due(self, step, every, allocation):  # the loop's schedule (Rebalancer.due)
                return True

            def observe(self, step, allocation):
                asked.append(step)
                return None

        trainer.rebalancer = Always()
        rec = trainer.train_step(1)
        trainer.maybe_rebalance(rec)
        assert asked == [1]
        rec.stop_code = 1
        trainer.maybe_rebalance(rec)
        rec.stop_code, rec.step = 0, 3
        trainer.maybe_rebalance(rec)
        assert asked == [1], "a decision after the last step or a stop"
