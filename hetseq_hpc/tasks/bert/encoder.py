"""A BERT encoder and masked-LM head in plain PyTorch (Devlin et al. 2019, "BERT: Pre-training of
Deep Bidirectional Transformers for Language Understanding", NAACL).

The modules mirror the layout of transformers' ``BertModel(add_pooling_layer=False)`` and
``BertOnlyMLMHead`` attribute by attribute (``embeddings.word_embeddings``,
``encoder.layer.<i>.attention.self.query``, ``cls.predictions.transform.dense``, ...), so a
``state_dict`` of either loads into the other unchanged. The computation is the same too:
post-LayerNorm blocks (eps 1e-12), exact-erf GELU, absolute position plus token-type-0
embeddings, dropout where transformers has it, and no attention mask (every token attends to
every token, as transformers does when no ``attention_mask`` is given), through
``torch.nn.functional.scaled_dot_product_attention`` like transformers' default ``sdpa``
attention. :func:`init_like_transformers` reproduces transformers' weight initialisation draw for
draw. Importing this module costs only torch: transformers pulls in ``torch._dynamo``, ``sympy``
and more, seconds of start-up for every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.schema import BertModelConfig

#: transformers' ``BertConfig`` defaults that our config does not set
LAYER_NORM_EPS = 1e-12
INITIALIZER_RANGE = 0.02
TYPE_VOCAB_SIZE = 2


class BertEmbeddings(nn.Module):
    """Word + token-type (all 0) + absolute position embeddings, then LayerNorm and dropout.

    ``forward(input_ids)``: ``(B, T)`` int64 -> ``(B, T, H)``; ``T <= max_seq_len``.
    """

    def __init__(self, cfg: BertModelConfig, vocab_size: int, pad_id: int):
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(vocab_size, h, padding_idx=pad_id)
        self.position_embeddings = nn.Embedding(cfg.max_seq_len, h)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB_SIZE, h)
        self.LayerNorm = nn.LayerNorm(h, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(cfg.dropout)
        # (1, max_seq_len) buffers as in transformers, not saved in the state_dict
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_seq_len).expand((1, -1)), persistent=False
        )
        self.register_buffer(
            "token_type_ids",
            torch.zeros(self.position_ids.size(), dtype=torch.long),
            persistent=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, H)`` embeddings."""
        batch, seq = input_ids.shape
        position_ids = self.position_ids[:, :seq]  # (1, T)
        token_type_ids = self.token_type_ids[:, :seq].expand(batch, seq)  # (B, T), all 0
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention, no mask.

    ``forward(hidden)``: ``(B, T, H)`` -> ``(B, T, H)`` (heads concatenated, before the output
    projection).
    """

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_size = h // cfg.num_heads
        self.scaling = self.head_size**-0.5
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.dropout = nn.Dropout(cfg.dropout)  # on the attention probabilities

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``."""
        shape = (*hidden.shape[:-1], -1, self.head_size)  # (B, T, heads, head_size)
        query = self.query(hidden).view(*shape).transpose(1, 2)  # (B, heads, T, head_size)
        key = self.key(hidden).view(*shape).transpose(1, 2)
        value = self.value(hidden).view(*shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=None,
            dropout_p=self.dropout.p if self.training else 0.0,
            scale=self.scaling,
            is_causal=False,
        )  # (B, heads, T, head_size)
        out = out.transpose(1, 2).contiguous()  # (B, T, heads, head_size)
        return out.reshape(*hidden.shape[:-1], -1).contiguous()


class BertResidualOutput(nn.Module):
    """``LayerNorm(dropout(dense(x)) + residual)``: ``(B, T, d_in)``, ``(B, T, H)`` -> ``(B, T, H)``
    (transformers' ``BertSelfOutput`` with ``d_in = H`` and ``BertOutput`` with the feed-forward
    width)."""

    def __init__(self, cfg: BertModelConfig, d_in: int):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_in)``, ``(B, T, H)`` -> ``(B, T, H)``."""
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    """Self-attention block: ``(B, T, H)`` -> ``(B, T, H)``."""

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertResidualOutput(cfg, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``."""
        return self.output(self.self(hidden), hidden)


class BertIntermediate(nn.Module):
    """Feed-forward expansion with GELU (exact erf): ``(B, T, H)`` -> ``(B, T, intermediate)``."""

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` -> ``(B, T, intermediate)``."""
        return F.gelu(self.dense(hidden))


class BertLayer(nn.Module):
    """One post-LN transformer block: ``(B, T, H)`` -> ``(B, T, H)``."""

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertResidualOutput(cfg, cfg.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``."""
        attended = self.attention(hidden)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """``num_layers`` blocks: ``(B, T, H)`` -> ``(B, T, H)``."""

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_layers)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``."""
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class BertModel(nn.Module):
    """Embeddings and encoder, no pooler (as ``BertModel(add_pooling_layer=False)``).

    ``forward(input_ids)``: ``(B, T)`` int64 -> last hidden states ``(B, T, H)``.
    """

    def __init__(self, cfg: BertModelConfig, vocab_size: int, pad_id: int):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg, vocab_size, pad_id)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, H)``."""
        return self.encoder(self.embeddings(input_ids))


class BertPredictionHeadTransform(nn.Module):
    """``LayerNorm(gelu(dense(x)))``: ``(M, H)`` -> ``(M, H)``."""

    def __init__(self, cfg: BertModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(M, H)`` -> ``(M, H)``."""
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    """Transform, then the vocabulary projection: ``(M, H)`` -> logits ``(M, V)``.

    ``decoder.weight`` is tied to the word embeddings and ``decoder.bias`` is ``bias`` (same
    Parameters) once :func:`tie_decoder` ran, as in transformers.
    """

    def __init__(self, cfg: BertModelConfig, vocab_size: int):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(M, H)`` -> ``(M, V)``."""
        return self.decoder(self.transform(hidden))


class BertOnlyMLMHead(nn.Module):
    """``predictions``: ``(M, H)`` -> ``(M, V)``."""

    def __init__(self, cfg: BertModelConfig, vocab_size: int):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(M, H)`` -> ``(M, V)``."""
        return self.predictions(hidden)


@torch.no_grad()
def init_like_transformers(root: nn.Module) -> None:
    """Re-initialise ``root``'s modules as transformers' ``BertPreTrainedModel._init_weights``:
    Linear weights and Embeddings ~ N(0, 0.02) (bias 0, the padding row 0), LayerNorm 1/0, the
    MLM head's ``bias`` 0. The random draws happen in module order, as transformers' post-order
    walk does (only leaves draw, and leaves come in the same order either way)."""
    for module in root.modules():
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=INITIALIZER_RANGE)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=INITIALIZER_RANGE)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, BertLMPredictionHead):
            module.bias.zero_()


def tie_decoder(bert: BertModel, cls: BertOnlyMLMHead) -> None:
    """Share the vocabulary projection with the word embeddings, and its bias with
    ``cls.predictions.bias`` (transformers' ``_tied_weights_keys`` of ``BertForMaskedLM``)."""
    predictions = cls.predictions
    predictions.decoder.weight = bert.embeddings.word_embeddings.weight
    predictions.decoder.bias = predictions.bias
