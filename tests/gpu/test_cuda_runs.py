"""What only a GPU can show, as tests: skipped where CUDA is absent (CI, the 2-core machine).

They run on a lent GPU machine through ``scripts/gpu_check.sh`` (one rank per GPU: NCCL refuses
two ranks on one GPU, so a one-GPU machine tests NCCL at world size 1). Nothing here is faked:
a real pynvml probe, a real NCCL process group, real CUDA kernels.

Exactness on the GPU: fp32 runs that differ only in how the global batch is split into
micro-batches (accumulation), or in DDP vs FSDP, must log the same loss to 1e-5 relative
(:data:`tests.helpers.runs.REL_TOL`), as on CPU. The runtime leaves PyTorch's default of no TF32
for fp32 matmuls, so fp32 stays fp32; CUDA's atomics in embedding backward reorder fp32 sums
(~1e-7), far inside the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import SMALL_MODEL, assert_ok, assert_same_losses, hetseq, losses

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (runs on a lent GPU: scripts/gpu_check.sh)"
)

EXACT = [
    *SMALL_MODEL,
    "task.model.dropout=0.0",
    "trainer.val_every=0",
    "trainer.seed=7",
    "trainer.plot=false",
    "cluster.ranks=1",
    "trainer.global_batch_size=32",
    "trainer.max_steps=20",
    "precision=fp32",
]


def test_probe_reads_the_gpu_through_pynvml_needs_cuda(tmp_path, token_cache):
    """``hetseq-hpc probe`` on a GPU node: one entry per GPU, read by pynvml (no fallback note),
    with the name, memory, compute capability and SM count torch sees."""
    out = tmp_path / "probe.json"
    assert_ok(hetseq("probe", *SMALL_MODEL, "--out", str(out), token_cache=token_cache))
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == torch.cuda.device_count()
    probe = ranks[0]["probe"]
    props = torch.cuda.get_device_properties(0)
    assert probe["kind"] == "cuda" and probe["note"] == "", probe
    assert probe["name"] == torch.cuda.get_device_name(0)
    assert abs(probe["memory_total_bytes"] - props.total_memory) <= 0.05 * props.total_memory
    assert tuple(probe["compute_capability"]) == (props.major, props.minor)
    assert probe["sm_count"] == props.multi_processor_count
    assert ranks[0]["calibration"]["samples_per_s"] > 0


def test_accumulation_is_exact_on_cuda_fp32(tmp_path, token_cache):
    """One CUDA rank over NCCL, global batch 32: micro-batch 32 in one pass vs micro-batch 8 with
    four accumulation passes log the same loss at every one of 20 steps."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert_ok(hetseq(*EXACT, f"hydra.run.dir={whole}", token_cache=token_cache))
    assert_ok(
        hetseq(
            *EXACT, "balance.max_micro_batch=8", f"hydra.run.dir={split}", token_cache=token_cache
        )
    )
    summary = json.loads((whole / "summary.json").read_text())
    assert "cuda" in json.dumps(summary).lower(), "the run did not train on the GPU"
    assert_same_losses(losses(whole), losses(split), range(1, 21))


def test_fsdp_matches_ddp_on_cuda_fp32(tmp_path, token_cache):
    """The FSDP2 path on a CUDA rank (NCCL, activation checkpointing on) logs the DDP run's loss
    at every one of 20 steps."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    assert_ok(hetseq(*EXACT, f"hydra.run.dir={ddp}", token_cache=token_cache))
    assert_ok(
        hetseq(
            *EXACT,
            "sharding.mode=fsdp",
            "sharding.activation_checkpointing=true",
            f"hydra.run.dir={fsdp}",
            token_cache=token_cache,
        )
    )
    assert_same_losses(losses(ddp), losses(fsdp), range(1, 21))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_on_cuda(tmp_path, token_cache, precision):
    """bf16 / fp16 autocast on the GPU trains: every loss finite, and within 5 % of the fp32 run's
    at step 20 (the CPU tests' bound for reduced precision)."""
    ref, low = tmp_path / "fp32", tmp_path / precision
    assert_ok(hetseq(*EXACT, f"hydra.run.dir={ref}", token_cache=token_cache))
    args = [a for a in EXACT if not a.startswith("precision=")]
    assert_ok(
        hetseq(*args, f"precision={precision}", f"hydra.run.dir={low}", token_cache=token_cache)
    )
    a, b = losses(ref), losses(low)
    assert all(torch.isfinite(torch.tensor(v)) for v in b.values())
    assert abs(a[20] - b[20]) / a[20] <= 0.05, (a[20], b[20])


def test_fsdp_accumulation_kept_gathered_matches_ddp_on_cuda(tmp_path, token_cache):
    """FSDP2 on a CUDA rank with 4 accumulation passes per step: the parameters kept gathered
    between the passes (``sharding.between_micro_batches=keep_unsharded``) and resharded
    (``reshard``) both log the DDP run's loss at every one of 20 steps."""
    ddp, kept, resharded = tmp_path / "ddp", tmp_path / "kept", tmp_path / "reshard"
    split = [*EXACT, "balance.max_micro_batch=8"]
    assert_ok(hetseq(*split, f"hydra.run.dir={ddp}", token_cache=token_cache))
    for run_dir, mode in ((kept, "keep_unsharded"), (resharded, "reshard")):
        assert_ok(
            hetseq(
                *split,
                "sharding.mode=fsdp",
                f"sharding.between_micro_batches={mode}",
                f"hydra.run.dir={run_dir}",
                token_cache=token_cache,
            )
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["sharding"]["between_micro_batches"] == mode, summary["sharding"]
        assert_same_losses(losses(ddp), losses(run_dir), range(1, 21))
