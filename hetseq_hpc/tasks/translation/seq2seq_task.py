"""The German-to-English translation task (``task=translation``); loss units are target tokens."""

from __future__ import annotations

import importlib.util
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hetseq_hpc.config.tasks import TranslationTaskConfig
from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.cache import cache_root
from hetseq_hpc.tasks.translation.parallel_corpus import resolve_sources
from hetseq_hpc.tasks.translation.parallel_data import (
    PAD_ID,
    TranslationData,
    build_translation_cache,
    cache_key,
    decode_ids,
    load_translation_cache,
    make_translation_batch,
)
from hetseq_hpc.tasks.translation.transformer import TranslationTransformer

log = logging.getLogger(__name__)
_NGRAMS = 4


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def bleu_stats(hypotheses: List[str], references: List[str]) -> Dict[str, float]:
    """Additive BLEU statistics of sacrebleu's corpus BLEU (13a tokenisation; Papineni et al.,
    2002; Post, 2018): matching and total n-grams for n = 1..4 and the two lengths (all zero
    for no sentences). Sums over any split of the corpus give the corpus statistics.

    Raises:
        DataError: sacrebleu is not installed.
    """
    try:
        from sacrebleu.metrics import BLEU
    except ImportError:
        raise DataError(
            "BLEU needs sacrebleu, which is not installed: pip install sacrebleu, or "
            "set task.data.bleu_samples=0"
        ) from None
    stats = {"bleu_sys_len": 0.0, "bleu_ref_len": 0.0}
    stats.update(
        {f"bleu_{kind}_{n + 1}": 0.0 for kind in ("correct", "total") for n in range(_NGRAMS)}
    )
    if not hypotheses:
        return stats
    score = BLEU().corpus_score(hypotheses, [references])
    stats.update(bleu_sys_len=float(score.sys_len), bleu_ref_len=float(score.ref_len))
    for n in range(_NGRAMS):
        stats[f"bleu_correct_{n + 1}"] = float(score.counts[n])
        stats[f"bleu_total_{n + 1}"] = float(score.totals[n])
    return stats


def bleu_from_stats(sums: Dict[str, float]) -> float:
    """Corpus BLEU (0..100, sacrebleu's default exponential smoothing) from summed
    :func:`bleu_stats`."""
    from sacrebleu.metrics import BLEU

    correct = [int(sums[f"bleu_correct_{n + 1}"]) for n in range(_NGRAMS)]
    total = [int(sums[f"bleu_total_{n + 1}"]) for n in range(_NGRAMS)]
    return float(
        BLEU.compute_bleu(
            correct,
            total,
            int(sums["bleu_sys_len"]),
            int(sums["bleu_ref_len"]),
            smooth_method="exp",
        ).score
    )


class TranslationTask(Task):
    """German-to-English translation with an encoder-decoder transformer.

    Args:
        cfg: the ``task`` config group (:class:`TranslationTaskConfig`).
        seed: ``trainer.seed`` (unused by the data: batches hold no randomness).

    Raises:
        ConfigError: BLEU is asked for (``task.data.bleu_samples > 0``) but sacrebleu is not
            installed; or from :func:`resolve_sources`.
        DataError: from :func:`resolve_sources` when no text source is usable.
    """

    name = "translation"
    unit_name = "target tokens"
    example_header = "german | reference | model"

    def __init__(self, cfg: TranslationTaskConfig, seed: int):
        super().__init__(cfg, seed)
        if cfg.data.bleu_samples and importlib.util.find_spec("sacrebleu") is None:
            raise ConfigError(
                f"task.data.bleu_samples={cfg.data.bleu_samples} needs sacrebleu, which is not "
                "installed: pip install sacrebleu, or set task.data.bleu_samples=0"
            )
        self.source = resolve_sources(cfg.data.files)
        d = cfg.data
        self.directory = cache_root(d.cache_dir) / cache_key(
            self.source, d.vocab_size, cfg.model.max_len, d.max_chars, d.val_fraction
        )
        self._data: Optional[TranslationData] = None

    def prepare(self) -> None:
        """Read the pairs, train the tokenizer, write the id cache (rank 0, before the others)."""
        d = self.cfg.data
        build_translation_cache(
            self.source,
            d.vocab_size,
            self.cfg.model.max_len,
            d.max_chars,
            d.val_fraction,
            self.directory,
        )

    def load(self) -> None:
        """Open the cache (every rank) and log which sources and how many pairs are used."""
        self._data = load_translation_cache(self.directory, self.cfg.data.max_val_samples)
        log.info("task=translation data: %s", self.data_summary)

    @property
    def data(self) -> TranslationData:
        """The loaded data; raises DataError before :meth:`load`."""
        return self.loaded(self._data)

    @property
    def data_summary(self) -> Dict[str, object]:
        """Sources, pair counts and vocabulary, for the log and ``summary.json``."""
        meta = self.data.meta
        return {
            "source": meta["source"],
            "pairs_per_source": meta["pairs_per_source"],
            "pairs_read": meta["pairs_read"],
            "train_pairs": self.num_train,
            "val_pairs": self.num_val,
            "vocab_size": meta["vocab_size"],
        }

    @property
    def num_train(self) -> int:
        """Training pairs."""
        return int(self.data.train_src.shape[0])

    @property
    def num_val(self) -> int:
        """Validation pairs (at most ``task.data.max_val_samples``)."""
        return int(self.data.val_src.shape[0])

    @property
    def units_per_sample(self) -> float:
        """Mean target tokens (``[EOS]`` included) per training pair: the loss units."""
        return float(self.data.meta["target_tokens_per_sample"])

    def build_model(self) -> TranslationTransformer:
        """A freshly initialised transformer on the CPU (seed the RNG first)."""
        return TranslationTransformer(self.cfg.model, int(self.data.meta["vocab_size"]))

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """``{"src", "tgt_in", "tgt_out"}``, each ``(len(positions), max_len)`` int64; a row
        depends only on its position (``epoch`` is unused: no randomness)."""
        return make_translation_batch(self.data, positions, split)

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Non-pad target tokens in ``batch`` (the loss normaliser's units)."""
        return int((batch["tgt_out"] != PAD_ID).sum())

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one pair at the padded width ``max_len`` (for MFU)."""
        length = self.cfg.model.max_len
        return _unwrap(model).flops_per_sample(length, length)

    def translate(self, model: nn.Module, src: torch.Tensor) -> List[str]:
        """Greedy translations of ``(B, S)`` source ids, as detokenised English text."""
        out = _unwrap(model).greedy(src, self.cfg.model.max_len)
        return [decode_ids(self.data.tokenizer, row) for row in out.tolist()]

    @torch.no_grad()
    def evaluate_batch(
        self, model: nn.Module, batch: Dict[str, torch.Tensor], positions: Sequence[int]
    ) -> Dict[str, float]:
        """Additive validation sums of one batch of validation ``positions``: ``loss_sum`` and
        ``tokens`` (teacher forcing), plus BLEU statistics (:func:`bleu_stats`) of the greedy
        translations of the positions below ``task.data.bleu_samples`` (with BLEU on, every
        batch returns the same keys, zeros where no position qualifies, so ranks can all-reduce
        one fixed vector). The caller sums them over batches and ranks, then calls
        :meth:`finalize_metrics`."""
        net = _unwrap(model)
        sums = {"loss_sum": float(net(**batch)), "tokens": float(self.count(batch))}
        if not self.cfg.data.bleu_samples:
            return sums
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        chosen = np.flatnonzero(pos < self.cfg.data.bleu_samples)
        hyps, refs = [], []
        if chosen.size:
            index = torch.as_tensor(chosen, device=batch["src"].device)
            hyps = self.translate(net, batch["src"][index])
            refs = [self.data.val_pairs[int(p)][1] for p in pos[chosen]]
        sums.update(bleu_stats(hyps, refs))  # all keys, zeros without sentences
        sums["bleu_sentences"] = float(chosen.size)
        return sums

    def evaluates_in_fixed_passes(self) -> bool:
        """One forward per batch without BLEU; greedy decoding runs as many as the longest
        translation needs, so with ``task.data.bleu_samples`` an FSDP run gathers the whole
        weights for validation."""
        return not self.cfg.data.bleu_samples

    def finalize_metrics(self, sums: Dict[str, float]) -> Dict[str, float]:
        """``{"val_loss": per target token (label-smoothed), "val_ppl", "val_bleu"}``; BLEU only
        when BLEU statistics were collected."""
        loss = sums.get("loss_sum", 0.0) / max(sums.get("tokens", 0.0), 1.0)
        metrics = {"val_loss": loss, "val_ppl": float(np.exp(min(loss, 50.0)))}
        if sums.get("bleu_sentences", 0.0) > 0:
            metrics["val_bleu"] = bleu_from_stats(sums)
        return metrics

    def examples(self, model: nn.Module, n: int = 3) -> List[Tuple[str, str, str]]:
        """``(german, reference, greedy translation)`` of the first ``n`` validation pairs
        whose reference has 3+ words (else the first ``n``), for the log."""
        pairs = self.data.val_pairs
        chosen = [i for i, (_, en) in enumerate(pairs) if len(en.split()) >= 3][:n]
        chosen = chosen or list(range(min(n, self.num_val)))
        batch = self.make_batch(chosen, 0, "val")
        device = next(_unwrap(model).parameters()).device
        hyps = self.translate(model, batch["src"].to(device))
        return [(pairs[i][0], pairs[i][1], hyp) for i, hyp in zip(chosen, hyps)]
