"""``task=dataset`` with the datasets a user may get wrong, in-process: an empty or
iterable one is one line as soon as ``build`` returns (before any item is read), a 10**12-item
one trains without an O(len) table (the sampler's order up to TABLE_MAX items is numpy's, as
before: exactness and resume unchanged), ragged items name ``collate_fn``, and a MEAN
``loss_fn`` is named as the user wrote it. Builds: tests/helpers/odd_datasets.py."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.errors import ConfigError, TaskContractError
from hetseq_hpc.launch.failures import first_failure
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.contract_check import check_task_contract, contract_positions
from hetseq_hpc.train.sampler import TABLE_MAX, GlobalBatchSampler, feistel_permute

TARGET = "task.target=tests.helpers.odd_datasets:build"


def _task(*overrides: str, target: str = TARGET):
    run = compose_run_config(["task=dataset", target, *overrides])
    task = build_task(run.task, 0)
    return task


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["+task.args.n=0"], "returned an empty 'train' Dataset: return one with at least"),
        (["+task.args.val=0"], "returned an empty 'val' Dataset: return a non-empty one, or no"),
        (
            ["+task.args.n=1", "task.val_fraction=0.4"],
            "task.val_fraction=0.4 holds out 1 of the 1 items",
        ),
        (["+task.args.stream=true"], "a map-style Dataset with len() and [i]"),
    ],
    ids=["empty-train", "empty-val", "all-held-out", "iterable"],
)
def test_a_dataset_that_cannot_train_is_one_line_when_build_returns(overrides, words):
    task = _task(*overrides)
    with pytest.raises(ConfigError) as info:
        task.load()
    message = str(info.value)
    assert words in message and "tests.helpers.odd_datasets:build" in message, message
    assert "\n" not in message


def test_a_huge_dataset_is_shuffled_without_a_table_of_its_length():
    """len() = 10**12: a global batch costs O(B) memory (numpy's permutation would ask for
    7.3 TiB); its positions are distinct, in range, the same every time, and the ranks' slices
    tile it."""
    task = _task("+task.args.n=1000000000000")
    task.load()
    assert task.num_train == 10**12
    sampler = GlobalBatchSampler(task.num_train, 8, seed=5)
    tracemalloc.start()
    try:
        epoch, positions = sampler.global_batch(123_456_789)
        _, micro = sampler.rank_micro_batches(123_456_789, 3, [2, 3])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes for one global batch"
    assert epoch == 0 and positions.dtype == np.int64 and len(set(positions.tolist())) == 8
    assert all(0 <= p < 10**12 for p in positions.tolist())
    assert np.array_equal(positions, sampler.global_batch(123_456_789)[1])
    assert np.array_equal(np.concatenate(micro), positions[3:8])
    first = contract_positions(task.num_train, 0)  # what the contract check reads
    assert len(first) == 8 and task.make_batch(first, 0, "train")["x"].shape == (8, 4)


def test_the_lazy_order_is_a_permutation_and_the_table_order_is_numpys():
    for n in (1, 2, 3, 10, 1000, 4099):
        order = feistel_permute(np.arange(n, dtype=np.uint64), n, seed=1, epoch=2)
        assert sorted(order.tolist()) == list(range(n)), n
    other = feistel_permute(np.arange(1000, dtype=np.uint64), 1000, seed=1, epoch=3)
    assert not np.array_equal(other, feistel_permute(np.arange(1000, dtype=np.uint64), 1000, 1, 2))
    want = np.random.default_rng([7, 0]).permutation(1000)[4:8]  # up to TABLE_MAX: numpy's
    assert np.array_equal(GlobalBatchSampler(1000, 4, seed=7).global_batch(1)[1], want)
    tracemalloc.start()
    try:  # one more: no table
        GlobalBatchSampler(TABLE_MAX + 1, 4, seed=7).global_batch(1)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_ragged_items_name_collate_fn():
    task = _task("+task.args.ragged=true")
    task.load()
    with pytest.raises(TaskContractError) as info:
        task.make_batch([0, 1], 0, "train")
    message = str(info.value)
    assert "items at positions [0, 1]" in message and "default_collate" in message
    assert "return 'collate_fn' from the build function" in message and "\n" not in message


def test_a_mean_loss_fn_is_named_as_the_user_wrote_it():
    task = _task(target="task.target=tests.helpers.odd_datasets:build_mean")
    task.load()
    model = task.build_model()
    with pytest.raises(TaskContractError) as info:
        check_task_contract(task, model, torch.device("cpu"), FakeGang(), 0)
    message = str(info.value)
    assert message.startswith(
        "loss_fn tests.helpers.odd_datasets.mean_loss (from "
        "task.target='tests.helpers.odd_datasets:build_mean') gave a loss of"
    ), message
    assert "MEAN" in message and "(rank" not in message and "forward(**batch)" not in message


def test_the_same_error_on_every_rank_is_blamed_on_the_lowest_rank():
    """Every rank raises a task's contract or data error; whichever wrote its file first, the
    launcher names rank 0 (it said "rank 1 failed (... (rank 0))")."""
    error = {"type": "TaskContractError", "message": "loss_fn m.f gave a MEAN"}
    errors = {0: {**error, "time": 2.0}, 1: {**error, "time": 1.0}}
    assert first_failure({0: 1, 1: 1}, errors) == 0
    errors[0] = {"type": "ValueError", "message": "other", "time": 2.0}
    assert first_failure({0: 1, 1: 1}, errors) == 1  # different errors: the earliest
