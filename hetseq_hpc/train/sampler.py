"""Which samples form global batch k: a function of (seed, epoch, step) only.

Epoch ``e`` visits the training set in the order of a permutation seeded with ``(seed, e)``;
global batch ``k`` (0-based, counted over the whole run) is slice
``[j * B, (j + 1) * B)`` of epoch ``e = k // steps_per_epoch`` with ``j = k % steps_per_epoch``
(the incomplete tail of each epoch is dropped). Rank ``i`` takes the contiguous slice
``[offset_i, offset_i + b_i)`` of that global batch. Nothing here depends on the world size
or the allocation, which is what makes runs with different hardware mixes comparable step by
step, and resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

import numpy as np

from hetseq_hpc.errors import ConfigError


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Deterministic global batches.

    Args:
        num_samples: size of the training split, N.
        global_batch_size: B.
        seed: ``trainer.seed``.

    Raises:
        ConfigError: ``B > N`` (not one full batch per epoch).
    """

    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.global_batch_size > self.num_samples:
            raise ConfigError(
                f"trainer.global_batch_size={self.global_batch_size} exceeds the {self.num_samples} "
                "training samples: lower it, or add data (task.data.files)"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch, ``N // B``."""
        return self.num_samples // self.global_batch_size

    def epoch_of(self, batch_index: int) -> int:
        """Epoch of 0-based global batch ``batch_index``."""
        return batch_index // self.steps_per_epoch

    def global_batch(self, batch_index: int) -> Tuple[int, np.ndarray]:
        """``(epoch, positions)`` of 0-based global batch ``batch_index``; positions ``(B,)``."""
        epoch, j = divmod(batch_index, self.steps_per_epoch)
        order = _permutation(self.num_samples, self.seed, epoch)
        b = self.global_batch_size
        return epoch, order[j * b : (j + 1) * b]

    def rank_micro_batches(
        self, batch_index: int, offset: int, micro_sizes: List[int]
    ) -> Tuple[int, List[np.ndarray]]:
        """``(epoch, micro-batches)`` of one rank: its slice starting at ``offset``, cut into
        ``micro_sizes``."""
        epoch, positions = self.global_batch(batch_index)
        out, start = [], offset
        for size in micro_sizes:
            out.append(positions[start : start + size])
            start += size
        return epoch, out


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.setflags(write=False)
    return order
