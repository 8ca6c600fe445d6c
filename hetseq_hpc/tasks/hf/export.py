"""A ``task=hf`` run's trained model as a transformers directory (``hetseq-hpc export``).

transformers does the writing: the architecture is rebuilt from the run's model directory
(``task.model.path`` or ``task.model.config``) with the config the run trained (its
``task.model.dropout``, a classifier's labels from the data), the trained weights are loaded
into it under their transformers names, and ``save_pretrained`` writes ``config.json``,
``model.safetensors`` (weights transformers ties, e.g. GPT-2's ``lm_head`` and ``wte``, once;
``from_pretrained`` ties them again) and the tokenizer's files. The task wraps the model as
:class:`~hetseq_hpc.tasks.hf.model.SummedLossModel`'s ``model`` attribute, so every key
of a ``task=hf`` checkpoint starts with :data:`WRAPPER_PREFIX`; :func:`transformers_state`
strips it, here and nowhere else. Only transformers' own classes are written: loading the
directory needs no ``trust_remote_code``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.tasks.hf.model import build_hf_model, load_hf_config, load_tokenizer, model_kind
from hetseq_hpc.tasks.hf.token_cache import pad_id_of

#: the start of every model key of a task=hf checkpoint (``SummedLossModel.model``)
WRAPPER_PREFIX = "model."


def fit_classifier_config(config: Any, label_names: Optional[List[str]], pad_id: int) -> None:
    """Give a classifier's ``config`` the data's classes, as the run builds it: when the
    number of ``label_names`` differs from ``config.num_labels``, set ``num_labels``,
    ``id2label`` and ``label2id`` from them (None: keep the config's); a missing
    ``pad_token_id`` becomes ``pad_id`` (the cache's pad id, :func:`pad_id_of`)."""
    if label_names is not None and getattr(config, "num_labels", None) != len(label_names):
        config.num_labels = len(label_names)
        config.id2label = {i: name for i, name in enumerate(label_names)}
        config.label2id = {name: i for i, name in config.id2label.items()}
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = int(pad_id)


def transformers_state(model_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The model state of a ``task=hf`` checkpoint under transformers' names:
    ``model.transformer.wte.weight`` -> ``transformer.wte.weight`` (:data:`WRAPPER_PREFIX`).

    Raises:
        CheckpointError: a key does not start with the prefix (not a ``task=hf`` model).
    """
    stray = [k for k in model_state if not k.startswith(WRAPPER_PREFIX)]
    if stray:
        raise CheckpointError(
            f"the checkpoint's model key {stray[0]!r} does not start with {WRAPPER_PREFIX!r}: "
            "it is not a task=hf model; export it as one file with --out FILE.safetensors"
        )
    return {k[len(WRAPPER_PREFIX) :]: v for k, v in model_state.items()}


def _tied_groups(model: nn.Module) -> List[List[str]]:
    """Names of each parameter the model holds under more than one name (tied weights)."""
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def load_trained(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load ``state`` (transformers' names) into ``model``: every entry used, every tensor
    of the model given (a tied weight under at least one of its names; under several, equal).

    Raises:
        CheckpointError: a missing, unexpected or mis-shaped tensor, or tied names that
            differ; one line naming the first.
    """
    fix = "export the run with the model directory it trained (task.model.path/config)"
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # size mismatch
        detail = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), "")
        raise CheckpointError(
            f"the trained weights do not fit the model directory's architecture "
            f"({detail or type(exc).__name__}): {fix}"
        ) from None
    for group in _tied_groups(model):
        given = [name for name in group if name in state]
        if given:
            missing = [k for k in missing if k not in group]
        if any(not torch.equal(state[given[0]], state[name]) for name in given[1:]):
            raise CheckpointError(
                f"the checkpoint holds different values for the tied weights {given}: {fix}"
            )
    if missing or unexpected:
        what = f"no {missing[0]!r}" if missing else f"an unexpected {unexpected[0]!r}"
        raise CheckpointError(
            f"the checkpoint's model has {what} ({len(missing)} missing, {len(unexpected)} "
            f"unexpected tensors): {fix}"
        )


@dataclass
class PretrainedExport:
    """What ``save_pretrained`` writes for one ``task=hf`` run, read before any checkpoint.

    Attributes:
        config: the transformers config the run trained (``PretrainedConfig``).
        kind: ``causal_lm``, ``masked_lm``, ``classification`` or ``seq2seq``.
        tokenizer: the run's fast tokenizer.
        model_cfg: the run's ``task.model`` group
            (:class:`~hetseq_hpc.config.hf_tasks.HfModelConfig`).
    """

    config: Any
    kind: str
    tokenizer: Any
    model_cfg: Any

    @classmethod
    def for_run(
        cls, model_cfg: Any, label_names: Callable[[], Optional[List[str]]]
    ) -> PretrainedExport:
        """Read the config and tokenizer of the run's ``task.model`` group; a classifier gets
        the classes ``label_names()`` returns (the data's; None keeps the config's).

        Raises:
            ConfigError: the model directory's config or tokenizer cannot be read.
        """
        config = load_hf_config(model_cfg)
        kind = model_kind(model_cfg, config)
        tokenizer = load_tokenizer(model_cfg)
        if kind == "classification":
            fit_classifier_config(config, label_names(), pad_id_of(tokenizer))
        return cls(config, kind, tokenizer, model_cfg)

    def build(self, model_state: Dict[str, torch.Tensor]) -> nn.Module:
        """The transformers model (fp32) holding ``model_state`` (a ``task=hf``
        checkpoint's ``model`` entry), in eval mode.

        Raises:
            CheckpointError: the state does not fit the architecture (:func:`load_trained`).
        """
        from_config = dataclasses.replace(self.model_cfg, path=None)  # random init, replaced
        model = build_hf_model(from_config, self.config, self.kind)
        load_trained(model, transformers_state(model_state))
        return model.eval()

    def save(self, model: nn.Module, directory: Path) -> None:
        """``model.save_pretrained`` (safetensors) and ``tokenizer.save_pretrained`` into the
        existing folder ``directory``; raises what they raise (``OSError`` for a full disk)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
