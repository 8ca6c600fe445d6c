"""A built-in task's parameter count from its configuration alone: nothing is built, nothing
imported beyond the config, so the command line can refuse a model that cannot fit before any
process starts (:func:`hetseq_hpc.cli.preflight.check_model_fits`).

The formulas follow the models layer by layer (tests check them against the real models built on
the ``meta`` device). The vocabulary is the configured ``task.data.vocab_size``: the largest the
tokenizer builds.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

#: BERT's token-type embedding rows (hetseq_hpc.tasks.bert.encoder.TYPE_VOCAB_SIZE)
BERT_TYPE_VOCAB = 2


def bert_param_count(
    hidden: int, layers: int, intermediate: int, max_seq_len: int, vocab: int
) -> int:
    """Parameters of :class:`hetseq_hpc.tasks.bert.mlm_model.BertMaskedLM` (decoder tied to
    the word embeddings): embeddings, ``layers`` x (attention 4h² + feed-forward 2hI + biases
    and norms), the prediction head's transform and vocabulary bias."""
    h, i = int(hidden), int(intermediate)
    embeddings = (int(vocab) + int(max_seq_len) + BERT_TYPE_VOCAB) * h + 2 * h
    layer = 4 * h * h + 2 * h * i + 9 * h + i
    head = h * h + 3 * h + int(vocab)
    return embeddings + int(layers) * layer + head


def translation_param_count(
    d_model: int, encoder_layers: int, decoder_layers: int, ff_size: int, max_len: int, vocab: int
) -> int:
    """Parameters of :class:`hetseq_hpc.tasks.translation.transformer.TranslationTransformer`
    (shared embedding and output projection): embeddings, torch's pre-norm encoder layers
    (4d² + 2dF + 9d + F) and decoder layers (8d² + 2dF + 15d + F), two final norms."""
    d, f = int(d_model), int(ff_size)
    embeddings = (int(vocab) + int(max_len) + 1) * d
    encoder = int(encoder_layers) * (4 * d * d + 2 * d * f + 9 * d + f)
    decoder = int(decoder_layers) * (8 * d * d + 2 * d * f + 15 * d + f)
    return embeddings + encoder + decoder + 4 * d


def param_count(task_cfg: Any) -> Optional[int]:
    """The parameter count of a built-in task's model from ``task_cfg`` (``task=bert`` or
    ``translation``); None for a task whose model size depends on its data or code (image,
    a user's task)."""
    name = getattr(task_cfg, "name", None)
    model, data = getattr(task_cfg, "model", None), getattr(task_cfg, "data", None)
    if name == "bert":
        return bert_param_count(
            model.hidden_size,
            model.num_layers,
            model.intermediate_size,
            model.max_seq_len,
            data.vocab_size,
        )
    if name == "translation":
        return translation_param_count(
            model.d_model,
            model.num_encoder_layers,
            model.num_decoder_layers,
            model.ff_size,
            model.max_len,
            data.vocab_size,
        )
    return None


def unit_param_counts(task_cfg: Any) -> Optional[Tuple[int, int]]:
    """``(root, largest block)`` parameters of a built-in task's model as FSDP2 shards it
    (:func:`hetseq_hpc.balance.memory.model_bytes`: the blocks are the transformer layers, the
    root everything else: embeddings, head, final norms); None where :func:`param_count` is."""
    total = param_count(task_cfg)
    if total is None:
        return None
    model = task_cfg.model
    if task_cfg.name == "bert":
        h, i = int(model.hidden_size), int(model.intermediate_size)
        layers = [4 * h * h + 2 * h * i + 9 * h + i] * int(model.num_layers)
    else:
        d, f = int(model.d_model), int(model.ff_size)
        layers = [4 * d * d + 2 * d * f + 9 * d + f] * int(model.num_encoder_layers) + [
            8 * d * d + 2 * d * f + 15 * d + f
        ] * int(model.num_decoder_layers)
    return total - sum(layers), max(layers, default=0)


__all__ = ["bert_param_count", "param_count", "translation_param_count", "unit_param_counts"]
