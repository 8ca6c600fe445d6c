"""A Hugging Face ``transformers`` model with a SUMMED loss, from local files only.

The model's own ``labels=`` loss is a MEAN over the batch's tokens (or samples): averaged per
rank, uneven ranks would weight each rank's tokens differently. :class:`SummedLossModel` calls
the model without labels and sums ``cross_entropy(logits, labels, reduction="sum",
ignore_index=-100)`` itself, so ``loss / count`` over the global batch is exact.

Nothing is downloaded: ``HF_HUB_OFFLINE`` is set and every ``from_pretrained`` gets
``local_files_only=True``; weights load from safetensors only (``use_safetensors=True``).
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.errors import ConfigError

IGNORE_INDEX = -100
#: config attributes that hold a dropout probability, set from ``task.model.dropout``
DROPOUT_ATTRIBUTES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
                      "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout",
                      "dropout", "attention_dropout", "activation_dropout", "hidden_dropout",
                      "embed_dropout", "classif_dropout", "seq_classif_dropout",
                      "dropout_rate", "emb_dropout", "mlp_dropout")
#: architecture suffix -> kind, for ``task.model.kind=auto``
ARCH_KINDS = (("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"),
              ("ForMaskedLM", "masked_lm"), ("ForPreTraining", "masked_lm"),
              ("ForSequenceClassification", "classification"))
KINDS = ("causal_lm", "masked_lm", "classification")


def offline() -> None:
    """Make every Hugging Face call local (no network, no telemetry)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _config_source(model_cfg: Any) -> str:
    return model_cfg.path or model_cfg.config


def load_hf_config(model_cfg: Any) -> Any:
    """The ``PretrainedConfig`` of ``task.model.path`` or ``task.model.config`` (a directory or
    a ``config.json``), with every dropout attribute it has set to ``task.model.dropout``.

    Raises:
        ConfigError: the config cannot be read (one line with the reason).
    """
    offline()
    from transformers import AutoConfig

    source = _config_source(model_cfg)
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
            config = AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"model config {source!r} cannot be read ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}): give a "
                          "config.json written by save_pretrained") from None
    set_dropout(config, float(model_cfg.dropout))
    return config


def set_dropout(config: Any, dropout: float) -> List[str]:
    """Set every attribute of :data:`DROPOUT_ATTRIBUTES` that ``config`` has (and is not None)
    to ``dropout``; returns their names."""
    wired = []
    for name in DROPOUT_ATTRIBUTES:
        if getattr(config, name, None) is not None or (name == "classifier_dropout"
                                                       and hasattr(config, name)):
            setattr(config, name, dropout)
            wired.append(name)
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
    raise ConfigError(f"task.model.kind=auto cannot tell the head from config.architectures="
                      f"{getattr(config, 'architectures', None)}: set task.model.kind="
                      f"{'|'.join(KINDS)}")


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
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, use_fast=True)
    except Exception as exc:
        raise ConfigError(f"no tokenizer could be loaded from {source!r} ({type(exc).__name__}):"
                          " save one there (tokenizer.save_pretrained) or set "
                          "task.model.tokenizer=<dir>") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer in {source!r} is a slow (Python) one: save a fast "
                          "tokenizer (tokenizer.json) there")
    return tokenizer


def build_hf_model(model_cfg: Any, config: Any, kind: str) -> nn.Module:
    """The transformers model: ``from_pretrained`` (safetensors, local) for ``task.model.path``,
    ``from_config`` (random init, the caller seeds torch) for ``task.model.config``. A
    classification head missing from the checkpoint is initialised fresh."""
    offline()
    import transformers

    cls = {"causal_lm": transformers.AutoModelForCausalLM,
           "masked_lm": transformers.AutoModelForMaskedLM,
           "classification": transformers.AutoModelForSequenceClassification}[kind]
    if model_cfg.path is None:
        return cls.from_config(config)
    return cls.from_pretrained(model_cfg.path, config=config, local_files_only=True,
                               use_safetensors=True, ignore_mismatched_sizes=kind == "classification")


class SummedLossModel(nn.Module):
    """Wraps a transformers model: ``forward(input_ids, attention_mask, labels)`` -> the 0-dim
    SUM of the cross-entropy over every label that is not ``-100``.

    Shapes: ``input_ids``, ``attention_mask``: ``(B, T)`` int64. ``labels``: ``(B, T)`` for
    language models, already aligned with the logits (causal LM: ``labels[:, t]`` is the token
    after position ``t``), or ``(B,)`` class ids for classification.
    """

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model = model
        self.kind = kind

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's logits: ``(B, T, vocab)`` (LM) or ``(B, classes)``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        """0-dim SUM of the per-unit cross-entropy (never the model's mean ``labels=`` loss)."""
        logits = self.logits(input_ids, attention_mask)
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")


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
        if module is inner or type(module).__name__ not in names or any(
                any(m is module for m in c.modules()) for c in chosen):
            continue
        inside = {f"{prefix}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)}
        if any(group & inside and not group <= inside for group in tied):
            continue
        chosen.append(module)
    return chosen


def special_ids(tokenizer: Any) -> Tuple[int, ...]:
    """The tokenizer's special token ids (never masked in masked LM)."""
    return tuple(sorted(set(int(i) for i in tokenizer.all_special_ids)))
