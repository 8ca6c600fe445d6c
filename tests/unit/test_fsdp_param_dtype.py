"""FSDP2 gathers parameters in bf16 when every rank computes in bf16
(:func:`~hetseq_hpc.train.precision.fsdp_param_dtype`), the sharded master weights, their
gradients and the optimizer state staying fp32; ranks that disagree keep fp32 gathers.
In-process: a real world-size-1 gloo group (FSDP2 runs on CPU). The uneven 2-rank bf16 run
against the 1-rank bf16 reference is in tests/integration/test_sharding_exact.py."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.train.parallel import Sharded
from hetseq_hpc.train.precision import fsdp_param_dtype
from tests.helpers.nets import TwoBlockNet


@pytest.mark.parametrize(
    "precisions, dtype",
    [
        (["bf16", "bf16"], torch.bfloat16),
        (["bf16", "fp32"], None),
        (["bf16", "fp16"], None),
        (["bf16", None], None),  # a rank that said nothing computes in fp32
        (["fp16", "fp16"], None),
        ([], None),
    ],
)
def test_bf16_gathers_only_when_every_rank_computes_in_bf16(precisions, dtype):
    got, why = fsdp_param_dtype(precisions)
    assert got == dtype and why


@pytest.mark.parametrize("precisions", [["bf16"], ["fp32"]], ids=["bf16", "fp32"])
def test_the_gathered_weights_are_bf16_the_master_weights_and_grads_fp32(
    precisions: List[Optional[str]],
):
    torch.manual_seed(0)
    net = TwoBlockNet()
    seen: List[torch.dtype] = []
    for block in net.blocks:
        block.register_forward_pre_hook(lambda m, _: seen.append(m[0].weight.dtype))
    with single_process_rendezvous():
        shard = Sharded(net, list(net.blocks), torch.device("cpu"), precisions=precisions)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(torch.randn(5, 4)).backward()
    want = torch.bfloat16 if precisions == ["bf16"] else torch.float32
    assert seen == [want, want]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in net.parameters())
    described = shard.describe()
    assert described["all_gather_dtype"] == ("bf16" if want == torch.bfloat16 else "fp32")
    assert described["reduce_dtype"] == "fp32" and described["all_gather_dtype_why"]
