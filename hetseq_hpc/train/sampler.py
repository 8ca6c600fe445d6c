"""Which samples form global batch k: a function of (seed, epoch, step) only.

Epoch ``e`` visits the training set in the order of a permutation seeded with ``(seed, e)``;
global batch ``k`` (0-based, counted over the whole run) is slice
``[j * B, (j + 1) * B)`` of epoch ``e = k // steps_per_epoch`` with ``j = k % steps_per_epoch``
(the incomplete tail of each epoch is dropped). Rank ``i`` takes the contiguous slice
``[offset_i, offset_i + b_i)`` of that global batch. Nothing here depends on the world size
or the allocation, which is what makes runs with different hardware mixes comparable step by
step, and resume exact. Up to :data:`TABLE_MAX` samples the permutation is numpy's, held as a
table (``8 N`` bytes); a larger set (``len() = 10**12`` would need 7 TiB) is shuffled by a
keyed Feistel permutation evaluated for the ``B`` positions of a batch only (O(B) memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

import numpy as np

from hetseq_hpc.errors import ConfigError

#: the largest training set shuffled with a permutation table (1 GiB of int64); above it
#: :func:`feistel_permute`
TABLE_MAX = 2**27
#: the largest training set the Feistel permutation covers (62-bit domain)
MAX_SAMPLES = 2**62
#: Feistel rounds (4 already make a pseudo-random permutation: Luby and Rackoff, 1988)
FEISTEL_ROUNDS = 6


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
                "training samples: lower it, or add training data"
            )
        if self.num_samples > MAX_SAMPLES:
            raise ConfigError(
                f"the training set has {self.num_samples} samples, more than the 2**62 the "
                "sampler can shuffle: split it into several runs"
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
        b = self.global_batch_size
        if self.num_samples > TABLE_MAX:
            wanted = np.arange(j * b, (j + 1) * b, dtype=np.uint64)
            return epoch, feistel_permute(wanted, self.num_samples, self.seed, epoch)
        order = _permutation(self.num_samples, self.seed, epoch)
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


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a ``uint64`` array (wraps modulo 2**64, no warnings)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feistel_permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where ``positions`` (``uint64``, each < ``n``) go in epoch ``epoch``'s order of ``n``
    samples: a balanced Feistel network of :data:`FEISTEL_ROUNDS` rounds (keys from
    ``(seed, epoch)``, splitmix64 round function) on the smallest even bit width covering
    ``n``, cycle-walked into ``[0, n)``. A bijection of ``[0, n)`` computed in O(len) time
    and memory, the same on every machine. Returns ``int64`` positions, shape of
    ``positions``."""
    half = max(1, (max(int(n) - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch, 0xFE157E1]).generate_state(
        FEISTEL_ROUNDS, dtype=np.uint64
    )

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & low
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & low)
        return (left << np.uint64(half)) | right

    out = encrypt(np.asarray(positions, dtype=np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():  # the cycle of a position < n comes back below n
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
