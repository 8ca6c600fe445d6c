"""BatchNorm detection (hetseq_hpc.tasks.norms): every _BatchNorm kind is found and refused in
one line naming the layer and the fixes; the opt-out warns and returns a summary record."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks.norms import OPT_OUT, check_no_batchnorm, find_batchnorm


class MyBatchNorm(nn.BatchNorm2d):
    """A user subclass: still BatchNorm."""


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm1d(4),
        nn.BatchNorm2d(4),
        nn.BatchNorm3d(4),
        nn.SyncBatchNorm(4),
        nn.LazyBatchNorm1d(),
        nn.LazyBatchNorm2d(),
        nn.LazyBatchNorm3d(),
        MyBatchNorm(4),
    ],
)
def test_every_batchnorm_kind_is_found(layer):
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(layer))
    assert find_batchnorm(model) == [("1.0", type(layer).__name__)]


def test_per_sample_norms_are_not_batchnorm():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.GroupNorm(2, 4),
        nn.InstanceNorm2d(4),
        nn.LayerNorm(4),
        nn.LocalResponseNorm(2),
    )
    assert find_batchnorm(model) == []
    assert check_no_batchnorm(model, allow=False) is None


def test_root_module_batchnorm_is_named():
    assert find_batchnorm(nn.BatchNorm1d(3)) == [("<model>", "BatchNorm1d")]


def test_refused_in_one_line_naming_first_layer_and_fixes():
    model = nn.Sequential()
    model.add_module("stem", nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)))
    model.add_module("head_norm", nn.BatchNorm1d(4))
    with pytest.raises(ConfigError) as info:
        check_no_batchnorm(model, allow=False)
    message = str(info.value)
    assert "\n" not in message
    assert "'stem.1' is BatchNorm2d (and 1 more)" in message
    assert "GroupNorm" in message and "LayerNorm" in message and OPT_OUT in message


def test_opt_out_warns_and_returns_record(caplog):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with caplog.at_level(logging.WARNING, logger="hetseq_hpc.tasks.norms"):
        record = check_no_batchnorm(model, allow=True)
    assert record["exact"] is False
    assert record["batchnorm_layers"] == [["1", "BatchNorm1d"]]
    assert "'1'" in record["reason"]
    assert any("NOT exact" in r.getMessage() for r in caplog.records)
