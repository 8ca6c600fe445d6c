"""Schema of ``task=translation`` (same style as :mod:`hetseq_hpc.config.schema`; not registered
yet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hetseq_hpc.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class TranslationModelConfig:
    """Size of the encoder-decoder transformer (Vaswani et al., 2017), built from scratch."""

    # width of every token representation
    d_model: int = 128
    # encoder layers
    num_encoder_layers: int = 2
    # decoder layers
    num_decoder_layers: int = 2
    # attention heads per layer (must divide d_model)
    num_heads: int = 4
    # width of the feed-forward block
    ff_size: int = 512
    # dropout on embeddings, attention and feed-forward; 0.0 makes runs bit-comparable
    dropout: float = 0.1
    # tokens per side, end-of-sentence included; longer pairs are left out of the data
    max_len: int = 32
    # label smoothing of the cross-entropy (Szegedy et al., 2016); 0.0 = plain cross-entropy
    label_smoothing: float = 0.1

    def __post_init__(self) -> None:
        for name in ("d_model", "num_encoder_layers", "num_decoder_layers", "num_heads", "ff_size"):
            value = getattr(self, name)
            _require(value >= 1, f"task.model.{name}={value} is invalid: it must be >= 1")
        _require(
            self.d_model % self.num_heads == 0,
            f"task.model.num_heads={self.num_heads} does not divide task.model.d_model="
            f"{self.d_model}: choose heads that divide d_model",
        )
        _require(
            0.0 <= self.dropout < 1.0,
            f"task.model.dropout={self.dropout} is invalid: it must be in [0, 1)",
        )
        _require(
            4 <= self.max_len <= 1024,
            f"task.model.max_len={self.max_len} is invalid: use 4..1024 tokens",
        )
        _require(
            0.0 <= self.label_smoothing < 1.0,
            f"task.model.label_smoothing={self.label_smoothing} is invalid: it must be in [0, 1)",
        )


@dataclass
class TranslationDataConfig:
    """Where the German-English pairs come from and how they are tokenised and evaluated."""

    # .tsv files (german<TAB>english) or name.de + name.en pairs, paths or globs; empty = the
    # installed sources (Debian trans-de-en, gettext catalogs)
    files: List[str] = field(default_factory=list)
    # size of the shared BPE vocabulary asked of the tokenizer trainer (small corpora stop earlier)
    vocab_size: int = 8000
    # share of the pairs held out for validation
    val_fraction: float = 0.05
    # validation pairs used at most (the first ones of the fixed split); 0 = all
    max_val_samples: int = 1000
    # validation pairs translated greedily for BLEU at each evaluation; 0 = no BLEU
    bleu_samples: int = 200
    # pairs longer than this many characters on either side are left out
    max_chars: int = 200
    # where tokenizers and token ids are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _require(
            self.vocab_size >= 200,
            f"task.data.vocab_size={self.vocab_size} is too small: use at least 200",
        )
        _require(
            0.0 < self.val_fraction < 0.5,
            f"task.data.val_fraction={self.val_fraction} is invalid: it must be in (0, 0.5)",
        )
        for name in ("max_val_samples", "bleu_samples"):
            value = getattr(self, name)
            _require(value >= 0, f"task.data.{name}={value} is invalid: use >= 0")
        _require(
            self.max_chars >= 8,
            f"task.data.max_chars={self.max_chars} is too small: use at least 8",
        )


@dataclass
class TranslationTaskConfig:
    """German-to-English translation; label-smoothed cross-entropy summed over target tokens."""

    name: str = "translation"
    model: TranslationModelConfig = field(default_factory=TranslationModelConfig)
    data: TranslationDataConfig = field(default_factory=TranslationDataConfig)
