"""Checks of the task contract shared by the task tests.

Each helper states one property the trainer relies on for exact uneven per-rank batches.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from hetseq_hpc.tasks.norms import find_batchnorm


def assert_split_invariant(task, positions: Sequence[int], epoch: int, cut: int) -> None:
    """``make_batch`` is a pure function of the positions: the same tensors on a second call,
    and the rows of ``positions[:cut]`` + ``positions[cut:]`` equal those of ``positions``."""
    whole = task.make_batch(positions, epoch, "train")
    again = task.make_batch(positions, epoch, "train")
    head = task.make_batch(positions[:cut], epoch, "train")
    tail = task.make_batch(positions[cut:], epoch, "train")
    assert set(whole) == set(again) == set(head) == set(tail)
    for key, value in whole.items():
        assert value.shape[0] == len(positions)
        assert torch.equal(value, again[key])
        assert torch.equal(value, torch.cat([head[key], tail[key]]))


def assert_model_contract(task, n: int):
    """A model built with seed 0 has no BatchNorm, reports positive FLOPs per sample, and its
    loss is a 0-dim float32 SUM: the loss of positions ``0..n-1`` equals the sum of the losses
    of its two halves (to 1e-5 relative: only the summation order differs). Returns the model."""
    torch.manual_seed(0)
    model = task.build_model()
    assert find_batchnorm(model) == []
    assert task.flops_per_sample(model) > 0
    with torch.no_grad():
        loss = model(**task.make_batch(list(range(n)), 0, "train"))
        halves = [
            model(**task.make_batch(list(range(a, b)), 0, "train"))
            for a, b in ((0, n // 2), (n // 2, n))
        ]
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert float(loss) == pytest.approx(float(halves[0] + halves[1]), rel=1e-5, abs=1e-5)
    return model


def fit(task, model, positions: Sequence[int], steps: int, lr: float) -> List[float]:
    """AdamW on one fixed batch, normalised by ``task.count`` as the trainer does; returns the
    mean loss per unit at each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = task.make_batch(list(positions), 0, "train")
    losses = []
    for _ in range(steps):
        loss = model(**batch) / task.count(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses
