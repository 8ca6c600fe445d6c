"""One rank's row of a step's table, as the re-balancer's simulators feed it."""

from __future__ import annotations

from hetseq_hpc.distributed.rendezvous import StepStats


def timed_step(samples: int, compute_s: float, tail_s: float = 0.0) -> StepStats:
    """A :class:`StepStats` of a rank that ran ``samples`` in ``compute_s`` seconds of compute
    (its step time too; no data time, no loss) and ``tail_s`` after its last gradient bucket."""
    return StepStats(
        loss_sum=0.0,
        count=1,
        samples=samples,
        compute_time_s=compute_s,
        step_time_s=compute_s,
        data_time_s=0.0,
        stop_code=0,
        tail_time_s=tail_s,
    )
