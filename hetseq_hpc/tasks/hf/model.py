"""A Hugging Face ``transformers`` model with a SUMMED loss, from local files only.

The model's own ``labels=`` loss is a MEAN over the batch's tokens (or samples): averaged per
rank, uneven ranks would weight each rank's tokens differently. :class:`SummedLossModel` calls
the model without labels and sums ``cross_entropy(logits, labels, reduction="sum",
ignore_index=-100)`` itself, so ``loss / count`` over the global batch is exact.

Nothing is downloaded: ``HF_HUB_OFFLINE`` is set and every ``from_pretrained`` gets
``local_files_only=True``; weights load from safetensors only (``use_safetensors=True``). No code
of a model directory runs: every call passes ``trust_remote_code=False`` (transformers never
asks), and a config or tokenizer naming code (``auto_map``) is refused before it is loaded
(:mod:`hetseq_hpc.tasks.hf.model_files`). Progress bars and advisory warnings are off.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks.hf.model_files import check_no_custom_code, check_weights
from hetseq_hpc.tasks.samples import IGNORE_INDEX

#: a config attribute holds a dropout probability when its name ends in one of these (BERT's
#: hidden_dropout_prob, GPT-2's resid_pdrop, T5's dropout_rate, GPT-Neo's resid_dropout,
#: DeBERTa's pooler_dropout, Llama's attention_dropout, ...) and its value is a float
DROPOUT_SUFFIXES = ("dropout", "_pdrop", "dropout_prob", "dropout_rate", "dropout_p")
#: set even while None (BERT-style heads fall back to hidden_dropout_prob when it is None)
DROPOUT_NONE_OK = ("classifier_dropout",)
#: files of which a tokenizer directory holds at least one (tokenizer.json for a fast one)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "merges.txt",
)
#: architecture suffix -> kind, for ``task.model.kind=auto``
ARCH_KINDS = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForPreTraining", "masked_lm"),
    ("ForSequenceClassification", "classification"),
    ("ForConditionalGeneration", "seq2seq"),
)
KINDS = ("causal_lm", "masked_lm", "classification", "seq2seq")


#: never run a model directory's code (passed to every transformers call that loads one)
NO_REMOTE_CODE = {"trust_remote_code": False}


def offline() -> None:
    """Make every Hugging Face call local (no network, no telemetry) and quiet: no progress
    bars (transformers' "Loading weights", the Hub's) and no advisory warnings, in the
    launcher and in every rank (environment variables before transformers is imported, its
    own switch after; ``datasets`` is quietened where it is imported,
    :func:`hetseq_hpc.tasks.hf.records._import_datasets`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _config_source(model_cfg: Any) -> str:
    return model_cfg.path or model_cfg.config


def load_hf_config(model_cfg: Any) -> Any:
    """The ``PretrainedConfig`` of ``task.model.path`` or ``task.model.config`` (a directory or
    a ``config.json``), with every dropout attribute it has set to ``task.model.dropout``
    (None: the model's own values are kept).

    Raises:
        ConfigError: the config cannot be read (one line with the reason).
    """
    offline()
    from transformers import AutoConfig

    source = _config_source(model_cfg)
    check_no_custom_code(source, "task.model.path" if model_cfg.path else "task.model.config")
    try:
        if os.path.isfile(source):
            import json
            from pathlib import Path

            data = json.loads(Path(source).read_text(encoding="utf-8"))
            model_type = data.pop("model_type", None)
            if not model_type:
                raise ValueError("it has no model_type")
            config = AutoConfig.for_model(model_type, **data)
        else:
            config = AutoConfig.from_pretrained(source, local_files_only=True, **NO_REMOTE_CODE)
    except Exception as exc:
        raise ConfigError(
            f"model config {source!r} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): give a "
            "config.json written by save_pretrained"
        ) from None
    set_dropout(config, model_cfg.dropout)
    return config


def dropout_attributes(config: Any) -> List[str]:
    """Names of the dropout probabilities of ``config`` (:data:`DROPOUT_SUFFIXES`, float
    values; ``classifier_dropout`` also when None), nested configs (``text_config``, an
    encoder-decoder's ``encoder``/``decoder``) as ``name.attribute``."""
    from transformers import PretrainedConfig

    names = []
    for name, value in sorted(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            names += [f"{name}.{inner}" for inner in dropout_attributes(value)]
        elif name.lower().endswith(DROPOUT_SUFFIXES) and (
            (isinstance(value, (float, int)) and not isinstance(value, bool))
            or (value is None and name in DROPOUT_NONE_OK)
        ):
            names.append(name)
    return names


def set_dropout(config: Any, dropout: Optional[float]) -> List[str]:
    """Set every dropout probability of ``config`` (:func:`dropout_attributes`) to
    ``dropout``; None leaves the model's own values. Returns the names set."""
    if dropout is None:
        return []
    wired = dropout_attributes(config)
    for name in wired:
        target = config
        *outer, leaf = name.split(".")
        for part in outer:
            target = getattr(target, part)
        setattr(target, leaf, float(dropout))
    return wired


def model_kind(model_cfg: Any, config: Any) -> str:
    """``task.model.kind``, or for ``auto`` the kind of ``config.architectures[0]``.

    Raises:
        ConfigError: ``auto`` and the architecture is not one of the supported heads.
    """
    if model_cfg.kind != "auto":
        return model_cfg.kind
    for arch in getattr(config, "architectures", None) or []:
        for suffix, kind in ARCH_KINDS:
            if arch.endswith(suffix):
                return kind
    raise ConfigError(
        f"task.model.kind=auto cannot tell the head from config.architectures="
        f"{getattr(config, 'architectures', None)}: set task.model.kind="
        f"{'|'.join(KINDS)}"
    )


def _tokenizer_key(model_cfg: Any) -> str:
    if model_cfg.tokenizer:
        return "task.model.tokenizer"
    return "task.model.path" if model_cfg.path else "task.model.config"


def load_tokenizer(model_cfg: Any) -> Any:
    """The fast (Rust) tokenizer of ``task.model.tokenizer``, else of the model directory.

    Raises:
        ConfigError: no tokenizer there, or only a slow (Python) one.
    """
    offline()
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or _config_source(model_cfg)
    if os.path.isfile(source):
        source = os.path.dirname(source)
    check_no_custom_code(source, _tokenizer_key(model_cfg))
    if not any(os.path.isfile(os.path.join(source, name)) for name in TOKENIZER_FILES):
        # transformers 5 would build an EMPTY tokenizer from the config's model type
        raise ConfigError(
            f"no tokenizer in {source!r} (none of {', '.join(TOKENIZER_FILES[:3])}"
            ", ...): save one there (tokenizer.save_pretrained) or set "
            "task.model.tokenizer=<dir>"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, local_files_only=True, use_fast=True, **NO_REMOTE_CODE
        )
    except Exception as exc:
        raise ConfigError(
            f"no tokenizer could be loaded from {source!r} ({type(exc).__name__}):"
            " save one there (tokenizer.save_pretrained) or set "
            "task.model.tokenizer=<dir>"
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"the tokenizer in {source!r} is a slow (Python) one: save a fast "
            "tokenizer (tokenizer.json) there"
        )
    return tokenizer


def build_hf_model(model_cfg: Any, config: Any, kind: str) -> nn.Module:
    """The transformers model: ``from_pretrained`` (safetensors, local) for ``task.model.path``,
    ``from_config`` (random init, the caller seeds torch) for ``task.model.config``. A
    classification head missing from the checkpoint is initialised fresh. Parameters are fp32
    always (:func:`fp32_kwargs`).

    Raises:
        ConfigError: a weights file is missing or damaged (:func:`~hetseq_hpc.tasks.hf.model_files.
            check_weights`; one line).
    """
    offline()
    import transformers

    cls = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "masked_lm": transformers.AutoModelForMaskedLM,
        "classification": transformers.AutoModelForSequenceClassification,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[kind]
    fp32 = fp32_kwargs()
    if model_cfg.path is None:
        return cls.from_config(config, **fp32, **NO_REMOTE_CODE)
    check_weights(model_cfg.path)  # one line for a damaged file, not the library's text
    return cls.from_pretrained(
        model_cfg.path,
        config=config,
        local_files_only=True,
        use_safetensors=True,
        ignore_mismatched_sizes=kind == "classification",
        **fp32,
        **NO_REMOTE_CODE,
    )


def fp32_kwargs() -> Dict[str, Any]:
    """The keyword that makes ``from_pretrained``/``from_config`` build fp32 parameters whatever
    dtype the checkpoint or ``config.dtype`` holds (transformers 5 defaults to ``dtype="auto"``:
    a bf16 checkpoint would train bf16 weights, gradients and AdamW state; the ranks autocast
    instead). ``dtype=`` from transformers 4.56 on, ``torch_dtype=`` before."""
    import transformers

    major, minor = (int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


class SummedLossModel(nn.Module):
    """Wraps a transformers model: ``forward(input_ids, attention_mask, labels)`` -> the 0-dim
    SUM of the cross-entropy over every label that is not ``-100``.

    Shapes: ``input_ids``, ``attention_mask``: ``(B, T)`` int64. ``labels``: ``(B, T)`` for
    language models, already aligned with the logits (causal LM: ``labels[:, t]`` is the token
    after position ``t``), ``(B,)`` class ids for classification, or ``(B, T')`` target ids for
    seq2seq, which also passes ``decoder_input_ids`` ``(B, T')`` (the labels shifted right).
    """

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model = model
        self.kind = kind

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The model's logits: ``(B, T, vocab)`` (LM, seq2seq: ``T'``) or ``(B, classes)``."""
        extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        decoder_input_ids: Optional[torch.Tensor] = None,
        return_logits: bool = False,
    ) -> Any:
        """0-dim SUM of the per-unit cross-entropy (never the model's mean ``labels=`` loss);
        ``(loss, logits)`` with ``return_logits`` (validation: accuracy from the same pass)."""
        logits = self.logits(input_ids, attention_mask, decoder_input_ids)
        loss = F.cross_entropy(
            logits.flatten(0, -2).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return (loss, logits) if return_logits else loss


def no_split_units(model: nn.Module) -> List[nn.Module]:
    """The submodules whose class name is in the model's ``_no_split_modules`` (transformer
    blocks), outermost first, leaving out any that holds a weight tied to a module outside it
    (BERT's word embeddings, tied to the MLM decoder, stay in the root unit); empty when the
    model lists none."""
    inner = getattr(model, "model", model)
    names = set(getattr(inner, "_no_split_modules", None) or [])
    owners: dict = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    tied = [set(n) for n in owners.values() if len(n) > 1]
    chosen: List[nn.Module] = []
    for prefix, module in inner.named_modules():
        if (
            module is inner
            or type(module).__name__ not in names
            or any(any(m is module for m in c.modules()) for c in chosen)
        ):
            continue
        inside = {f"{prefix}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)}
        if any(group & inside and not group <= inside for group in tied):
            continue
        chosen.append(module)
    return chosen


def special_ids(tokenizer: Any) -> Tuple[int, ...]:
    """The tokenizer's special token ids (never masked in masked LM)."""
    return tuple(sorted(set(int(i) for i in tokenizer.all_special_ids)))
