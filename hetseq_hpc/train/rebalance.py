"""Online re-balancing: move samples from stragglers to fast ranks, from measured step times.

Every ``trainer.rebalance_every`` steps all ranks hold the same table of per-rank compute times
and sample counts (the loop's per-step all-gather), so every rank computes the same decision
at the same step without another message. The rule follows LBB (J. Supercomputing 2024):

* straggle = (max - min) / mean of the ranks' mean compute time over the last window;
* at or below ``threshold`` nothing happens (a dead band), and it must stay above for
  ``patience`` consecutive windows (a single noisy window never triggers a move);
* above it, each rank's time per sample is smoothed (EMA over windows), the global batch is
  re-split in proportion to 1 / time-per-sample (the same largest-remainder rounding as the
  startup allocation), and the new split is taken only if it cuts the predicted step time by
  at least half the threshold (hysteresis: a split that would only trade one straggler for
  another is not taken);
* after a switch one window is skipped, so the next decision sees only the new split.

The global batch, which samples form it and the loss normalisation do not change, so the
update is still exactly one step on the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hetseq_hpc.allocation import Allocation, allocate
from hetseq_hpc.distributed import StepStats


@dataclass
class Rebalancer:
    """Decides re-allocations from per-rank timings.

    Args:
        caps: per-rank micro-batch caps (from calibration), kept by every new allocation.
        threshold: straggle above which a re-balance is considered (``trainer.rebalance_threshold``).
        smoothing: EMA weight of the newest window's time per sample, in (0, 1].
        patience: consecutive windows above the threshold before a move.
    """

    caps: Sequence[int]
    threshold: float = 0.1
    smoothing: float = 0.5
    patience: int = 2
    _window: List[List[StepStats]] = field(default_factory=list)
    _per_sample_s: Optional[List[float]] = None
    _skip_next: bool = False
    _above: int = 0
    decisions: List[Dict[str, object]] = field(default_factory=list)

    def record(self, per_rank: List[StepStats]) -> None:
        """Add one step's table (its ``samples`` and ``compute_time_s`` are used)."""
        self._window.append(per_rank)

    def observe(self, step: int, allocation: Allocation,
                per_rank: Optional[List[StepStats]] = None) -> Optional[Allocation]:
        """Decide after ``step``; returns the allocation for step ``step + 1`` if it changes.

        ``per_rank`` (this step's table) is recorded first when given.
        """
        if per_rank is not None:
            self.record(per_rank)
        window, self._window = self._window, []
        if not window:
            return None
        n = len(window[0])
        mean_time = [sum(row[r].compute_time_s for row in window) / len(window) for r in range(n)]
        per_sample = [
            sum(row[r].compute_time_s for row in window) / max(sum(row[r].samples for row in window), 1e-9)
            for r in range(n)
        ]
        if self._per_sample_s is None:
            self._per_sample_s = per_sample
        else:
            a = self.smoothing
            self._per_sample_s = [a * new + (1 - a) * old for new, old in zip(per_sample, self._per_sample_s)]
        if self._skip_next:
            self._skip_next = False
            return None
        mean = sum(mean_time) / n
        straggle = (max(mean_time) - min(mean_time)) / mean if mean > 0 else 0.0
        if straggle <= self.threshold:
            self._above = 0
            return None
        self._above += 1
        if self._above < self.patience:
            return None
        throughputs = [1.0 / max(t, 1e-12) for t in self._per_sample_s]
        proposal = allocate(throughputs, allocation.global_batch_size, list(self.caps),
                            source="rebalanced", step=step + 1)
        if proposal.samples == allocation.samples:
            return None
        now = max(b * t for b, t in zip(allocation.samples, self._per_sample_s))
        then = max(b * t for b, t in zip(proposal.samples, self._per_sample_s))
        gain = (now - then) / now if now > 0 else 0.0
        self.decisions.append({"step": step, "straggle": straggle, "gain": gain,
                               "from": allocation.samples, "to": proposal.samples,
                               "taken": gain >= self.threshold / 2})
        if gain < self.threshold / 2:
            return None
        self._skip_next = True
        self._above = 0
        return proposal
