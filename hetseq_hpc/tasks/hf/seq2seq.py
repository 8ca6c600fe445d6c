"""``task=hf`` with ``task.model.kind=seq2seq``: (source, target) pairs for an encoder-decoder
(``AutoModelForSeq2SeqLM``: T5, BART, ...), tokenised into a memory-mapped cache, and the
row-wise batches.

The pairs come from JSON lines / CSV / Parquet files with the columns ``task.data.source_field`` and
``task.data.target_field``. Both are tokenised with the tokenizer's special tokens (T5: ``</s>``
at the end), truncated to ``task.model.max_seq_len`` (source) and ``task.model.max_target_len``
(target) and padded. The cache folder holds ``source.npy``/``target.npy`` (``(N, T)`` int32),
``source_len.npy``/``target_len.npy`` (``(N,)`` int32) and ``meta.json`` last (the completion
marker); every file is atomic and a lock makes a second builder wait for the first.

A batch is ``input_ids``/``attention_mask`` (the source), ``labels`` (the target, ``-100`` on
padding) and ``decoder_input_ids``: the labels shifted right by one with
``config.decoder_start_token_id`` in front and the pad id for ``-100``, as the model's own
``shift_tokens_right`` builds them when it is given ``labels=``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.cache import TaskCache, cache_key
from hetseq_hpc.tasks.hf.records import records
from hetseq_hpc.tasks.hf.token_cache import backend_encoder, pad_id_of
from hetseq_hpc.tasks.packing import pad_rows
from hetseq_hpc.tasks.samples import IGNORE_INDEX

log = logging.getLogger(__name__)

#: bump when the layout changes, so old caches are not reused
SEQ2SEQ_CACHE_FORMAT = 1
ARRAYS = ("source", "target", "source_len", "target_len")


def seq2seq_cache_key(data_cfg: Any, tokenizer_json: str, source_len: int, target_len: int) -> str:
    """Folder name for (files with their sizes and mtimes, tokenizer, widths, columns)."""
    return cache_key(
        SEQ2SEQ_CACHE_FORMAT,
        "seq2seq",
        source_len,
        target_len,
        data_cfg.source_field,
        data_cfg.target_field,
        files=data_cfg.files,
        texts=[tokenizer_json],
        prefix="hf-s2s-",
    )


def seq2seq_cache(directory: Path) -> TaskCache:
    """The ``task=hf`` seq2seq cache in ``directory``."""
    return TaskCache(directory, "hf seq2seq cache")


def decoder_start_id(config: Any) -> int:
    """``config.decoder_start_token_id`` (T5: the pad id; BART: ``</s>``).

    Raises:
        ConfigError: the config has none (one line with the fix).
    """
    value = getattr(config, "decoder_start_token_id", None)
    if value is None:
        raise ConfigError(
            "the model's config has no decoder_start_token_id: task.model.kind="
            "seq2seq needs it (set it in config.json, e.g. the pad id for T5)"
        )
    return int(value)


def _pairs(data_cfg: Any, size: int):
    """Batches ``(sources, targets)`` of up to ``size`` records over all files.

    Raises:
        DataError: a target is not text (one line naming the file and record).
    """
    sources: List[str] = []
    targets: List[str] = []
    for path in data_cfg.files:
        for number, (source, target) in enumerate(
            records(path, data_cfg.source_field, data_cfg.target_field), 1
        ):
            if not isinstance(target, str):
                raise DataError(
                    f"data file {path!r} record {number}: "
                    f"{data_cfg.target_field!r} is a {type(target).__name__}, not "
                    "text: store the target as a string"
                )
            sources.append(source)
            targets.append(target)
            if len(sources) >= size:
                yield sources, targets
                sources, targets = [], []
    if sources:
        yield sources, targets


def build_seq2seq_cache(
    data_cfg: Any, tokenizer: Any, source_len: int, target_len: int, directory: Path
) -> Path:
    """Tokenise the (source, target) pairs of ``data_cfg.files`` into ``directory`` once
    (rank 0, in ``prepare``; :meth:`TaskCache.build_once`).

    Raises:
        DataError: a file cannot be read or lacks a column; fewer than 2 pairs.
    """
    cache = seq2seq_cache(directory)
    return cache.build_once(lambda: _build(data_cfg, tokenizer, source_len, target_len, cache))


def _build(
    data_cfg: Any, tokenizer: Any, source_len: int, target_len: int, cache: TaskCache
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    started = time.monotonic()
    pad_id = pad_id_of(tokenizer)
    src_enc, tgt_enc = (
        backend_encoder(tokenizer, source_len),
        backend_encoder(tokenizer, target_len),
    )
    parts: Dict[str, List[np.ndarray]] = {name: [] for name in ARRAYS}
    texts = 0
    for sources, targets in _pairs(data_cfg, data_cfg.encode_batch):
        for name, encoder, width, batch in (
            ("source", src_enc, source_len, sources),
            ("target", tgt_enc, target_len, targets),
        ):
            encodings = encoder.encode_batch(batch, add_special_tokens=True)
            block, size = pad_rows([enc.ids for enc in encodings], width, pad_id)
            parts[name].append(block)
            parts[f"{name}_len"].append(size)
        texts += len(sources)
    if texts < 2:
        raise DataError(
            f"task.data.files give {texts} (source, target) pair(s): need at least 2; add records"
        )
    arrays = {name: np.concatenate(parts[name]) for name in ARRAYS}
    if not arrays["target_len"].all():
        row = int(np.flatnonzero(arrays["target_len"] == 0)[0])
        raise DataError(
            f"task.data.files: pair {row + 1} has an empty target "
            f"({data_cfg.target_field!r}): fill it in or drop the record"
        )
    for name in ARRAYS:
        cache.save(name, arrays[name])
    seconds = time.monotonic() - started
    meta = {
        "format": SEQ2SEQ_CACHE_FORMAT,
        "kind": "seq2seq",
        "packed": False,
        "seq_len": source_len,
        "target_len": target_len,
        "rows": texts,
        "texts": texts,
        "tokens": int(arrays["source_len"].sum()),
        "target_tokens": int(arrays["target_len"].sum()),
        "pad_id": pad_id,
        "label_names": None,
        "files": list(data_cfg.files),
        "seconds": round(seconds, 3),
    }
    cache.write_meta(meta)
    log.info(
        "tokenised %d (source, target) pairs into %d x %d + %d x %d in %.1f s -> %s",
        texts,
        texts,
        source_len,
        texts,
        target_len,
        seconds,
        cache.directory,
    )


def open_seq2seq_cache(directory: Path) -> Tuple[dict, Dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a finished cache, memory-mapped; ``arrays["tokens"]`` is the
    source (as the other kinds name their rows).

    Raises:
        DataError: missing or damaged (the message says to delete the folder).
    """
    meta, arrays = seq2seq_cache(directory).open(ARRAYS)
    arrays["tokens"] = arrays["source"]
    return meta, arrays


def seq2seq_batch(
    arrays: Dict[str, np.ndarray], rows: np.ndarray, pad_id: int, start_id: int
) -> Dict[str, np.ndarray]:
    """The batch of cache ``rows``: ``input_ids``, ``attention_mask`` ``(B, S)``, ``labels``
    and ``decoder_input_ids`` ``(B, T)``, all int64; row ``i`` depends only on ``rows[i]``."""
    source = np.asarray(arrays["source"][rows], dtype=np.int64)
    target = np.asarray(arrays["target"][rows], dtype=np.int64)
    src_len = np.asarray(arrays["source_len"][rows], dtype=np.int64)
    tgt_len = np.asarray(arrays["target_len"][rows], dtype=np.int64)
    mask = np.arange(source.shape[1])[None, :] < src_len[:, None]
    labels = np.where(np.arange(target.shape[1])[None, :] < tgt_len[:, None], target, IGNORE_INDEX)
    decoder = np.empty_like(labels)
    decoder[:, 0] = start_id
    decoder[:, 1:] = labels[:, :-1]
    decoder[decoder == IGNORE_INDEX] = pad_id
    return {
        "input_ids": source,
        "attention_mask": mask.astype(np.int64),
        "labels": labels,
        "decoder_input_ids": decoder,
    }
