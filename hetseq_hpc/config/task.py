"""Task schemas: what is trained, on which data (``task=<name>``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hetseq_hpc.config.common import require, require_finite


@dataclass
class BertModelConfig:
    """Size of the ``BertForMaskedLM`` built from scratch (nothing is downloaded)."""

    # width of every token representation
    hidden_size: int = 128
    # transformer layers
    num_layers: int = 2
    # attention heads per layer (must divide hidden_size)
    num_heads: int = 2
    # width of the feed-forward block
    intermediate_size: int = 512
    # dropout on hidden states and attention probabilities; 0.0 makes runs bit-comparable
    dropout: float = 0.1
    # tokens per packed training sequence, [CLS] and [SEP] included
    max_seq_len: int = 128

    def __post_init__(self) -> None:
        require_finite(self, "task.model")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            value = getattr(self, name)
            require(value >= 1, f"task.model.{name}={value} is invalid: it must be >= 1")
        require(
            self.hidden_size % self.num_heads == 0,
            f"task.model.num_heads={self.num_heads} does not divide task.model.hidden_size="
            f"{self.hidden_size}: choose heads that divide the hidden size",
        )
        require(
            0.0 <= self.dropout < 1.0,
            f"task.model.dropout={self.dropout} is invalid: it must be in [0, 1)",
        )
        require(
            self.max_seq_len >= 8,
            f"task.model.max_seq_len={self.max_seq_len} is too short: use at least 8 tokens",
        )


@dataclass
class BertDataConfig:
    """Where the text comes from and how it is tokenised and masked."""

    # text files or globs; empty = the embedded corpus (CPython's pydoc_data.topics)
    files: List[str] = field(default_factory=list)
    # WordPiece vocabulary size asked of the tokenizer trainer (small corpora stop earlier)
    vocab_size: int = 8192
    # share of packed sequences held out for validation
    val_fraction: float = 0.05
    # share of tokens selected for masked-language modelling (BERT: 0.15)
    mask_prob: float = 0.15
    # where tokenizers and packed token ids are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        require_finite(self, "task.data")
        require(
            self.vocab_size >= 200,
            f"task.data.vocab_size={self.vocab_size} is too small: use at least 200",
        )
        require(
            0.0 < self.val_fraction < 0.5,
            f"task.data.val_fraction={self.val_fraction} is invalid: it must be in (0, 0.5)",
        )
        require(
            0.0 < self.mask_prob < 1.0,
            f"task.data.mask_prob={self.mask_prob} is invalid: it must be in (0, 1)",
        )


@dataclass
class BertTaskConfig:
    """Masked-language modelling with BERT (Devlin et al., 2019) on packed text."""

    name: str = "bert"
    model: BertModelConfig = field(default_factory=BertModelConfig)
    data: BertDataConfig = field(default_factory=BertDataConfig)
