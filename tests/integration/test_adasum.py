"""The gradient-combine hooks on real gloo process groups: Adasum against a hand-written
reference for world sizes 2 and 4, and the compressed SUM all-reduce; a real Adasum run says it
is not the exact update.

A tiny module whose gradient is chosen by the test: ``f(u, v) = w.u + b.v`` has
``grad w = u`` and ``grad b = v``. Rank ``r`` feeds its own ``u_r, v_r`` and reports ``n_r`` loss
units, so its own mean gradient is ``(u_r / n_r, v_r / n_r)``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetseq_hpc.env.world import free_port
from hetseq_hpc.train.ddp_hooks import (
    HookState,
    adasum_hook,
    compressed_sum_hook,
    sum_allreduce_hook,
)
from tests.helpers.runs import read_rows

HOOKS = {
    "adasum": adasum_hook,
    "sum": sum_allreduce_hook,
    "bf16": compressed_sum_hook,
    "fp16": compressed_sum_hook,
}


class Dot(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, u, v):
        return (self.w * u).sum() + (self.b * v).sum()


def _worker(rank, world, port, hook, grads, units, out):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = Dot()
        ddp = DDP(model, gradient_as_bucket_view=True)
        state = HookState(local_units=units[rank])
        if hook in ("bf16", "fp16"):
            state.comm_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[hook])
        ddp.register_comm_hook(state, HOOKS[hook])
        u, v = grads[rank]
        ddp(torch.tensor(u, dtype=torch.float32), torch.tensor(v, dtype=torch.float32)).backward()
        result = {"w": model.w.grad.tolist(), "b": model.b.grad.tolist(), "bytes": state.bytes_sent}
        gathered = [None] * world
        dist.all_gather_object(gathered, result)  # every rank must hold the same combination
        if rank == 0:
            torch.save(gathered, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _combine(hook, grads, units):
    world = len(grads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(
            _worker, args=(world, free_port(), hook, grads, units, out), nprocs=world, join=True
        )
        results = torch.load(out)
    assert all(r == results[0] for r in results), "ranks disagree on the combined gradient"
    return results[0]


# ---- the reference: Maleki et al. 2020, eq. (Adasum of two), written out by hand
def ref_pair(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    aa, bb = sum(x * x for x in a), sum(y * y for y in b)
    ca = 1 - dot / (2 * aa) if aa >= 1e-8 else 1.0
    cb = 1 - dot / (2 * bb) if bb >= 1e-8 else 1.0
    return [ca * x + cb * y for x, y in zip(a, b)]


def ref_adasum(vectors):
    """Horovod's order: (0+1), (2+3), then the two results."""
    while len(vectors) > 1:
        vectors = [ref_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _close(got, want, tol=1e-6):
    assert len(got) == len(want) and all(
        math.isclose(g, w, rel_tol=tol, abs_tol=tol) for g, w in zip(got, want)
    ), (got, want)


def test_adasum_two_ranks_matches_hand_values_per_tensor():
    """w: orthogonal mean gradients add up; b: equal mean gradients are averaged (rank 1's sum
    [4, 4] over 2 units is rank 0's [2, 2]). Per tensor, as Horovod: the whole 5-vector's
    Adasum would scale both by 1 - 8/18 instead."""
    grads = [([1.0, 0.0, 0.0], [2.0, 2.0]), ([0.0, 2.0, 0.0], [4.0, 4.0])]
    got = _combine("adasum", grads, [1, 2])
    _close(got["w"], [1.0, 1.0, 0.0])
    _close(got["b"], [2.0, 2.0])
    _close(got["w"], ref_adasum([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_adasum_four_ranks_matches_the_reference():
    grads = [
        ([1.0, 2.0, -1.0], [0.5, 1.0]),
        ([3.0, -1.0, 0.0], [1.0, -2.0]),
        ([0.0, 1.0, 4.0], [2.0, 2.0]),
        ([-2.0, 0.5, 1.0], [0.0, 0.0]),
    ]
    units = [1, 2, 4, 3]
    got = _combine("adasum", grads, units)
    means = [([x / n for x in u], [y / n for y in v]) for (u, v), n in zip(grads, units)]
    _close(got["w"], ref_adasum([m[0] for m in means]))
    _close(got["b"], ref_adasum([m[1] for m in means]))  # rank 3's zero vector: coefficient 1
    # hand value of one pair, to pin the reference itself: e1 (+) e1 = e1, e1 (+) e2 = e1 + e2
    assert ref_adasum([[1, 0], [1, 0], [0, 1], [0, 1]]) == [1.0, 1.0]


def test_compressed_sum_keeps_the_sum_in_half_the_bytes():
    """bf16 payload: the SUM of both ranks within bf16 rounding (2**-8 relative per element),
    half the bytes of the fp32 all-reduce; fp16 likewise (2**-11)."""
    grads = [([1.001, -2.5, 3.25], [1e-3, 7.0]), ([0.5, 0.125, -1.0], [2e-3, -3.0])]
    exact = _combine("sum", grads, [1, 1])
    want_w = [a + b for a, b in zip(grads[0][0], grads[1][0])]
    _close(exact["w"], want_w)
    for hook, u in (("bf16", 2.0**-8), ("fp16", 2.0**-11)):
        got = _combine(hook, grads, [1, 1])
        _close(got["w"], want_w, tol=3 * u)
        assert got["bytes"] * 2 == exact["bytes"] == 5 * 4


@pytest.mark.slow
def test_adasum_run_says_it_is_not_the_exact_update(tmp_path, run_cli):
    proc = run_cli(
        tmp_path,
        "cluster.ranks=2",
        "comm.grad_combine=adasum",
        "trainer.max_steps=3",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grad_combine"] == "adasum" and summary["exact_global_batch_update"] is False
    assert "not the exact global-batch update" in summary["grad_combine_note"]
    assert "NOT the exact global-batch update" in (tmp_path / "logs" / "rank0.log").read_text()
    rows = read_rows(tmp_path)
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["allreduce_bytes"] > 0 for r in rows)
