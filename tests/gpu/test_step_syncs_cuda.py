"""A steady-state step on a GPU synchronises nothing: CUDA's own sync debug mode raises on
every synchronising call (``.item()``, a D2H copy that waits, ``nonzero``, a stream or device
synchronize). Skipped where CUDA is absent (CI, the 2-core machine); runs on a lent GPU
(``scripts/gpu_check.sh``). In-process: a real world-size-1 group, the real BERT task."""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.train.trainer import Trainer
from tests.helpers.runs import SMALL_MODEL

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (runs on a lent GPU: scripts/gpu_check.sh)"
)


@pytest.mark.parametrize("cap", [8, 2], ids=["1-micro-batch", "4-micro-batches"])
def test_a_steady_state_step_passes_cuda_sync_debug_mode_error_needs_cuda(
    tmp_path, token_cache, cap
):
    run = compose_run_config(
        [
            *SMALL_MODEL,
            "cluster.ranks=1",
            "task.model.dropout=0.0",
            "trainer.global_batch_size=8",
            "trainer.max_steps=6",
            "optim.warmup_steps=0",
            f"task.data.cache_dir={token_cache}",
        ]
    )
    task = build_task(run.task, run.trainer.seed)
    task.prepare()
    task.load()
    torch.manual_seed(run.trainer.seed)
    device = torch.device("cuda", 0)
    with single_process_rendezvous(device) as rdv:  # NCCL, as a GPU rank's group
        trainer = Trainer(
            run,
            RunDir(tmp_path),
            rdv,
            task,
            task.build_model().to(device),
            device,
            allocate([1.0], 8, [cap]),
            [RankMeta(rank=0, device="cuda", node="test")],
        )
        assert trainer.can_defer()
        trainer.train_step(1, settle=False)
        trainer.train_step(2, settle=False)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in (3, 4, 5):
                trainer.train_step(step, settle=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        trainer.settle_pending()
        trainer.batches.close()
    assert trainer.step == 5  # three steps ran without a synchronising call
