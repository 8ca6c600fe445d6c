"""``task=hf``: a Hugging Face ``transformers`` model from a local directory, trained on the
user's local files with a loss summed from the logits (docs/tasks.md, "Hugging Face models").

Loss units: predicted tokens (causal LM: every token with a next token in its row; masked LM:
the selected tokens) or samples (classification). Masking is a pure function of
``(seed, epoch, split, row)`` as for ``task=bert``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.cache import cache_root
from hetseq_hpc.tasks.hf.checks import check_model_fits_kind
from hetseq_hpc.tasks.hf.export import fit_classifier_config
from hetseq_hpc.tasks.hf.model import (
    SummedLossModel,
    build_hf_model,
    load_hf_config,
    load_tokenizer,
    model_kind,
    no_split_units,
    set_dropout,
    special_ids,
)
from hetseq_hpc.tasks.hf.seq2seq import (
    build_seq2seq_cache,
    decoder_start_id,
    open_seq2seq_cache,
    seq2seq_batch,
    seq2seq_cache_key,
)
from hetseq_hpc.tasks.hf.token_cache import build_hf_cache, hf_cache_key, open_hf_cache
from hetseq_hpc.tasks.samples import IGNORE_INDEX, fixed_split, mask_tokens, sample_rng

UNIT_NAMES = {
    "causal_lm": "predicted tokens",
    "masked_lm": "masked tokens",
    "classification": "samples",
    "seq2seq": "target tokens",
}


class HfTask(Task):
    """A transformers causal LM, masked LM, sequence classifier or encoder-decoder (seq2seq),
    by ``task.model.kind``.

    Args:
        cfg: the ``task`` group (:class:`~hetseq_hpc.config.hf_tasks.HfTaskConfig`).
        seed: ``trainer.seed`` (masking seed).

    Raises:
        ConfigError: the config or tokenizer cannot be read; a masked LM whose tokenizer has
            no mask token (one line each).
    """

    name = "hf"

    def __init__(self, cfg: Any, seed: int):
        super().__init__(cfg, seed)
        self.config = load_hf_config(cfg.model)
        self.kind = model_kind(cfg.model, self.config)
        self.unit_name = UNIT_NAMES[self.kind]
        self.tokenizer = load_tokenizer(cfg.model)
        self.seq_len = int(cfg.model.max_seq_len)
        check_model_fits_kind(cfg.model, self.config, self.kind, self.tokenizer)
        tokenizer_json = self.tokenizer.backend_tokenizer.to_str()
        if self.kind == "seq2seq":
            self.target_len = int(cfg.model.max_target_len or self.seq_len)
            self.decoder_start = decoder_start_id(self.config)
            key = seq2seq_cache_key(cfg.data, tokenizer_json, self.seq_len, self.target_len)
        else:
            key = hf_cache_key(cfg.data, tokenizer_json, self.kind, self.seq_len)
        self.directory = cache_root(cfg.data.cache_dir) / key
        self._meta: Optional[dict] = None
        self._arrays: Dict[str, np.ndarray] = {}
        self.special = np.asarray(special_ids(self.tokenizer), dtype=np.int64)

    # ------------------------------------------------------------------ data
    def prepare(self) -> None:
        """Tokenise the files into the cache (rank 0; streamed, all cores, atomic)."""
        if self.kind == "seq2seq":
            build_seq2seq_cache(
                self.cfg.data, self.tokenizer, self.seq_len, self.target_len, self.directory
            )
            return
        build_hf_cache(self.cfg.data, self.tokenizer, self.kind, self.seq_len, self.directory)

    def load(self) -> None:
        """Memory-map the cache; a fixed permutation (seed 0) picks the validation rows."""
        self._meta, self._arrays = (
            open_seq2seq_cache if self.kind == "seq2seq" else open_hf_cache
        )(self.directory)
        n = int(self._arrays["tokens"].shape[0])
        self.train_index, self.val_index = fixed_split(n, self.cfg.data.val_fraction)

    @property
    def meta(self) -> dict:
        """The cache's ``meta.json``; raises DataError before :meth:`load`."""
        return self.loaded(self._meta)

    @property
    def num_train(self) -> int:
        """Training rows."""
        return int(self.loaded(self._meta) and self.train_index.size)

    @property
    def num_val(self) -> int:
        """Validation rows."""
        return int(self.loaded(self._meta) and self.val_index.size)

    @property
    def num_labels(self) -> int:
        """Classes (classification): from the data's labels."""
        return len(self.meta["label_names"] or [])

    @property
    def units_per_sample(self) -> float:
        """Mean loss units per row: ``T - 1`` (packed causal LM), ``mask_prob x tokens``
        (masked LM), 1 (classification)."""
        meta = self.meta
        if self.kind == "seq2seq":
            return float(meta["target_tokens"] / max(meta["texts"], 1))
        tokens = meta["tokens"] / max(meta["texts"], 1) if not meta["packed"] else self.seq_len
        tokens = min(tokens, self.seq_len)
        if self.kind == "causal_lm":
            return float(max(tokens - 1, 1))
        if self.kind == "masked_lm":
            return float(self.cfg.data.mask_prob * tokens)
        return 1.0

    @property
    def tokens_per_sample(self) -> float:
        """Tokens per row, ``T`` (seq2seq: source + target widths)."""
        return float(self.seq_len + (self.target_len if self.kind == "seq2seq" else 0))

    @property
    def data_summary(self) -> Dict[str, Any]:
        meta = self.meta
        out = {
            "files": meta["files"],
            "kind": self.kind,
            "texts": meta["texts"],
            "tokens": meta["tokens"],
            "rows": meta["rows"],
            "seq_len": self.seq_len,
            "packed": meta["packed"],
            "train_rows": self.num_train,
            "val_rows": self.num_val,
            "model": self.cfg.model.path or self.cfg.model.config,
            "cache": str(self.directory),
        }
        if meta["label_names"]:
            out["labels"] = meta["label_names"]
        return out

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` ``(B, T)`` int64 and ``labels`` (``(B, T)``, or
        ``(B,)`` for classification); row ``i`` depends only on ``positions[i]``, ``epoch``,
        ``split`` and the seed."""
        index = self.train_index if split == "train" else self.val_index
        rows = index[np.asarray(positions, dtype=np.int64).reshape(-1)]
        if self.kind == "seq2seq":
            pad = getattr(self.config, "pad_token_id", None)
            batch = seq2seq_batch(
                self._arrays,
                rows,
                int(self.meta["pad_id"] if pad is None else pad),
                self.decoder_start,
            )
            return {k: torch.from_numpy(v) for k, v in batch.items()}
        ids = np.asarray(self._arrays["tokens"][rows], dtype=np.int64)
        if self.meta["packed"]:
            lengths = np.full(len(rows), self.seq_len, dtype=np.int64)
        else:
            lengths = np.asarray(self._arrays["lengths"][rows], dtype=np.int64)
        mask = np.arange(self.seq_len)[None, :] < lengths[:, None]
        if self.kind == "classification":
            labels = np.asarray(self._arrays["labels"][rows], dtype=np.int64)
        elif self.kind == "causal_lm":
            labels = np.full_like(ids, IGNORE_INDEX)
            labels[:, :-1] = np.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
        else:
            ids, labels = self._mask(ids, mask, rows, epoch, split)
        return {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "labels": torch.from_numpy(labels),
        }

    def _mask(self, ids: np.ndarray, mask: np.ndarray, rows: np.ndarray, epoch: int, split: str):
        """BERT masking of each row from ``default_rng([seed, epoch, split, row])``: 80%
        ``[MASK]``, 10% a random token, 10% unchanged; at least one token per row."""
        inputs, labels = ids.copy(), np.full_like(ids, IGNORE_INDEX)
        for i, row in enumerate(rows):
            inputs[i], labels[i] = mask_tokens(
                sample_rng(self.seed, epoch, split, row),
                ids[i],
                mask[i] & ~np.isin(ids[i], self.special),
                mask[i],
                self.cfg.data.mask_prob,
                self.tokenizer.mask_token_id,
                (0, len(self.tokenizer)),
            )
        return inputs, labels

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Labels that are not ``-100``: predicted tokens, masked tokens or samples."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    # ------------------------------------------------------------------ model
    def build_model(self) -> SummedLossModel:
        """The transformers model (pretrained from safetensors, or a random init from the
        config; the caller seeds torch), wrapped to return the summed loss."""
        config = self.config
        if self.kind == "classification":
            fit_classifier_config(config, self.meta["label_names"] or [], self.meta["pad_id"])
        set_dropout(config, self.cfg.model.dropout)
        return SummedLossModel(build_hf_model(self.cfg.model, config, self.kind), self.kind)

    def sharding_units(self, model: nn.Module) -> List[nn.Module]:
        """The modules named by the model's ``_no_split_modules`` (its transformer blocks),
        else the default (every ``nn.ModuleList`` entry)."""
        return no_split_units(model) or super().sharding_units(model)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate_batch(
        self, model: nn.Module, batch: Dict[str, torch.Tensor], positions: Sequence[int]
    ) -> Dict[str, float]:
        """Loss sum and units; for classification also the correct predictions, from the
        same forward pass (``return_logits=True``)."""
        if self.kind != "classification":
            return super().evaluate_batch(model, batch, positions)
        loss, logits = model(**batch, return_logits=True)
        return {
            "loss_sum": float(loss),
            "units": float(len(positions)),
            "correct": float((logits.argmax(-1) == batch["labels"]).sum()),
        }

    def evaluates_in_fixed_passes(self) -> bool:
        """True: every kind runs exactly one forward per validation batch (classification
        takes its logits from that pass), so an FSDP run validates on the shards."""
        return True

    def finalize_metrics(self, sums: Dict[str, float]) -> Dict[str, float]:
        """``val_loss`` and ``val_ppl`` (LM) or ``val_accuracy`` (classification)."""
        metrics = super().finalize_metrics(sums)
        if self.kind == "classification":
            metrics.pop("val_ppl", None)
            metrics["val_accuracy"] = sums.get("correct", 0.0) / max(sums.get("units", 0.0), 1.0)
        else:
            metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
        return metrics
