"""FSDP gradient accumulation without resharding between micro-batches (issue 22,
hetseq_hpc.train.fsdp_accumulation and Sharded.sync): the memory rule, the job-wide decision
and, on a one-rank FSDP2 world, the mechanism. The 2-rank runs are in
tests/integration/test_fsdp_accumulation.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from hetseq_hpc.balance.memory import (
    ModelBytes,
    gathered_bytes,
    kept_gathered_bytes,
    model_state_bytes,
    unit_bytes,
)
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.train.fsdp_accumulation import agree_on_accumulation, keep_unsharded_fits
from hetseq_hpc.train.parallel import Sharded
from tests.helpers.nets import TwoBlockNet
from tests.helpers.reports import rank_report

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 2.0**20


def test_kept_gathered_bytes_hold_every_weight_and_the_gradients_in_flight():
    p = 400 * MiB
    # every weight whole, the root's gradient and two blocks' gradients before the reduce-scatter
    assert kept_gathered_bytes(p, 10 * MiB, 50 * MiB) == p + 50 * MiB + 2 * 10 * MiB
    assert kept_gathered_bytes(p, 10 * MiB, 50 * MiB) > gathered_bytes(p, 10 * MiB, 50 * MiB)
    # never more than every weight and every gradient whole; no units: the root is everything
    assert kept_gathered_bytes(p, 0.0, p) == 2 * p
    assert kept_gathered_bytes(p, 10 * MiB) == 2 * p  # root unknown: all outside the block
    state = model_state_bytes(p, "fsdp", 4, 10 * MiB, root_bytes=50 * MiB, keep_gathered=True)
    assert state == p * 4 / 4 + p + 50 * MiB + 20 * MiB
    # validation's whole weights are inside the kept bytes already
    assert state == model_state_bytes(
        p, "fsdp", 4, 10 * MiB, gathered_weights=False, root_bytes=50 * MiB, keep_gathered=True
    )
    # offloaded shards: only the gathered bytes are on the device
    assert (
        model_state_bytes(
            p, "fsdp", 4, 10 * MiB, offload=True, root_bytes=50 * MiB, keep_gathered=True
        )
        == p + 70 * MiB
    )
    assert model_state_bytes(p, keep_gathered=True) == model_state_bytes(p)  # DDP: no change


def test_keep_unsharded_fits_the_state_and_the_largest_pass_in_the_budget():
    assert keep_unsharded_fits(60 * MiB, 100 * MiB, 10 * MiB, 4)  # 60 + 40 = 100: fits
    assert not keep_unsharded_fits(60 * MiB, 100 * MiB, 10 * MiB, 5)
    assert not keep_unsharded_fits(120 * MiB, 100 * MiB, 0.0, 1)


def _rdv(other: bool) -> FakeGang:
    """Two ranks: this one (rank 0) and another whose verdict is ``other``."""
    return FakeGang(world_size=2, rank=0, answers=[{1: other}])


def _share(samples, micro_sizes):
    return SimpleNamespace(samples=samples, micro_sizes=micro_sizes)


def _report(budget_mib, per_sample_mib):
    return rank_report(
        memory_budget_bytes=budget_mib * MiB, activation_bytes_per_sample=per_sample_mib * MiB
    )


def _cfg(setting):
    return SimpleNamespace(between_micro_batches=setting)


def _sharded():
    # 40 MiB model: root 8, largest block 4 -> on 2 ranks kept: shard 80 + 40 + 8 + 8 = 136 MiB
    return SimpleNamespace(
        sharded=True,
        offload=False,
        sizes=ModelBytes(40 * MiB, 8 * MiB, 4 * MiB),
        between_micro_batches="reshard",
    )


# [24, 8] in 5 and 2 passes: every rank runs 5; rank 0's largest pass has 5 samples
ACCUMULATING = SimpleNamespace(shares=[_share(24, [5, 5, 5, 5, 4]), _share(8, [4, 4])])


@pytest.mark.parametrize(
    "setting, budget, other, expected",
    [
        ("auto", 136 + 5 * 2, True, "keep_unsharded"),  # exactly fits here, fits the other rank
        ("auto", 136 + 5 * 2 - 1, True, "reshard"),  # 1 MiB short here
        ("auto", 1000, False, "reshard"),  # fits here, not on the other rank
        ("keep_unsharded", 1000, False, "keep_unsharded"),  # forced (with a warning)
    ],
)
def test_every_rank_must_fit_for_auto_to_keep_the_weights_gathered(
    setting, budget, other, expected, caplog
):
    parallel, rdv = _sharded(), _rdv(other)
    reports = [_report(budget, 2), _report(1000, 2)]
    caplog.set_level("INFO")
    assert agree_on_accumulation(_cfg(setting), parallel, ACCUMULATING, reports, rdv) == expected
    assert parallel.between_micro_batches == expected
    assert len(rdv.calls) == 1  # one all-gather of this rank's verdict
    assert f"sharding.between_micro_batches={setting} -> {expected}, 5 passes" in caplog.text
    if not other:
        assert "do not fit rank(s) [1]" in caplog.text
    assert ("may run out of memory" in caplog.text) == (setting == "keep_unsharded")


def test_a_step_of_one_pass_keeps_the_weights_gathered_from_forward_to_backward_where_they_fit(
    caplog,
):
    """Without accumulation ``auto`` still decides (one all-gather per unit per step instead
    of two: the backward gathers nothing) by the same memory rule."""
    single = SimpleNamespace(shares=[_share(24, [24]), _share(8, [8])])
    caplog.set_level("INFO")
    for budget, other, expected in ((1000, True, "keep_unsharded"), (1000, False, "reshard")):
        parallel, rdv = _sharded(), _rdv(other)
        reports = [_report(budget, 2), _report(1000, 2)]
        assert agree_on_accumulation(_cfg("auto"), parallel, single, reports, rdv) == expected
        assert parallel.between_micro_batches == expected
        assert len(rdv.calls) == 1
    assert "sharding.between_micro_batches=auto -> keep_unsharded, 1 passes" in caplog.text


def test_nothing_to_decide_under_reshard_or_ddp():
    rdv = _rdv(True)
    assert agree_on_accumulation(_cfg("reshard"), _sharded(), ACCUMULATING, [], rdv) == "reshard"
    assert (
        agree_on_accumulation(_cfg("auto"), SimpleNamespace(sharded=False), ACCUMULATING, [], rdv)
        == "ddp"
    )
    assert rdv.calls == []  # the same on every rank without a collective


def test_config_values():
    assert compose_run_config([]).sharding.between_micro_batches == "auto"
    run = compose_run_config(["sharding=fsdp", "sharding.between_micro_batches=reshard"])
    assert run.sharding.between_micro_batches == "reshard"
    with pytest.raises(
        ConfigError,
        match=r"sharding\.between_micro_batches='never' is unknown: "
        r"use auto, keep_unsharded, reshard",
    ):
        compose_run_config(["sharding.between_micro_batches=never"])


_Net = TwoBlockNet


def _accumulate(strategy, model, xs, seen):
    shares = [_share(len(xs), [1] * len(xs))]
    strategy.pass_sizes(shares[0], shares)
    for j, x in enumerate(xs):
        last = j == len(xs) - 1
        with strategy.sync(last):
            loss = model(x)
        loss.backward()
        seen.append(isinstance(model.blocks[0][0].weight, DTensor))
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


def test_the_weights_stay_gathered_between_passes_and_the_gradients_are_the_same():
    """One-rank FSDP2: under ``keep_unsharded`` the units' parameters stay gathered (plain
    tensors) after every pass but the last, which reshards them (DTensors again, for the
    optimizer); the accumulated gradients equal plain autograd's and resharding's."""
    torch.manual_seed(0)
    plain = _Net()
    xs = [torch.randn(3, 4) for _ in range(3)]
    with single_process_rendezvous():
        grads, seen = {}, {}
        for mode in ("plain", "reshard", "keep_unsharded"):
            model = _Net()
            model.load_state_dict(plain.state_dict())
            if mode == "plain":  # autograd's own accumulation on the whole model
                strategy = SimpleNamespace(
                    pass_sizes=lambda *a: None,
                    module=model,
                    sync=lambda last: contextlib.nullcontext(),
                )
            else:
                strategy = Sharded(model, list(model.blocks), torch.device("cpu"))
                strategy.between_micro_batches = mode
                assert strategy.sizes.block == 4 * (8 * 4 + 8)
            seen[mode] = []
            grads[mode] = _accumulate(strategy, strategy.module, xs, seen[mode])
            if mode == "keep_unsharded":
                assert strategy.describe()["between_micro_batches"] == "keep_unsharded"
                # the default again outside a step: validation reshards each unit after forward
                with torch.no_grad():
                    model(xs[0])
                assert isinstance(model.blocks[0][0].weight, DTensor)
        assert seen["reshard"] == [True, True, True]
        assert seen["keep_unsharded"] == [False, False, True]
        for name in grads["plain"]:
            assert torch.allclose(grads["plain"][name], grads["keep_unsharded"][name], atol=1e-6)
            assert torch.equal(grads["reshard"][name], grads["keep_unsharded"][name])


def test_a_step_of_one_pass_under_keep_unsharded_gathers_once_and_gives_the_same_gradients():
    """One-rank FSDP2, one pass: under ``keep_unsharded`` the units stay gathered from the
    forward into the backward (which then gathers nothing) and are resharded after it, for
    the optimizer; the gradients equal resharding's bit for bit."""
    torch.manual_seed(0)
    plain = _Net()
    x = torch.randn(3, 4)
    with single_process_rendezvous():
        grads, after_forward = {}, {}
        for mode in ("reshard", "keep_unsharded"):
            model = _Net()
            model.load_state_dict(plain.state_dict())
            strategy = Sharded(model, list(model.blocks), torch.device("cpu"))
            strategy.between_micro_batches = mode
            share = _share(3, [3])
            strategy.pass_sizes(share, [share])
            with strategy.sync(True):
                loss = model(x)
            after_forward[mode] = isinstance(model.blocks[0][0].weight, DTensor)
            loss.backward()
            assert isinstance(model.blocks[0][0].weight, DTensor)  # resharded for the step
            grads[mode] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        assert after_forward == {"reshard": True, "keep_unsharded": False}
        for name in grads["reshard"]:
            assert torch.equal(grads["reshard"][name], grads["keep_unsharded"][name])


@pytest.mark.parametrize(
    "setting, budget_mib, other, units, expected, calls",
    [
        ("auto", 1000, True, 4, True, 1),  # a replica fits every rank: one group
        ("auto", 1000, False, 4, False, 1),  # not on the other rank: each unit alone
        ("auto", 10, True, 4, False, 1),  # not here
        ("one", 10, False, 4, True, 0),  # forced, nothing gathered
        ("per_unit", 1000, True, 4, False, 0),
        ("auto", 1000, True, 1, False, 0),  # one unit: nothing to group
    ],
)
def test_the_units_are_grouped_where_a_replica_fits_every_rank(
    setting, budget_mib, other, units, expected, calls, caplog
):
    """``sharding.units``: ``auto`` groups the units when a full replica fits every rank (the
    same test as ``sharding.mode=auto``'s choice of DDP), so FSDP holds no more than DDP would;
    the verdicts are gathered once, and rank 0 logs the choice."""
    from hetseq_hpc.balance.agree import agree_on_units

    rdv = _rdv(other)
    caplog.set_level("INFO")
    assert agree_on_units(setting, 40 * MiB, budget_mib * MiB, units, rdv) is expected
    assert len(rdv.calls) == calls
    if calls:
        said = "one" if expected else "per_unit"
        assert f"sharding.units=auto -> {said}" in caplog.text


def test_grouped_units_give_the_same_gradients_and_count_as_one_block():
    """One-rank FSDP2 with the units as ONE group (``fully_shard`` of their list): the
    gradients equal those of one group per unit bit for bit, under both settings between
    passes, and the memory rules see the group as one block (the units' bytes together)."""
    torch.manual_seed(0)
    plain = _Net()
    xs = [torch.randn(3, 4) for _ in range(2)]
    with single_process_rendezvous():
        grads = {}
        for grouped in (False, True):
            for mode in ("reshard", "keep_unsharded"):
                model = _Net()
                model.load_state_dict(plain.state_dict())
                strategy = Sharded(model, list(model.blocks), torch.device("cpu"), grouped=grouped)
                strategy.between_micro_batches = mode
                assert strategy.describe()["units_grouped"] is grouped
                # fp32 bytes: the blocks hold 4x8+8 and 8x4+4 parameters; grouped, both
                assert strategy.sizes.block == 4 * ((8 * 4 + 8) + (8 * 4 + 4) if grouped else 40)
                # what a joining rank computes before it shards (worker: sizes.grouped())
                ungrouped = unit_bytes(plain, list(plain.blocks))
                assert strategy.sizes == (ungrouped.grouped() if grouped else ungrouped)
                grads[grouped, mode] = _accumulate(strategy, strategy.module, xs, [])
        for name in grads[False, "reshard"]:
            for key in grads:
                assert torch.equal(grads[False, "reshard"][name], grads[key][name]), (key, name)
