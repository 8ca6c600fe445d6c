"""A complete user task: a character-level language model of Python's own documentation.

Run it (from the folder that holds ``examples/``)::

    python -m hetseq_hpc task=custom task.target=examples.char_lm.CharLMTask trainer.max_steps=200

Data: the text of ``pydoc_data.topics`` (CPython's help() topics, ~700 k characters, shipped
with every CPython), cut into fixed windows of ``seq_len + 1`` characters. The last
``val_fraction`` of the windows are the validation split. The loss units are the predicted
characters: ``count(batch) = B * seq_len``.

Options (all optional; add them with ``+task.args.<name>=<value>``): ``seq_len`` (64),
``hidden`` (128), ``layers`` (1), ``val_fraction`` (0.05); dropout is ``task.model.dropout``.
This file is the worked example of docs/tasks.md.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks import Task


class CharLM(nn.Module):
    """Embedding -> GRU -> linear. ``forward(inputs, targets) -> loss_sum``.

    Shapes: ``inputs`` and ``targets`` are ``(B, T)`` int64 character ids; the loss is the
    cross-entropy SUMMED over all ``B * T`` predicted characters (a 0-dim float tensor).
    """

    def __init__(self, vocab_size: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.rnn = nn.GRU(
            hidden,
            hidden,
            num_layers=layers,
            batch_first=True,
            dropout=dropout if layers > 1 else 0.0,
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab_size)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, vocab)`` scores of the next character."""
        hidden, _ = self.rnn(self.drop(self.embed(inputs)))
        return self.head(self.drop(hidden))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """0-dim SUM of the next-character cross-entropy over the batch."""
        logits = self.logits(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class CharLMTask(Task):
    """Next-character prediction on ``pydoc_data.topics``; loss units are characters."""

    name = "char_lm"
    unit_name = "characters"

    def __init__(self, cfg, seed: int):
        super().__init__(cfg, seed)
        args = cfg.args
        self.seq_len = int(args.get("seq_len", 64))
        self.hidden = int(args.get("hidden", 128))
        self.layers = int(args.get("layers", 1))
        self.val_fraction = float(args.get("val_fraction", 0.05))
        self.dropout = float(cfg.model.get("dropout", 0.0))
        if self.seq_len < 2 or not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(
                f"task.args.seq_len={self.seq_len} / task.args.val_fraction="
                f"{self.val_fraction} are invalid: use seq_len >= 2 and a fraction "
                "in (0, 0.5)"
            )

    def load(self) -> None:
        """Read the text (a few hundred kB: no cache needed, so no ``prepare``)."""
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
        n = (ids.size - 1) // self.seq_len
        # window i = characters [i * T, i * T + T]: T inputs and the T next characters
        starts = np.arange(n) * self.seq_len
        self.windows = ids[starts[:, None] + np.arange(self.seq_len + 1)]
        self.n_val = max(1, int(n * self.val_fraction))

    @property
    def num_train(self) -> int:
        return int(self.windows.shape[0] - self.n_val)

    @property
    def num_val(self) -> int:
        return self.n_val

    @property
    def units_per_sample(self) -> float:
        return float(self.seq_len)

    @property
    def data_summary(self) -> Dict[str, object]:
        return {
            "source": "pydoc_data.topics",
            "characters": int(self.windows.size),
            "vocab_size": len(self.chars),
            "train_windows": self.num_train,
            "val_windows": self.num_val,
        }

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """``{"inputs", "targets"}``, each ``(len(positions), seq_len)`` int64; nothing random."""
        rows = np.asarray(positions, dtype=np.int64).reshape(-1)
        if split == "val":
            rows = rows + self.num_train  # validation windows follow the training ones
        window = torch.from_numpy(self.windows[rows])
        return {"inputs": window[:, :-1].contiguous(), "targets": window[:, 1:].contiguous()}

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        return int(batch["targets"].numel())

    def sharding_units(self, model: nn.Module) -> List[nn.Module]:
        """Under ``sharding.mode=fsdp`` the GRU is its own FSDP unit (the embedding and the
        head form the root unit)."""
        return [model.rnn]

    def build_model(self) -> CharLM:
        return CharLM(len(self.chars), self.hidden, self.layers, self.dropout)

    def finalize_metrics(self, sums: Dict[str, float]) -> Dict[str, float]:
        """The default ``val_loss``/``val_ppl`` plus bits per character."""
        metrics = super().finalize_metrics(sums)
        metrics["val_bits_per_char"] = metrics["val_loss"] / math.log(2)
        return metrics

    @torch.no_grad()
    def examples(self, model: nn.Module, n: int = 3) -> List[Tuple[str, str]]:
        """``(prompt, greedy continuation)`` of the first ``n`` validation windows."""
        out = []
        device = next(model.parameters()).device
        for i in range(min(n, self.num_val)):
            ids = self.make_batch([i], 0, "val")["inputs"].to(device)
            for _ in range(40):
                nxt = model.logits(ids)[:, -1].argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            text = "".join(self.chars[j] for j in ids[0].tolist())
            prompt, more = text[: self.seq_len], text[self.seq_len :]
            out.append((repr(prompt[-30:]), repr(more)))
        return out
