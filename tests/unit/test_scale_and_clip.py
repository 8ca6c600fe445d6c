"""The 1 / N gradient scale and the clip coefficient folded into one multiply
(:meth:`~hetseq_hpc.train.parallel.Replicated.scale_and_clip`): the same gradients and norm as
multiplying by 1 / N and then ``clip_grad_norm_`` (to float rounding), in one pass over the
gradients instead of two, with nothing read on the host."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hetseq_hpc.train.parallel import Replicated


class _CountMul(TorchDispatchMode):
    """Counts the ``_foreach_mul_`` ops dispatched (each is one pass over the gradients)."""

    def __init__(self):
        super().__init__()
        self.muls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._foreach_mul_:
            self.muls += 1
        return func(*args, **(kwargs or {}))


def _model_with_summed_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    model(torch.randn(32, 6)).pow(2).sum().backward()  # a SUM over 32 samples
    return model


@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e6], ids=["no-clip", "clipped", "not-reached"])
def test_one_pass_gives_the_two_pass_gradients_and_norm(max_norm):
    folded, reference = _model_with_summed_grads(), _model_with_summed_grads()
    grads = [p.grad for p in folded.parameters()]
    with _CountMul() as counted:
        norm = Replicated(folded, torch.device("cpu")).scale_and_clip(1 / 32, max_norm, grads)
    assert counted.muls == 1
    ref_grads = [p.grad for p in reference.parameters()]
    torch._foreach_mul_(ref_grads, 1 / 32)
    ref_norm = Replicated(reference, torch.device("cpu")).grad_norm_tensor(max_norm, ref_grads)
    assert norm.dim() == 0 and torch.allclose(norm, ref_norm, rtol=1e-6, atol=0)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-12)
    if max_norm == 1e-3:  # clipped to the bound
        after = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        assert after == pytest.approx(1e-3, rel=1e-4)
