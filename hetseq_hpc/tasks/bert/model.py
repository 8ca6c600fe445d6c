"""BERT for masked-language modelling that returns a SUM of token losses.

The model is transformers' ``BertForMaskedLM`` built from a ``BertConfig`` (random init,
nothing downloaded). The vocabulary projection runs only on the masked positions, ~15% of the
tokens: the same loss for about 2.7x less compute on small models (measured on this project's
CPU, see ../shared notes in the repository history).

Returning the SUM (not the mean) is what makes uneven per-rank batches exact: the trainer
divides by the GLOBAL number of masked tokens before backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.schema import BertModelConfig
from hetseq_hpc.tasks.bert.data import IGNORE_INDEX, PAD_ID


def bert_config(model: BertModelConfig, vocab_size: int):
    """The ``transformers.BertConfig`` for our model settings."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        intermediate_size=model.intermediate_size,
        hidden_dropout_prob=model.dropout,
        attention_probs_dropout_prob=model.dropout,
        max_position_embeddings=model.max_seq_len,
        type_vocab_size=2,
        pad_token_id=PAD_ID,
    )


class BertMaskedLM(nn.Module):
    """``forward(input_ids, labels) -> loss_sum``.

    Shapes: ``input_ids`` and ``labels`` are ``(B, T)`` int64; ``labels`` is ``-100`` where no
    prediction is made. Returns a 0-dim float32 tensor: the sum of cross-entropy over the
    masked positions (divide by their count for the mean).
    """

    def __init__(self, model: BertModelConfig, vocab_size: int):
        super().__init__()
        from transformers import BertForMaskedLM

        self.mlm = BertForMaskedLM(bert_config(model, vocab_size))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids and labels -> 0-dim sum of masked-token cross-entropy."""
        hidden = self.mlm.bert(input_ids=input_ids).last_hidden_state  # (B, T, H)
        selected = labels != IGNORE_INDEX  # (B, T)
        logits = self.mlm.cls(hidden[selected])  # (M, V), M = masked tokens
        return F.cross_entropy(logits.float(), labels[selected], reduction="sum")

    def flops_per_sample(self, seq_len: int, masked_per_sample: float) -> float:
        """Training FLOPs of one sample (forward + backward = 3x forward), counting matmuls:
        2 * params * tokens for the encoder, attention scores 4 * T^2 * H per layer, and the
        vocabulary projection on the masked tokens only (Kaplan et al. 2020, eq. 2.2 style)."""
        cfg = self.mlm.config
        h, layers, inter, vocab = (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size,
                                   cfg.vocab_size)
        per_layer = 4 * h * h + 2 * h * inter  # q, k, v, out + two feed-forward matmuls
        encoder = 2 * layers * per_layer * seq_len + layers * 4 * seq_len * seq_len * h
        head = 2 * (h * h + h * vocab) * masked_per_sample
        return 3.0 * (encoder + head)
