"""The rendezvous's named exchange and agreement check on a real 2-process gloo group.
(One Trainer step in-process: tests/unit/test_trainer_unit.py.)"""

from __future__ import annotations

from dataclasses import astuple

import torch
import torch.multiprocessing as mp

from hetseq_hpc.distributed.rendezvous import StepStats, rendezvous
from hetseq_hpc.env.world import WorldInfo, free_port
from hetseq_hpc.errors import AllocationError


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    world = WorldInfo(
        rank=rank, local_rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port
    )
    with rendezvous(world, torch.device("cpu"), 60) as rdv:
        table = rdv.exchange_step_stats(StepStats(1.5 + rank, 3 + rank, 2, 0.1, 0.2, 0.05, rank))
        rdv.check_agreement("same", "allocation")
        try:
            rdv.check_agreement(f"digest{rank}", "allocation")
            error = None
        except AllocationError as exc:
            error = str(exc)
        if rank == 1:
            torch.save({"table": [list(astuple(s)) for s in table], "error": error}, out)


def test_exchange_and_agreement_on_two_ranks(tmp_path):
    """A real 2-process gloo group: the named exchange returns every rank's stats in rank order
    (ints stay ints; ``bad_micro`` 0: every loss finite; the last field, ``joins``, 0: no
    replacement asked to join), and differing digests raise one line naming each rank's
    digest."""
    out = str(tmp_path / "result.pt")
    mp.spawn(_two_rank_worker, args=(free_port(), out), nprocs=2, join=True)
    result = torch.load(out)
    assert result["table"] == [
        [1.5, 3, 2, 0.1, 0.2, 0.05, 0, 0.0, 0, 0],
        [2.5, 4, 2, 0.1, 0.2, 0.05, 1, 0.0, 0, 0],
    ]
    assert (
        "ranks disagree on the allocation (digest rank 0: digest0, rank 1: digest1)"
        in result["error"]
    )
    assert "\n" not in result["error"] and "install the same hetseq_hpc" in result["error"]
