"""The BERT masked-language-modelling task."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from hetseq_hpc.config.schema import BertTaskConfig
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.bert.mlm_data import (
    IGNORE_INDEX,
    PackedText,
    build_packed_text,
    cache_key,
    load_packed_text,
    make_mlm_batch,
    random_batches,
    token_cache,
)
from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
from hetseq_hpc.tasks.bert.text_corpus import load_corpus
from hetseq_hpc.tasks.cache import cache_root
from hetseq_hpc.tasks.planning import EncoderShape, PlanningModel


class BertTask(Task):
    """Masked-language modelling; loss units are masked tokens; validation: the base class's
    mean loss per masked token and perplexity.

    Args:
        cfg: the ``task`` config group.
        seed: ``trainer.seed`` (masking seed).
    """

    name = "bert"
    unit_name = "masked tokens"

    def __init__(self, cfg: BertTaskConfig, seed: int):
        super().__init__(cfg, seed)
        self.corpus = load_corpus(cfg.data.files)
        self.directory = cache_root(cfg.data.cache_dir) / cache_key(
            self.corpus, cfg.data.vocab_size, cfg.model.max_seq_len
        )
        self._data: Optional[PackedText] = None

    def prepare(self) -> None:
        """Train/load the tokenizer and write the packed token cache (rank 0, before the others)."""
        build_packed_text(
            self.corpus, self.cfg.data.vocab_size, self.cfg.model.max_seq_len, self.directory
        )

    def load(self) -> None:
        """Memory-map the packed tokens and split train/validation (every rank)."""
        self._data = load_packed_text(self.directory, self.cfg.data.val_fraction)

    def data_fingerprint(self) -> str:
        """SHA-256 (16 hex digits) of the trained WordPiece tokenizer: ``tokenizers``' trainer
        breaks ties in hash order, so two prepares of the same corpus (another machine, another
        cache directory) give other token ids, and a checkpoint means something else there."""
        import hashlib

        return hashlib.sha256((self.directory / "tokenizer.json").read_bytes()).hexdigest()[:16]

    @property
    def data(self) -> PackedText:
        """The loaded data; raises DataError before :meth:`load`."""
        return self.loaded(self._data)

    @property
    def num_train(self) -> int:
        """Training sequences."""
        return int(self.data.train_index.size)

    @property
    def num_val(self) -> int:
        """Validation sequences."""
        return int(self.data.val_index.size)

    @property
    def tokens_per_sample(self) -> int:
        """Tokens per packed sequence, T (``tokens_per_s`` counts every token)."""
        return self.data.seq_len

    @property
    def units_per_sample(self) -> float:
        """Expected masked tokens per sequence, ``mask_prob * (T - 2)`` (``units_per_s``)."""
        return self.cfg.data.mask_prob * (self.cfg.model.max_seq_len - 2)

    def build_model(self) -> BertMaskedLM:
        """A freshly initialised model (seed the RNG first)."""
        return BertMaskedLM(self.cfg.model, self.data.vocab_size)

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """Masked batch of split positions: ``input_ids``/``labels`` of shape ``(len(positions), T)``
        and, for this task's own model, ``masked_positions`` ``(len(positions), P)``: the
        masked tokens' columns, so the head gathers them by index (no host synchronisation;
        a subclass with its own :meth:`build_model` gets ids and labels only)."""
        index = self.data.train_index if split == "train" else self.data.val_index
        rows = index[np.asarray(positions, dtype=np.int64)]
        own_model = type(self).build_model is BertTask.build_model
        return make_mlm_batch(
            self.data, rows, self.cfg.data.mask_prob, self.seed, epoch, split, positions=own_model
        )

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Masked tokens in ``batch`` (the loss normaliser's units)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def planned_vocab_size(self) -> int:
        """The vocabulary the model will have: the prepared tokenizer's (its ``meta.json``) when
        ``prepare`` already ran, else ``task.data.vocab_size``, its ceiling (the built-in corpus
        trains 4,320 of the default 8,192: the planner counted 51 % more embedding bytes than
        the run all-reduces)."""
        cache = token_cache(self.directory)
        if cache.meta_path.is_file():
            try:
                return int(cache.read_meta()["vocab_size"])  # type: ignore[call-overload]
            except Exception:  # damaged: the run will say so; plan with the ceiling
                pass
        return int(self.cfg.data.vocab_size)

    def planning_model(self, on_meta: bool = False) -> PlanningModel:
        """BERT without its data: the model from the config (:meth:`planned_vocab_size` tokens;
        on the ``meta`` device with ``on_meta``), batches of random token rows masked by the
        task's own rule (:func:`~hetseq_hpc.tasks.bert.mlm_data.random_batches`), and the
        encoder's shape (fused attention: the encoder calls ``scaled_dot_product_attention``).
        A subclass with its own model or batches (``examples/hetseq_bert.py``) is planned from
        its data, as any task."""
        if (type(self).build_model, type(self).make_batch) != (
            BertTask.build_model,
            BertTask.make_batch,
        ):
            return super().planning_model(on_meta)
        m, vocab = self.cfg.model, self.planned_vocab_size()
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = BertMaskedLM(m, vocab)
        batches = random_batches(vocab, int(m.max_seq_len), self.cfg.data.mask_prob)
        shape = EncoderShape(
            "BERT",
            m.num_layers,
            m.hidden_size,
            m.num_heads,
            m.max_seq_len,
            m.intermediate_size,
            True,
        )
        return PlanningModel(model, batches, vocab, [], shape)

    def flops_per_sample(self, model: BertMaskedLM) -> float:
        """Training FLOPs per sample at the configured masking rate (for MFU and the planner).

        Needs only the config (packed rows are exactly ``task.model.max_seq_len`` tokens), not
        the loaded data, so the planner calls it on a ``meta``-device model.
        """
        seq = self.cfg.model.max_seq_len
        return model.flops_per_sample(seq, self.cfg.data.mask_prob * (seq - 2))
