"""An in-process :class:`~hetseq_hpc.train.trainer.Trainer` of one CPU rank on the small BERT,
for unit tests of the step, the stop paths and the checkpoints (no worker process)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.train.trainer import Trainer
from tests.helpers.runs import SMALL_MODEL


def one_rank_trainer(
    run_dir: Path,
    rdv: Gang,
    token_cache: Path,
    *overrides: str,
    global_batch: int = 8,
    cap: int = 3,
    precision: Optional[str] = None,
    sharding: str = "ddp",
) -> Trainer:
    """A Trainer of rank 0 of a world of one, in ``run_dir``, on the small BERT (dropout off,
    no warm-up, seed 1, the tokens of ``token_cache``).

    Args:
        run_dir: the run directory (a test's ``tmp_path``).
        rdv: the world of one (``single_process_rendezvous()``).
        token_cache: the session's token cache (fixture ``token_cache``).
        overrides: more Hydra overrides, after the defaults above (they win).
        global_batch: samples per step.
        cap: the rank's largest micro-batch (samples): ``global_batch / cap`` micro-batches.
        precision: the rank's precision in its :class:`RankMeta` (None: not said).
        sharding: ``ddp`` (a replica) or ``fsdp`` (FSDP2 over the world of one).
    """
    run = compose_run_config(
        [
            *SMALL_MODEL,
            "cluster.ranks=1",
            "task.model.dropout=0.0",
            f"trainer.global_batch_size={global_batch}",
            "optim.warmup_steps=0",
            f"task.data.cache_dir={token_cache}",
            "trainer.seed=1",
            *overrides,
        ]
    )
    task = build_task(run.task, run.trainer.seed)
    task.prepare()
    task.load()
    torch.manual_seed(run.trainer.seed)
    said = {} if precision is None else {"precision": precision}
    meta = RankMeta(rank=0, device="cpu", node="test", **said)
    return Trainer(
        run,
        RunDir(run_dir),
        rdv,
        task,
        task.build_model(),
        torch.device("cpu"),
        allocate([1.0], global_batch, [cap]),
        [meta],
        sharding=sharding,
    )
