"""A mixed-device job on one GPU machine (issue 43): ``cluster.devices=[cuda,cpu]``, one rank
on the GPU and one on the CPU, both over gloo (gloo all-reduces CUDA tensors through host
memory; NCCL cannot reach the CPU rank). Skipped where CUDA is absent (CI, the 2-core
machine); ``scripts/gpu_check.sh`` runs it on a lent GPU (step 5). Nothing is faked: a real
GPU, a real CPU rank beside it, real gloo.

Exactness across devices: both ranks in fp32 (``precision=fp32``, TF32 off, as PyTorch's
default for matmuls; ``trainer.compile=off``), the 1-rank GPU run and the split run add the
same per-token losses, part of them computed by CPU kernels, in a different order. The bar is
the CPU tests' 1e-5 relative (:data:`tests.helpers.runs.REL_TOL`; ~2e-7 measured there, and
> 1e-3 for a wrong weighting of uneven batches: tests/integration/test_training.py). Across
devices it is expected to hold (kernels differ in the last bits) but was not yet measured:
``scripts/gpu_check.sh`` runs this test and reports the worst difference.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import SMALL_MODEL, assert_ok, assert_same_losses, hetseq, losses

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA (runs on a lent GPU: scripts/gpu_check.sh step 5)",
)

EXACT = [
    *SMALL_MODEL,
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.seed=7",
    "trainer.plot=false",
    "trainer.compile=off",
    "trainer.global_batch_size=32",
    "trainer.max_steps=20",
    "precision=fp32",
]


def test_a_gpu_and_a_cpu_rank_over_gloo_match_one_gpu_rank_needs_cuda(tmp_path, token_cache):
    """``cluster.devices=[cuda,cpu]`` with the measured split logs the 1-rank GPU run's loss
    at all 20 steps; allocation.json and summary.json put rank 0 on the GPU and rank 1 on the
    CPU, each with a share, and both ranks joined with gloo."""
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    assert_ok(hetseq(*EXACT, "cluster.ranks=1", f"hydra.run.dir={one}", token_cache=token_cache))
    assert_ok(
        hetseq(
            *EXACT, "cluster.devices=[cuda,cpu]", f"hydra.run.dir={mixed}", token_cache=token_cache
        )
    )
    alloc = json.loads((mixed / "allocation.json").read_text())
    assert [r["probe"]["kind"] for r in alloc["ranks"]] == ["cuda", "cpu"], alloc["ranks"]
    shares = [s["samples"] for s in alloc["allocation"]["shares"]]
    assert sum(shares) == 32 and min(shares) >= 1, shares
    assert alloc["allocation"]["source"] in ("cost_curve", "rebalanced")
    summary = json.loads((mixed / "summary.json").read_text())
    devices = [r["device"] for r in summary["ranks"]]
    assert devices[0].startswith("cuda:0 ") and devices[1].startswith("cpu "), devices
    for rank in (0, 1):
        assert " with gloo " in (mixed / "logs" / f"rank{rank}.log").read_text()
    assert_same_losses(losses(one), losses(mixed), range(1, 21))
