"""Shared BPE tokenizer, the token-id cache and batches for German-to-English translation.

``prepare`` reads the pairs (:mod:`.parallel_corpus`), splits them with a fixed permutation (seed 0,
independent of ``trainer.seed``), trains one byte-pair-encoding vocabulary (Sennrich et al.,
2016) on both sides of the training pairs with Hugging Face ``tokenizers``, and stores the ids
as fixed-width ``int32`` arrays: ``{split}_src.npy`` ``(N, L)`` = German + ``[EOS]``, and
``{split}_tgt.npy`` ``(N, L + 1)`` = ``[BOS]`` + English + ``[EOS]``, padded with ``[PAD]``
(L = ``task.model.max_len``; longer pairs are left out). Fixed widths make a sample's tensors
independent of the other samples in its batch. Nothing in a batch is random.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write_json, atomic_write_text
from hetseq_hpc.tasks.cache import TaskCache
from hetseq_hpc.tasks.cache import cache_key as key_of
from hetseq_hpc.tasks.samples import fixed_split
from hetseq_hpc.tasks.translation.parallel_corpus import Pair, ParallelSource, read_pairs

log = logging.getLogger(__name__)

#: special tokens; their ids are 0..3 in this order
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS))
#: bump when the cache layout changes
CACHE_FORMAT = 1


def cache_key(
    source: ParallelSource, vocab_size: int, max_len: int, max_chars: int, val_fraction: float
) -> str:
    """Directory name for one combination of sources and settings."""
    return key_of(
        "translation",
        CACHE_FORMAT,
        source.fingerprint,
        vocab_size,
        max_len,
        max_chars,
        val_fraction,
    )


def translation_cache(directory: Path) -> TaskCache:
    """The translation cache in ``directory``."""
    return TaskCache(directory, "translation cache")


def train_bpe(texts: Sequence[str], vocab_size: int, path: Path) -> Tokenizer:
    """Train a cased BPE tokenizer (NFKC, SentencePiece-style ``Metaspace`` word marks, so
    :meth:`Tokenizer.decode` restores the spacing) and save it atomically to ``path``."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    atomic_write_text(path, tokenizer.to_str(), durable=True)
    log.info("trained BPE tokenizer: %d tokens -> %s", tokenizer.get_vocab_size(), path)
    return tokenizer


def _encode(tokenizer: Tokenizer, pairs: List[Pair], max_len: int):
    """Fixed-width id arrays of the pairs that fit, and the indices of those pairs."""
    de = tokenizer.encode_batch([p[0] for p in pairs], add_special_tokens=False)
    en = tokenizer.encode_batch([p[1] for p in pairs], add_special_tokens=False)
    src = np.full((len(pairs), max_len), PAD_ID, dtype=np.int32)
    tgt = np.full((len(pairs), max_len + 1), PAD_ID, dtype=np.int32)
    kept = []
    for i, (d, e) in enumerate(zip(de, en)):
        if len(d.ids) + 1 > max_len or len(e.ids) + 1 > max_len or not d.ids or not e.ids:
            continue
        row = len(kept)
        src[row, : len(d.ids) + 1] = [*d.ids, EOS_ID]
        tgt[row, : len(e.ids) + 2] = [BOS_ID, *e.ids, EOS_ID]
        kept.append(i)
    return src[: len(kept)], tgt[: len(kept)], kept


def build_translation_cache(
    source: ParallelSource,
    vocab_size: int,
    max_len: int,
    max_chars: int,
    val_fraction: float,
    directory: Path,
) -> Path:
    """Write ``tokenizer.json``, ``{train,val}_{src,tgt}.npy``, ``val_pairs.json`` and (last)
    ``meta.json`` into ``directory`` once (:meth:`~hetseq_hpc.tasks.cache.TaskCache.build_once`:
    skipped when ``meta.json`` exists; a concurrent builder waits for the first). Returns
    ``directory``.

    Raises:
        DataError: fewer than 2 pairs fit ``max_len`` tokens / ``max_chars`` characters.
    """
    cache = translation_cache(directory)
    return cache.build_once(
        lambda: _build(source, vocab_size, max_len, max_chars, val_fraction, cache)
    )


def _build(
    source: ParallelSource,
    vocab_size: int,
    max_len: int,
    max_chars: int,
    val_fraction: float,
    cache: TaskCache,
) -> None:
    directory = cache.directory
    pairs, per_kind = read_pairs(source, max_chars)
    n = len(pairs)
    if n < 2:
        raise DataError(
            f"{source.description} gave {n} usable sentence pair(s): need at least 2; "
            "add pairs with task.data.files or raise task.data.max_chars"
        )
    train, val = fixed_split(n, val_fraction)
    split = {"train": [pairs[i] for i in train], "val": [pairs[i] for i in val]}
    tokenizer = train_bpe(
        [s for p in split["train"] for s in p], vocab_size, directory / "tokenizer.json"
    )
    counts, units = {}, 0.0
    for name, part in split.items():
        src, tgt, kept = _encode(tokenizer, part, max_len)
        if not kept:
            raise DataError(
                f"no {name} pair of {source.description} fits task.model.max_len="
                f"{max_len} tokens: raise task.model.max_len"
            )
        cache.save(f"{name}_src", src)
        cache.save(f"{name}_tgt", tgt)
        counts[name] = len(kept)
        if name == "train":
            units = float((tgt[:, 1:] != PAD_ID).sum()) / len(kept)
        else:
            atomic_write_json(directory / "val_pairs.json", [part[i] for i in kept], durable=True)
    meta = {
        "source": source.description,
        "pairs_read": n,
        "pairs_per_source": per_kind,
        "train": counts["train"],
        "val": counts["val"],
        "max_len": max_len,
        "vocab_size": tokenizer.get_vocab_size(),
        "target_tokens_per_sample": units,
        "format": CACHE_FORMAT,
    }
    cache.write_meta(meta, indent=2)
    log.info(
        "translation cache: %s; %d pairs read, %d train + %d val fit %d tokens; "
        "vocabulary %d -> %s",
        meta["source"],
        n,
        counts["train"],
        counts["val"],
        max_len,
        meta["vocab_size"],
        directory,
    )


@dataclass(frozen=True)
class TranslationData:
    """Memory-mapped id arrays (``*_src`` ``(N, L)``, ``*_tgt`` ``(N, L + 1)``, int32), the
    tokenizer, the validation texts ``[(german, english), ...]`` and ``meta.json``."""

    train_src: np.ndarray
    train_tgt: np.ndarray
    val_src: np.ndarray
    val_tgt: np.ndarray
    tokenizer: Tokenizer
    val_pairs: list
    meta: dict


def load_translation_cache(directory: Path, max_val_samples: int) -> TranslationData:
    """Open a cache written by :func:`build_translation_cache`; keep the first
    ``max_val_samples`` validation pairs (0 = all).

    Raises:
        DataError: the cache is missing or damaged.
    """
    cache = translation_cache(directory)
    meta, arrays = cache.open(("train_src", "train_tgt", "val_src", "val_tgt"))
    try:
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        val_pairs = [tuple(p) for p in json.loads((directory / "val_pairs.json").read_text())]
    except Exception as exc:
        raise cache.unreadable(exc) from None
    if arrays["train_src"].shape[0] != meta.get("train") or len(val_pairs) != meta.get("val"):
        raise cache.mismatch()
    if max_val_samples:
        for name in ("val_src", "val_tgt"):
            arrays[name] = arrays[name][:max_val_samples]
        val_pairs = val_pairs[:max_val_samples]
    return TranslationData(tokenizer=tokenizer, val_pairs=val_pairs, meta=meta, **arrays)


def make_translation_batch(
    data: TranslationData, positions: Sequence[int], split: str
) -> Dict[str, torch.Tensor]:
    """Teacher-forcing batch of split positions.

    Returns:
        ``{"src": (B, L), "tgt_in": (B, L), "tgt_out": (B, L)}`` int64 on the CPU: German ids +
        ``[EOS]``; ``[BOS]`` + English ids; English ids + ``[EOS]``; all padded with ``PAD_ID``.
    """
    src, tgt = (
        (data.train_src, data.train_tgt) if split == "train" else (data.val_src, data.val_tgt)
    )
    rows = np.asarray(positions, dtype=np.int64).reshape(-1)
    s = torch.from_numpy(np.asarray(src[rows], dtype=np.int64))
    t = torch.from_numpy(np.asarray(tgt[rows], dtype=np.int64))
    return {"src": s, "tgt_in": t[:, :-1].contiguous(), "tgt_out": t[:, 1:].contiguous()}


def decode_ids(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of generated ids, cut at the first ``[EOS]``, special tokens dropped."""
    ids = list(ids)
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    return tokenizer.decode([i for i in ids if i >= len(SPECIAL_TOKENS)])
