"""What the built-in tasks do with a sample: the fixed train/validation split, the sample's own
random generator (a function of the sample, never of the rank), BERT's masking.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

#: split codes mixed into a sample's random seed
SPLIT_CODES = {"train": 0, "val": 1}
#: the label of a position no loss is computed for (PyTorch's ``ignore_index``)
IGNORE_INDEX = -100


def fixed_split(n: int, val_fraction: float) -> Tuple[np.ndarray, np.ndarray]:
    """``(train rows, validation rows)`` of ``n >= 2`` rows, each sorted: a fixed permutation
    (seed 0, independent of ``trainer.seed``, so validation data never changes between runs)
    with ``round(n * val_fraction)`` rows, at least 1 and at most ``n - 1``, validating."""
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    order = np.random.default_rng(0).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def sample_rng(seed: int, epoch: int, split: str, index: int) -> np.random.Generator:
    """The random generator of one sample: ``default_rng([seed, epoch, split code, index])``."""
    return np.random.default_rng([seed, epoch, SPLIT_CODES[split], int(index)])


def mask_tokens(
    rng: np.random.Generator,
    row: np.ndarray,
    maskable: np.ndarray,
    fallback: np.ndarray,
    mask_prob: float,
    mask_id: int,
    random_ids: Tuple[int, int],
) -> Tuple[np.ndarray, np.ndarray]:
    """BERT's masking of one ``(T,)`` int64 row (Devlin et al., 2019, section 3.1): each of the
    ``maskable`` positions is selected with probability ``mask_prob`` (one at least, of
    ``fallback`` when none is maskable); a selected token becomes ``mask_id`` 80% of the time, a
    random id of ``range(*random_ids)`` 10%, and stays 10%. Returns ``(input_ids, labels)``, two
    ``(T,)`` int64 arrays, labels :data:`IGNORE_INDEX` where nothing is predicted."""
    size = row.shape[0]
    selected = (rng.random(size) < mask_prob) & maskable
    if not selected.any():
        candidates = np.flatnonzero(maskable if maskable.any() else fallback)
        selected[candidates[rng.integers(candidates.size)]] = True
    action = rng.random(size)
    random_tokens = rng.integers(random_ids[0], random_ids[1], size=size)
    inputs = row.copy()
    inputs[selected & (action < 0.8)] = mask_id
    swap = selected & (action >= 0.8) & (action < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, np.where(selected, row, IGNORE_INDEX)
