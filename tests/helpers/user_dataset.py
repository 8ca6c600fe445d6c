"""A user-style map-style Dataset for ``task=dataset`` (tests): variable-length integer
sequences, a custom ``collate_fn`` that pads to a FIXED width, and a ``loss_fn`` that sums the
per-token cross-entropy of a tiny GRU tagger (predict each token's value mod 4)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

WIDTH = 12


class VariableLengthSequences(Dataset):
    """``n`` sequences of 3..12 token ids in 1..49, item ``i`` drawn from seed ``i``."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(self.offset + int(i))
        ids = torch.from_numpy(rng.integers(1, 50, size=int(rng.integers(3, WIDTH + 1))))
        return {"ids": ids, "tags": ids % 4}


def collate(items):
    """Pad every item to WIDTH (0 = padding; tags -100 there)."""
    ids = torch.zeros(len(items), WIDTH, dtype=torch.int64)
    tags = torch.full((len(items), WIDTH), -100, dtype=torch.int64)
    for row, item in enumerate(items):
        ids[row, : len(item["ids"])] = item["ids"]
        tags[row, : len(item["tags"])] = item["tags"]
    return {"ids": ids, "tags": tags}


class Tagger(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.drop(self.rnn(self.embed(ids))[0]))


def loss_fn(model, batch):
    logits = model(batch["ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), batch["tags"].flatten(), ignore_index=-100, reduction="sum"
    )


def build(dropout: float = 0.1, n: int = 400):
    return {
        "train": VariableLengthSequences(n),
        "val": VariableLengthSequences(40, 10_000),
        "model": Tagger(dropout),
        "collate_fn": collate,
        "loss_fn": loss_fn,
        "count": lambda batch: int((batch["tags"] != -100).sum()),
    }


def build_plain():
    """A ``build`` that takes no arguments at all (no ``dropout``): the model has none."""
    return {**build(0.0), "model": Tagger(0.0)}


class FilePerItemSequences(VariableLengthSequences):
    """:class:`VariableLengthSequences` whose every item first opens ``path`` (a gzip file of
    about 2 MB) and decompresses all of it, as a loader that reopens its shard per sample does
    (HetSeq's ``BertH5pyData``): the same items, a slow data path."""

    def __init__(self, n: int, path, offset: int = 0):
        super().__init__(n, offset)
        self.path = path

    def __getitem__(self, i: int):
        import gzip

        with gzip.open(self.path, "rb") as fh:
            fh.read()
        return super().__getitem__(i)


def build_file_per_item(root: str, dropout: float = 0.1, n: int = 400):
    """:func:`build` with :class:`FilePerItemSequences`; the shard is written under ``root``."""
    import gzip
    from pathlib import Path

    path = Path(root) / "shard.bin.gz"
    if not path.exists():
        Path(root).mkdir(parents=True, exist_ok=True)
        data = np.random.default_rng(0).integers(0, 2**16, size=2**18, dtype=np.int64).tobytes()
        with gzip.open(path, "wb", compresslevel=1) as fh:
            fh.write(data)
    return {
        **build(dropout, n),
        "train": FilePerItemSequences(n, path),
        "val": FilePerItemSequences(40, path, 10_000),
    }
