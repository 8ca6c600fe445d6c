"""Schemas of ``task=hf`` (a Hugging Face ``transformers`` model from a local directory) and
``task=dataset`` (a user's map-style ``torch.utils.data.Dataset`` plus model).

Only cheap checks live here (values, paths that must exist): nothing is imported or read beyond
a directory listing. A hub name instead of a local directory, a ``.bin``-only model directory, a
missing or empty data file are refused here, before anything starts; the columns of the data
files are checked by :func:`hetseq_hpc.tasks.hf.checks.check_hf_task` (before any rank starts).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from hetseq_hpc.config.common import require, require_finite
from hetseq_hpc.errors import ConfigError

#: task.model.kind values (``auto`` = from ``config.architectures``)
HF_KINDS = ("auto", "causal_lm", "masked_lm", "classification", "seq2seq")
#: data file suffixes task=hf reads (stdlib readers; .parquet with the optional pyarrow)
HF_DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".json", ".csv", ".tsv", ".parquet")
#: of those, the binary formats: not probed as UTF-8 text (their reader checks them)
HF_BINARY_SUFFIXES = (".parquet",)


def _not_local(key: str, value: str) -> ConfigError:
    return ConfigError(
        f"{key}={value!r} is not a local directory or file: hetseq_hpc downloads nothing (no "
        "hub names); pass a local directory holding config.json, the tokenizer and *.safetensors "
        f"(e.g. written by save_pretrained, or fetched beforehand with hf download {value} "
        "--local-dir DIR)"
    )


def check_model_dir(path: str) -> str:
    """The absolute ``task.model.path``; it must be a local directory with ``config.json`` and
    ``*.safetensors`` weights.

    Raises:
        ConfigError: not a local directory (a hub name), no ``config.json``, or weights only as
            a pickle (``*.bin``/``*.pt``: refused, they can run code when loaded). One line.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(full):
        raise _not_local("task.model.path", path)
    names = os.listdir(full)
    if "config.json" not in names:
        raise ConfigError(
            f"task.model.path={path!r} has no config.json: point it at a directory "
            "written by save_pretrained (config.json, tokenizer, *.safetensors)"
        )
    if not any(n.endswith(".safetensors") for n in names):
        pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        what = (
            f"has only pickle weights ({', '.join(pickles[:3])})"
            if pickles
            else "has no *.safetensors weights"
        )
        raise ConfigError(
            f"task.model.path={path!r} {what}: hetseq_hpc loads pretrained weights from "
            "safetensors only (a pickle can run code); convert once with model.save_pretrained"
            "(dir, safe_serialization=True), or use task.model.config=<dir> for a random init"
        )
    return full


def check_data_file(path: str) -> str:
    """The absolute path of one ``task.data.files`` entry.

    Raises:
        ConfigError: missing, not a file, empty, of an unknown format, or ``.parquet`` while
            pyarrow is not installed (looked up, not imported). One line.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise ConfigError(
            f"task.data.files: {path!r} does not exist: give existing local files "
            "(.txt, .jsonl, .csv, .parquet), e.g. "
            "task.data.files=[/data/train.jsonl]"
        )
    if not os.path.isfile(full):
        raise ConfigError(f"task.data.files: {path!r} is not a file: list the files themselves")
    if os.path.getsize(full) == 0:
        raise ConfigError(
            f"task.data.files: {path!r} is empty (0 bytes): give a file with "
            "text, or drop it from the list"
        )
    suffix = os.path.splitext(full)[1].lower()
    if suffix not in HF_DATA_SUFFIXES:
        raise ConfigError(
            f"task.data.files: {path!r} has suffix {suffix or '(none)'!r}: use "
            f"one of {', '.join(HF_DATA_SUFFIXES)}"
        )
    if suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(
            f"task.data.files: {path!r} is Parquet, which needs pyarrow: pip "
            "install 'hetseq-hpc[parquet]' (or convert it to JSON lines: one "
            '{"text": ...} object per line)'
        )
    return full


@dataclass
class HfModelConfig:
    """Which Hugging Face model, what head, and how wide a sample is."""

    # local directory with config.json + tokenizer + *.safetensors (pretrained weights)
    path: Optional[str] = None
    # config.json (or its directory) for a random init instead of path
    config: Optional[str] = None
    # tokenizer directory; null = task.model.path (or task.model.config's directory)
    tokenizer: Optional[str] = None
    # causal_lm | masked_lm | classification | seq2seq | auto (from config.architectures)
    kind: str = "auto"
    # null = the model's own dropout values (a fine-tune keeps them); a number sets every
    # dropout probability of the model's config (docs/tasks.md says which); 0.0 = off
    dropout: Optional[float] = None
    # tokens per sample: packed rows (LM) or padded/truncated texts (classification, the
    # source of seq2seq)
    max_seq_len: int = 128
    # seq2seq: target tokens per sample (padded/truncated); null = max_seq_len
    max_target_len: Optional[int] = None

    def __post_init__(self) -> None:
        require_finite(self, "task.model")
        require(
            self.kind in HF_KINDS,
            f"task.model.kind={self.kind!r} is unknown: use one of {', '.join(HF_KINDS)}",
        )
        require(
            self.dropout is None or 0.0 <= self.dropout < 1.0,
            f"task.model.dropout={self.dropout} is invalid: it must be in [0, 1)",
        )
        require(
            self.max_seq_len >= 4,
            f"task.model.max_seq_len={self.max_seq_len} is too short: use at least 4 tokens",
        )
        require(
            self.max_target_len is None or self.max_target_len >= 2,
            f"task.model.max_target_len={self.max_target_len} is too short: use at least 2 "
            "tokens (or null for max_seq_len)",
        )

    def check_paths(self) -> None:
        """Exactly one of ``path``/``config``; they (and ``tokenizer``) must be local.

        Raises:
            ConfigError: both or neither given; a path that is not local (a hub name); a
                ``.bin``-only model directory (:func:`check_model_dir`). One line.
        """
        require(
            (self.path is None) != (self.config is None),
            "task.model.path and task.model.config: give exactly one, path=<dir> (pretrained "
            "weights) or config=<config.json or dir> (random init)",
        )
        if self.path is not None:
            self.path = check_model_dir(self.path)
        if self.config is not None:
            full = os.path.abspath(os.path.expanduser(self.config))
            if not os.path.exists(full):
                raise _not_local("task.model.config", self.config)
            self.config = full
        if self.tokenizer is not None:
            full = os.path.abspath(os.path.expanduser(self.tokenizer))
            if not os.path.isdir(full):
                raise _not_local("task.model.tokenizer", self.tokenizer)
            self.tokenizer = full


@dataclass
class HfDataConfig:
    """The user's local files and how they become samples."""

    # .txt (one sample per line; packed for LM), .jsonl/.json (JSON lines), .csv/.tsv,
    # .parquet (needs pyarrow: pip install 'hetseq-hpc[parquet]')
    files: List[str] = field(default_factory=list)
    # the text column of JSON lines / CSV / Parquet files
    text_field: str = "text"
    # the label column (classification): integers 0..K-1, or strings (sorted into 0..K-1)
    label_field: str = "label"
    # seq2seq: the input and the output text columns of JSON lines / CSV / Parquet files
    source_field: str = "source"
    target_field: str = "target"
    # LM: join the texts and cut rows of exactly max_seq_len tokens (true), or one padded row
    # per text (false); classification always pads one row per text
    pack: bool = True
    # share of the samples held out for validation (a fixed split)
    val_fraction: float = 0.05
    # masked LM: share of tokens selected for prediction
    mask_prob: float = 0.15
    # texts per encode_batch call of the Rust tokenizer (all cores; also capped at 4 M characters)
    encode_batch: int = 20000
    # where token ids are cached; null = $HETSEQ_CACHE, else ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        require_finite(self, "task.data")
        require(
            0.0 < self.val_fraction < 0.5,
            f"task.data.val_fraction={self.val_fraction} is invalid: it must be in (0, 0.5)",
        )
        require(
            0.0 < self.mask_prob < 1.0,
            f"task.data.mask_prob={self.mask_prob} is invalid: it must be in (0, 1)",
        )
        require(
            self.encode_batch >= 1,
            f"task.data.encode_batch={self.encode_batch} is invalid: use >= 1",
        )


@dataclass
class HfTaskConfig:
    """A Hugging Face ``transformers`` model (causal LM, masked LM, sequence classification,
    seq2seq)
    fine-tuned or trained on local files; the loss is summed from the logits (docs/tasks.md)."""

    name: str = "hf"
    model: HfModelConfig = field(default_factory=HfModelConfig)
    data: HfDataConfig = field(default_factory=HfDataConfig)
    #: modules every rank of this task imports: a local run's rank template imports them once
    #: before it forks (:mod:`hetseq_hpc.launch.template`; ~2.3 CPU-s per rank otherwise)
    rank_imports: ClassVar[Tuple[str, ...]] = (
        "transformers",
        "transformers.modeling_utils",
        "transformers.models.auto.modeling_auto",
        "transformers.models.auto.tokenization_auto",
    )

    def __post_init__(self) -> None:
        self.model.check_paths()
        require(
            bool(self.data.files),
            "task.data.files is empty: list your local files, e.g. "
            "task.data.files=[/data/train.jsonl] (.txt, .jsonl, .csv, .parquet)",
        )
        self.data.files = [check_data_file(str(f)) for f in self.data.files]


@dataclass
class DatasetTaskConfig:
    """A map-style ``torch.utils.data.Dataset`` plus model from the user's ``build`` function:
    ``task=dataset task.target=<module>:<function>`` (or ``<module>.<function>``); see
    docs/tasks.md."""

    name: str = "dataset"
    # the function returning {"train": Dataset, "model": ..., ...}, e.g. my_data:build
    target: str = ""
    # folder searched first for target's module; null = the directory the run was started in
    path: Optional[str] = None
    # passed to build(**args): free-form, add keys with +task.args.name=value
    args: Dict[str, Any] = field(default_factory=dict)
    # the model's options (free-form); dropout is passed as build(dropout=...) when build
    # has a dropout parameter (or **kwargs)
    model: Dict[str, Any] = field(default_factory=lambda: {"dropout": 0.1})
    # share of train held out for validation when build returns no "val" dataset; 0 = none
    val_fraction: float = 0.0

    def __post_init__(self) -> None:
        require(
            bool(self.target),
            "task.target is empty: set task.target=<module>:<function> "
            "returning {'train': dataset, 'model': model, ...} (see docs/tasks.md)",
        )
        if self.path is None:
            self.path = os.getcwd()
        self.path = os.path.abspath(os.path.expanduser(self.path))
        require(
            os.path.isdir(self.path),
            f"task.path={self.path!r} is not a folder: point it at "
            "the folder that holds your module (or leave it null)",
        )
        require(
            0.0 <= self.val_fraction < 0.5,
            f"task.val_fraction={self.val_fraction} is invalid: it must be in [0, 0.5)",
        )
