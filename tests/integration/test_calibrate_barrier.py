"""Calibration over a real gloo barrier: two processes, the second one slower. The first keeps
timing passes while it waits for the second, and leaves calibration only once the second is
done with its own passes.

What is asserted holds however loaded the machine is: the slower rank starts its passes only
after the faster one has timed every extra pass it may (MAX_EXTRA_PASSES), so how many passes
each rank times does not depend on how long a pass or a barrier's round trip takes."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetseq_hpc.balance.calibrate import MAX_EXTRA_PASSES, calibrate
from hetseq_hpc.distributed.rendezvous import PendingBarrier
from hetseq_hpc.env.world import free_port
from tests.helpers.calibration import Tiny, batches
from tests.helpers.waits import wait_for

#: timed passes of each rank's own (``steps`` of calibrate)
STEPS = 2
#: a guard against hangs, not a speed check
GUARD_S = 300


def test_calibration_waits_for_peers_over_a_real_barrier():
    """Two real gloo processes, the second one slower: the first one keeps timing passes
    until the second is done, and both leave calibration together."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    fast_batches = ctx.Value("i", 0)  # make_batch calls of rank 0: warm-up, own, extra passes
    slow_posted = ctx.Value("i", 0)  # 1 once rank 1 is done with its own passes
    port = free_port()
    procs = [
        ctx.Process(target=_barrier_rank, args=(r, port, out, fast_batches, slow_posted))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=GUARD_S) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    fast, slow = got[0], got[1]
    # the fast rank timed passes while it waited, up to the bound: every pass it may time
    assert len(fast["timings"]) == STEPS + MAX_EXTRA_PASSES, fast
    assert {n for n, _ in fast["timings"]} == {8, 2}
    # the slow rank timed its own passes, and extra ones at most while the barrier completed
    assert STEPS <= len(slow["timings"]) <= STEPS + MAX_EXTRA_PASSES, slow
    assert len(fast["timings"]) >= len(slow["timings"])
    # the fast rank left calibration only after the slow one was done with its passes
    assert fast["left_after_slow_posted"], got


def _barrier_rank(rank, port, out, fast_batches, slow_posted):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=GUARD_S),
    )
    try:
        torch.set_num_threads(1)

        def make_batch(n):
            if rank == 0:
                with fast_batches.get_lock():
                    fast_batches.value += 1
            else:  # a slower device: it starts once rank 0 has timed every pass it may
                wait_for(
                    lambda: fast_batches.value >= 1 + STEPS + MAX_EXTRA_PASSES,
                    "rank 0 timed too few passes",
                    GUARD_S,
                    poll_s=0.01,
                )
            return batches(n)

        def wait_for_peers():
            if rank == 1:
                slow_posted.value = 1
            return PendingBarrier(dist.barrier(async_op=True))

        cal = calibrate(
            Tiny(), make_batch, torch.device("cpu"), 8, STEPS, 2**30, wait_for_peers=wait_for_peers
        )
        out.put((rank, {"timings": cal.timings, "left_after_slow_posted": slow_posted.value == 1}))
    finally:
        dist.destroy_process_group()
