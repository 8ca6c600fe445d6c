"""A step's micro-batches, built off the training thread: step ``k + 1``'s while step ``k`` runs.

The batches of a step are a pure function of the seed, the epoch, the positions and the split
(the task contract), so building them early changes nothing the step computes. One background
thread builds them (one build at a time: ``make_batch`` never runs twice at once), with each
real micro-batch's unit count taken on the CPU, pinned when the rank trains on CUDA (the copy
to the device is then asynchronous). What was built for a key another than the one the step
asks for (a re-balance or a re-formed world changed the split) is dropped and built again.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

#: what a step's batches are built from: (step, epoch, its micro-batches' positions, padding)
BatchKey = Tuple[int, int, Tuple[Tuple[int, ...], ...], int]


@dataclass
class PreparedStep:
    """One step's micro-batches on the CPU, ready to copy.

    Attributes:
        key: the :data:`BatchKey` they were built for.
        batches: the real micro-batches, then the zero-weight ones (FSDP padding); each a dict
            of CPU tensors (pinned on a CUDA rank).
        counts: the loss units of each real micro-batch (``task.count``, on the CPU).
        build_s: seconds the build took (in the background thread or not).
    """

    key: BatchKey
    batches: List[Dict[str, torch.Tensor]]
    counts: List[int]
    build_s: float


class BatchPrefetcher:
    """Builds steps' batches in one background thread.

    Args:
        build: ``key -> (batches, counts)`` (runs in the background thread).
        pin: pin the tensors' memory (a CUDA rank: ``non_blocking`` copies).
    """

    def __init__(
        self,
        build: Callable[[BatchKey], Tuple[List[Dict[str, torch.Tensor]], List[int]]],
        pin: bool,
    ):
        self._build = build
        self._pin = pin
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[Tuple[BatchKey, concurrent.futures.Future]] = None
        self.rebuilt = 0  # prefetched steps dropped because the step asked for another key

    def _run(self, key: BatchKey) -> PreparedStep:
        t0 = time.perf_counter()
        batches, counts = self._build(key)
        if self._pin:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return PreparedStep(key, batches, counts, time.perf_counter() - t0)

    def _submit(self, key: BatchKey) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "hetseq-batches")
        return self._pool.submit(self._run, key)

    def prefetch(self, key: BatchKey) -> None:
        """Start building ``key``'s batches in the background (after any build in flight)."""
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, self._submit(key))

    def take(self, key: BatchKey) -> PreparedStep:
        """``key``'s batches: the prefetched ones when they were built for ``key``, else built
        now (in the same thread, after the build in flight: never two builds at once).

        Raises:
            whatever the task's ``make_batch`` or ``count`` raised (TaskContractError ...).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] != key:
            self.rebuilt += 1
            pending = None
        future = pending[1] if pending is not None else self._submit(key)
        return future.result()

    def wait(self) -> None:
        """Wait for a build in flight (before the main thread calls ``make_batch`` itself:
        validation). Its result is kept; an error it raised is kept for :meth:`take`."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending[1]])

    def drop(self) -> None:
        """Forget what was prefetched (a re-formed world: a new split)."""
        if self._pending is not None:
            self._pending[1].cancel()
        self._pending = None

    def close(self) -> None:
        """Stop the background thread (a build in flight finishes first)."""
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


__all__ = ["BatchKey", "BatchPrefetcher", "PreparedStep"]
