"""The framework-neutral part of the integrations (hetseq_hpc.integrations.engine, .data and
.lightning_logs), in-process: which positions form a global batch, how an agreed split cuts
them, the step loader's items and refusals, and how ``self.log`` values of uneven
micro-batches combine into the exact mean of the global batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.errors import AllocationError, ConfigError
from hetseq_hpc.integrations.data import (
    StepBatch,
    loader_spec,
    lookahead,
    step_loader,
)
from hetseq_hpc.integrations.engine import GlobalOrder, HetSeqSettings, SplitSchedule
from hetseq_hpc.integrations.lightning_logs import LogCapture


def test_settings_refuse_a_split_that_does_not_sum_to_the_global_batch():
    with pytest.raises(
        ConfigError, match=r"allocation=\[24, 4\] is invalid: .* summing to global_batch_size=32"
    ):
        HetSeqSettings(global_batch_size=32, allocation=(24, 4))
    with pytest.raises(ConfigError, match="global_batch_size=0 is invalid"):
        HetSeqSettings(global_batch_size=0)
    with pytest.raises(ConfigError, match="max_micro_batch=0 is invalid"):
        HetSeqSettings(global_batch_size=8, max_micro_batch=0)


def test_rebalancing_is_off_for_a_forced_split_unless_asked():
    assert HetSeqSettings(global_batch_size=8).rebalance_interval == 10
    assert HetSeqSettings(global_batch_size=8, allocation=(6, 2)).rebalance_interval == 0
    assert (
        HetSeqSettings(global_batch_size=8, allocation=(6, 2), rebalance_every=3).rebalance_interval
        == 3
    )


def test_global_batches_depend_on_the_step_only_and_cover_each_epoch_once():
    order = GlobalOrder(num_samples=50, global_batch_size=8, seed=3, shuffle=True)
    assert order.steps_per_epoch == 6
    epoch0 = np.concatenate([order.positions(k) for k in range(6)])
    assert len(set(epoch0.tolist())) == 48  # a permutation, the tail of 2 dropped
    again = GlobalOrder(num_samples=50, global_batch_size=8, seed=3, shuffle=True)
    assert np.array_equal(again.positions(7), order.positions(7))
    assert not np.array_equal(order.positions(6), order.positions(0))  # reshuffled per epoch
    plain = GlobalOrder(num_samples=50, global_batch_size=8, seed=3, shuffle=False)
    assert plain.positions(7).tolist() == list(range(8, 16))
    with pytest.raises(ConfigError, match="exceeds the 5 training samples"):
        GlobalOrder(num_samples=5, global_batch_size=8, seed=0, shuffle=True)


def test_every_rank_cuts_its_slice_into_its_micro_batches_and_switches_only_ahead():
    order = GlobalOrder(num_samples=64, global_batch_size=32, seed=0, shuffle=True)
    split = allocate([1.0, 1.0], 32, [8, 8], forced=[24, 8])
    schedule = SplitSchedule(split)
    rank0 = schedule.micro_positions(order, 0, 0)
    rank1 = schedule.micro_positions(order, 0, 1)
    assert [len(m) for m in rank0] == [8, 8, 8] and [len(m) for m in rank1] == [8]
    assert np.array_equal(np.concatenate(rank0 + rank1), order.positions(0))
    moved = allocate([1.0, 1.0], 32, [8, 8], forced=[16, 16])
    schedule.switch(moved, 2)
    assert [len(m) for m in schedule.micro_positions(order, 1, 0)] == [8, 8, 8]
    assert [len(m) for m in schedule.micro_positions(order, 2, 0)] == [8, 8]
    with pytest.raises(AllocationError, match="already cut batch 2"):
        schedule.switch(moved, 2)


def test_the_step_loader_yields_one_item_per_step_with_the_rank_share():
    data = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40))
    spec = loader_spec(DataLoader(data, batch_size=4, shuffle=False), seed=0)
    order = GlobalOrder(len(data), 10, 0, spec.shuffle)
    schedule = SplitSchedule(allocate([1.0, 1.0], 10, [3, 8], forced=[7, 3]))
    loader = step_loader(spec, order, lambda: schedule, rank=0, start=lambda: 2)
    assert len(loader) == 4  # steps per epoch, whatever the split
    item = next(iter(loader))
    assert isinstance(item, StepBatch)
    assert item.index == 2 and item.sizes == [3, 2, 2]
    xs = torch.cat([x for x, _ in item.micro_batches]).squeeze(1).tolist()
    assert xs == [20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0]  # rank 0's 7 of global batch 2


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_the_step_loader_refuses_what_it_cannot_cut_in_one_line():
    data = TensorDataset(torch.zeros(8, 1))
    with pytest.raises(ConfigError, match=r"IterableDataset .* give a map-style dataset"):
        loader_spec(DataLoader(_Stream()), seed=0)
    sampler = WeightedRandomSampler([1.0] * 8, 8)
    with pytest.raises(ConfigError, match="its own sampler \\(WeightedRandomSampler\\)"):
        loader_spec(DataLoader(data, sampler=sampler), seed=0)
    with pytest.raises(ConfigError, match="replacement"):
        loader_spec(
            DataLoader(data, sampler=torch.utils.data.RandomSampler(data, replacement=True)), seed=0
        )
    assert lookahead({"num_workers": 2, "prefetch_factor": 3}) == 6
    assert lookahead({"num_workers": 0}) == 0


def test_logged_means_of_uneven_micro_batches_combine_to_the_global_mean():
    # rank 0: micro-batches of 3 and 1 samples; rank 1: one of 4. Per-sample losses:
    samples = {0: [[1.0, 2.0, 3.0], [10.0]], 1: [[4.0, 4.0, 4.0, 4.0]]}
    captures = {}
    for rank, micros in samples.items():
        cap = LogCapture()
        for micro in micros:
            call = {
                "name": "loss",
                "value": torch.tensor(sum(micro) / len(micro)),
                "reduce_fx": "mean",
                "sync_dist": True,
                "batch_size": None,
            }
            cap.record("loss", call["value"], call, weight=len(micro))
            cap.record(
                "peak", max(micro), {**call, "reduce_fx": "max", "sync_dist": False}, len(micro)
            )
        captures[rank] = cap
    tables = [captures[r].table() for r in (0, 1)]
    value, weight = captures[0].results(tables)["loss"]
    assert weight == 8 and value == pytest.approx(32.0 / 8)  # the mean over all 8 samples
    assert captures[0].results(tables)["peak"][0] == 10.0  # not synchronised: rank 0's own
    assert "peak" not in tables[0]
    with pytest.raises(ConfigError, match="reduce_fx='median'"):
        LogCapture().record("x", 1.0, {"reduce_fx": "median"}, 1.0)
    with pytest.raises(ConfigError, match="tensor of shape \\(2,\\)"):
        LogCapture().record("x", torch.ones(2), {"reduce_fx": "mean"}, 1.0)


class _SumLoss(torch.nn.Module):
    """forward(positions) -> the SUM of a per-sample loss, as calibration times it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, positions):
        x = torch.ones(len(positions), 4) * positions.float().unsqueeze(1)
        return self.lin(x).pow(2).sum()


def test_a_one_rank_world_calibrates_agrees_and_exchanges_with_a_fixed_layout():
    from hetseq_hpc.distributed.rendezvous import StepStats, single_process_rendezvous
    from hetseq_hpc.integrations.engine import Balancer, global_loss

    stats = StepStats(
        loss_sum=6.0, count=4, samples=4, compute_time_s=0.1, step_time_s=0.1, data_time_s=0.0
    )
    with single_process_rendezvous() as rdv:
        balancer = Balancer(
            HetSeqSettings(global_batch_size=8, max_micro_batch=3, calibration_steps=2), rdv
        )
        split = balancer.agree(
            _SumLoss(), lambda n: {"positions": torch.arange(n)}, torch.device("cpu")
        )
        assert split.samples == [8] and split.shares[0].accum_steps == 3  # the cap: 3, 3, 2
        assert balancer.rebalancer is None  # one rank: nothing to move
        table = {"loss": ("mean", 6.0, 4.0)}
        per_rank, tables = balancer.exchange(stats, table)  # objects: the layout is agreed
        assert balancer._names == ("loss",) and tables == [table]
        per_rank, tables = balancer.exchange(stats, {"loss": ("mean", 2.0, 4.0)})  # floats
        assert tables == [{"loss": ("mean", 2.0, 4.0)}]
        assert per_rank[0].samples == 4 and global_loss(per_rank) == 1.5
        changed = {"loss": ("mean", 2.0, 4.0), "acc": ("max", 0.5, 4.0)}
        per_rank, tables = balancer.exchange(stats, changed)  # a new name: objects once more
        assert tables == [changed] and balancer._names == ("acc", "loss")
