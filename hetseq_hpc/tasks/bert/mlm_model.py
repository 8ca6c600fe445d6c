"""BERT for masked-language modelling that returns a SUM of token losses.

A BERT encoder and MLM head (Devlin et al. 2019) in plain PyTorch
(:mod:`hetseq_hpc.tasks.bert.encoder`), random init, nothing downloaded. It mirrors the layout
of transformers' ``BertForMaskedLM`` under ``mlm.`` (``mlm.bert.*``, ``mlm.cls.*``, no pooler, the
decoder tied to the word embeddings), so checkpoints are interchangeable with a
transformers-built ``BertForMaskedLM``, and the same torch seed gives the same initial weights.
transformers is not imported: it takes seconds of every rank's start-up.

The vocabulary projection runs only on the masked positions, ~15% of the tokens (gathered by
index, ``masked_positions``, padded to the batch's widest row): the same loss for less compute.

Returning the SUM (not the mean) is what makes uneven per-rank batches exact: the trainer
divides by the GLOBAL number of masked tokens before backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.schema import BertModelConfig
from hetseq_hpc.tasks.bert.encoder import (
    BertModel,
    BertOnlyMLMHead,
    init_like_transformers,
    tie_decoder,
)
from hetseq_hpc.tasks.bert.mlm_data import IGNORE_INDEX, PAD_ID


class _BertForMaskedLM(nn.Module):
    """The ``bert`` + ``cls`` pair of transformers' ``BertForMaskedLM``, built and initialised
    in its order: the encoder (torch's default init, then transformers' init), then the head
    (the same two steps), then the tie. Each step draws from the global torch RNG."""

    def __init__(self, cfg: BertModelConfig, vocab_size: int):
        super().__init__()
        self.bert = BertModel(cfg, vocab_size, PAD_ID)
        init_like_transformers(self.bert)
        self.cls = BertOnlyMLMHead(cfg, vocab_size)
        init_like_transformers(self.cls)
        tie_decoder(self.bert, self.cls)


class BertMaskedLM(nn.Module):
    """``forward(input_ids, labels) -> loss_sum``.

    Shapes: ``input_ids`` and ``labels`` are ``(B, T)`` int64; ``labels`` is ``-100`` where no
    prediction is made. Returns a 0-dim float32 tensor: the sum of cross-entropy over the
    masked positions (divide by their count for the mean).
    """

    def __init__(self, model: BertModelConfig, vocab_size: int):
        super().__init__()
        self.model_cfg = model
        self.vocab_size = int(vocab_size)
        self.mlm = _BertForMaskedLM(model, self.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        masked_positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``(B, T)`` ids and labels -> 0-dim sum of masked-token cross-entropy.

        ``masked_positions`` (``(B, P)`` int64, ``-1`` padded:
        :func:`~hetseq_hpc.tasks.bert.mlm_data.masked_positions`, built on the CPU with the
        batch): the head gathers those ``B * P`` positions (padding ignored in the loss), with
        shapes known before the forward, so no step synchronises the host with the device and
        the graph has no data-dependent shape. Without it, the masked positions are selected
        with a boolean mask (the same loss; a host synchronisation on a GPU)."""
        hidden = self.mlm.bert(input_ids)  # (B, T, H)
        if masked_positions is None:
            selected = labels != IGNORE_INDEX  # (B, T)
            logits = self.mlm.cls(hidden[selected])  # (M, V), M = masked tokens
            return F.cross_entropy(logits.float(), labels[selected], reduction="sum")
        batch, seq = labels.shape
        valid = masked_positions >= 0  # (B, P)
        rows = torch.arange(batch, device=labels.device).unsqueeze(1) * seq
        flat = (masked_positions.clamp(min=0) + rows).reshape(-1)  # (B * P,)
        picked = hidden.reshape(batch * seq, -1).index_select(0, flat)  # (B * P, H)
        targets = labels.reshape(-1).index_select(0, flat)
        targets = targets.masked_fill(~valid.reshape(-1), IGNORE_INDEX)
        logits = self.mlm.cls(picked)  # (B * P, V)
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")

    def flops_per_sample(self, seq_len: int, masked_per_sample: float) -> float:
        """Training FLOPs of one sample (forward + backward = 3x forward), counting matmuls:
        2 * params * tokens for the encoder, attention scores 4 * T^2 * H per layer, and the
        vocabulary projection on the masked tokens only (Kaplan et al. 2020, eq. 2.2 style)."""
        cfg = self.model_cfg
        h, layers, inter, vocab = (
            cfg.hidden_size,
            cfg.num_layers,
            cfg.intermediate_size,
            self.vocab_size,
        )
        per_layer = 4 * h * h + 2 * h * inter  # q, k, v, out + two feed-forward matmuls
        encoder = 2 * layers * per_layer * seq_len + layers * 4 * seq_len * seq_len * h
        head = 2 * (h * h + h * vocab) * masked_per_sample
        return 3.0 * (encoder + head)
