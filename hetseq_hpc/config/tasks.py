"""Task schemas: what is trained, on which data (``task=<name>``: bert, image, translation, custom)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hetseq_hpc.config.common import require, require_finite


def _at_least_one(obj, where: str, names) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= 1, f"{where}.{name}={value} is invalid: it must be >= 1")


def _dropout_ok(dropout: float) -> None:
    require(0.0 <= dropout < 1.0, f"task.model.dropout={dropout} is invalid: it must be in [0, 1)")


def _val_fraction_ok(fraction: float) -> None:
    require(
        0.0 < fraction < 0.5,
        f"task.data.val_fraction={fraction} is invalid: it must be in (0, 0.5)",
    )


def _vocab_ok(vocab_size: int) -> None:
    require(vocab_size >= 200, f"task.data.vocab_size={vocab_size} is too small: use at least 200")


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
        _at_least_one(
            self, "task.model", ("hidden_size", "num_layers", "num_heads", "intermediate_size")
        )
        require(
            self.hidden_size % self.num_heads == 0,
            f"task.model.num_heads={self.num_heads} does not divide task.model.hidden_size="
            f"{self.hidden_size}: choose heads that divide the hidden size",
        )
        _dropout_ok(self.dropout)
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
        _vocab_ok(self.vocab_size)
        _val_fraction_ok(self.val_fraction)
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


@dataclass
class ImageModelConfig:
    """Size of the ResNet-style CNN (He et al., 2016) with GroupNorm (Wu & He, 2018)."""

    # channels of the first stage; each later stage doubles them
    width: int = 16
    # stages; every stage after the first halves the spatial size
    num_stages: int = 3
    # residual blocks per stage
    blocks_per_stage: int = 1
    # GroupNorm groups (must divide width); BatchNorm is not used: it breaks exact uneven batches
    groups: int = 8
    # dropout before the classifier; 0.0 makes runs bit-comparable
    dropout: float = 0.1

    def __post_init__(self) -> None:
        require_finite(self, "task.model")
        _at_least_one(self, "task.model", ("width", "num_stages", "blocks_per_stage", "groups"))
        require(
            self.width % self.groups == 0,
            f"task.model.groups={self.groups} does not divide task.model.width={self.width}: "
            "choose groups that divide the width (e.g. 8 for width 16)",
        )
        _dropout_ok(self.dropout)


@dataclass
class ImageDataConfig:
    """Where the images come from and how they are augmented."""

    # a folder with one sub-folder per class, or an .npz with `images`/`labels`; null = built-in
    # (Debian dataset-fashion-mnist, else scikit-learn's digits)
    path: Optional[str] = None
    # resize every image to this many pixels square; null = keep the source's size
    image_size: Optional[int] = None
    # share of the images held out for validation (sources without their own test split)
    val_fraction: float = 0.1
    # validation images used at most (the first ones of the fixed split); 0 = all
    max_val_samples: int = 2000
    # random-crop padding in pixels for training images; 0 = no crop
    pad: int = 2
    # random horizontal flips of training images (turn off for text; off for the digits fallback)
    flip: bool = True
    # where decoded image arrays are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        require_finite(self, "task.data")
        if self.image_size is not None:
            require(
                4 <= self.image_size <= 512,
                f"task.data.image_size={self.image_size} is invalid: use 4..512 pixels, or null",
            )
        _val_fraction_ok(self.val_fraction)
        require(
            self.max_val_samples >= 0,
            f"task.data.max_val_samples={self.max_val_samples} is invalid: use >= 0 (0 = all)",
        )
        require(
            0 <= self.pad <= 16,
            f"task.data.pad={self.pad} is invalid: use 0..16 pixels (0 = no random crop)",
        )


@dataclass
class ImageTaskConfig:
    """Image classification: top-1 accuracy, cross-entropy summed over samples."""

    name: str = "image"
    model: ImageModelConfig = field(default_factory=ImageModelConfig)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)


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
    max_len: int = 24
    # label smoothing of the cross-entropy (Szegedy et al., 2016); 0.0 = plain cross-entropy
    label_smoothing: float = 0.1

    def __post_init__(self) -> None:
        require_finite(self, "task.model")
        _at_least_one(
            self,
            "task.model",
            ("d_model", "num_encoder_layers", "num_decoder_layers", "num_heads", "ff_size"),
        )
        require(
            self.d_model % self.num_heads == 0,
            f"task.model.num_heads={self.num_heads} does not divide task.model.d_model="
            f"{self.d_model}: choose heads that divide d_model",
        )
        _dropout_ok(self.dropout)
        require(
            4 <= self.max_len <= 1024,
            f"task.model.max_len={self.max_len} is invalid: use 4..1024 tokens",
        )
        require(
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
    vocab_size: int = 4000
    # share of the pairs held out for validation
    val_fraction: float = 0.05
    # validation pairs used at most (the first ones of the fixed split); 0 = all
    max_val_samples: int = 500
    # validation pairs translated greedily for BLEU at each evaluation; 0 = no BLEU
    bleu_samples: int = 100
    # pairs longer than this many characters on either side are left out
    max_chars: int = 100
    # where tokenizers and token ids are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        require_finite(self, "task.data")
        _vocab_ok(self.vocab_size)
        _val_fraction_ok(self.val_fraction)
        for name in ("max_val_samples", "bleu_samples"):
            value = getattr(self, name)
            require(value >= 0, f"task.data.{name}={value} is invalid: use >= 0")
        require(
            self.max_chars >= 8,
            f"task.data.max_chars={self.max_chars} is too small: use at least 8",
        )


@dataclass
class TranslationTaskConfig:
    """German-to-English translation; label-smoothed cross-entropy summed over target tokens."""

    name: str = "translation"
    model: TranslationModelConfig = field(default_factory=TranslationModelConfig)
    data: TranslationDataConfig = field(default_factory=TranslationDataConfig)


@dataclass
class CustomTaskConfig:
    """A user's own task: ``task=custom task.target=<module>.<Class>`` (a subclass of
    :class:`hetseq_hpc.tasks.Task`, see docs/tasks.md); ``task.args.*`` and ``task.model.*``
    are free-form options that the class reads from ``cfg.args`` / ``cfg.model`` (plain dicts)."""

    name: str = "custom"
    # dotted path of the task class, e.g. examples.char_lm.CharLMTask
    target: str = ""
    # folder searched first for target's module; null = the directory the run was started in
    path: Optional[str] = None
    # the model's options (free-form); dropout keeps BERT's name, task.model.dropout
    model: Dict[str, Any] = field(default_factory=lambda: {"dropout": 0.1})
    # the task's own options (free-form): add new ones with +task.args.name=value
    args: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(
            bool(self.target),
            "task.target is empty: set task.target=<module>.<Class>, e.g. "
            "task.target=examples.char_lm.CharLMTask (see docs/tasks.md)",
        )
        if self.path is None:
            self.path = os.getcwd()  # recorded, so every rank imports from the same folder
        self.path = os.path.abspath(os.path.expanduser(self.path))
        require(
            os.path.isdir(self.path),
            f"task.path={self.path!r} is not a folder: point it at "
            "the folder that holds your task's module (or leave it null)",
        )
        # the module is imported (and its class checked) by hetseq_hpc.cli.preflight.check_task_code
        # before any rank starts: configuration itself never runs a user's code
