"""Encoder-decoder transformer (Vaswani et al., 2017) from ``torch.nn`` layers, random init.

Pre-norm layers (``norm_first``, Xiong et al., 2020: stable without warm-up tricks), learned
position embeddings, one embedding table shared by source, target and output projection (the
vocabulary is shared; Press & Wolf, 2017). The loss is label-smoothed cross-entropy (Szegedy et
al., 2016) SUMMED over the non-pad target tokens; the trainer divides by their global count.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.tasks import TranslationModelConfig
from hetseq_hpc.tasks.translation.parallel_data import BOS_ID, EOS_ID, PAD_ID


class TranslationTransformer(nn.Module):
    """``forward(src, tgt_in, tgt_out) -> loss_sum``; :meth:`greedy` translates.

    Shapes: ``src`` ``(B, S)``, ``tgt_in``/``tgt_out`` ``(B, T)`` int64 ids, ``S, T <=
    max_len``, padded with ``PAD_ID``. Returns a 0-dim float32 tensor.
    """

    def __init__(self, cfg: TranslationModelConfig, vocab_size: int):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, d, padding_idx=PAD_ID)
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        self.position = nn.Embedding(cfg.max_len + 1, d)
        self.dropout = nn.Dropout(cfg.dropout)
        enc = nn.TransformerEncoderLayer(
            d, cfg.num_heads, cfg.ff_size, cfg.dropout, batch_first=True, norm_first=True
        )
        dec = nn.TransformerDecoderLayer(
            d, cfg.num_heads, cfg.ff_size, cfg.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(
            enc, cfg.num_encoder_layers, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.decoder = nn.TransformerDecoder(dec, cfg.num_decoder_layers, norm=nn.LayerNorm(d))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) * math.sqrt(self.cfg.d_model) + self.position(pos)
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` ids -> memory ``(B, S, d_model)``."""
        return self.encoder(self._embed(src), src_key_padding_mask=src == PAD_ID)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` target prefix ids -> logits ``(B, T, vocab)`` (causal self-attention)."""
        t = tgt_in.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf"), device=tgt_in.device), diagonal=1)
        hidden = self.decoder(
            self._embed(tgt_in),
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=src == PAD_ID,
        )
        return hidden @ self.embed.weight.t()

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
    ) -> torch.Tensor:
        """0-dim sum of label-smoothed cross-entropy over the non-pad target tokens."""
        logits = self.decode(tgt_in, self.encode(src), src)
        keep = tgt_out != PAD_ID  # (B, T)
        return F.cross_entropy(
            logits[keep].float(),
            tgt_out[keep],
            label_smoothing=self.cfg.label_smoothing,
            reduction="sum",
        )

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, max_len: int) -> torch.Tensor:
        """Greedy decoding: ``(B, S)`` ids -> ``(B, <= max_len)`` generated ids (no ``[BOS]``;
        ``[PAD]`` after a row's ``[EOS]``). Recomputes the prefix each step (no cache)."""
        memory = self.encode(src)
        ys = torch.full((src.shape[0], 1), BOS_ID, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            nxt = self.decode(ys, memory, src)[:, -1].argmax(dim=-1)
            nxt = nxt.masked_fill(done, PAD_ID)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
        return ys[:, 1:]

    def flops_per_sample(self, src_len: int, tgt_len: int) -> float:
        """Training FLOPs of one pair at padded lengths S, T (forward + backward = 3x forward),
        counting matmuls: 2 x weights x tokens, plus 4 x d x (query x key) for attention."""
        d, ff, vocab = self.cfg.d_model, self.cfg.ff_size, self.embed.num_embeddings
        s, t = src_len, tgt_len
        enc = self.cfg.num_encoder_layers * (2 * (4 * d * d + 2 * d * ff) * s + 4 * s * s * d)
        dec_layer = (
            2 * (4 * d * d + 2 * d * d + 2 * d * ff) * t
            + 2 * 2 * d * d * s
            + 4 * t * t * d
            + 4 * t * s * d
        )
        head = 2 * d * vocab * t
        return 3.0 * float(enc + self.cfg.num_decoder_layers * dec_layer + head)
