"""Packed token sequences and deterministic BERT masking.

The corpus is tokenised once, documents are joined with ``[SEP]``, and the stream is cut
into rows ``[CLS] t_1 ... t_{T-2} [SEP]`` of exactly ``T = max_seq_len`` tokens (no padding).
The rows live in one ``int32`` array on disk (``tokens.npy``), memory-mapped by every rank.
Building it streams (:func:`build_packed_text`): bounded memory, all cores (the word cache of
:mod:`hetseq_hpc.tokenizing` in spawned workers, :mod:`.mlm_encode`), atomic.

Masking follows BERT (:func:`hetseq_hpc.tasks.samples.mask_tokens`): each non-special token
may be selected. It is a pure function of ``(seed, epoch, split, sample index)``, so a sample is
masked the same way whichever rank, world size or allocation processes it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.bert.mlm_encode import fast_encoding, packed_streams
from hetseq_hpc.tasks.bert.text_corpus import Corpus
from hetseq_hpc.tasks.bert.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from hetseq_hpc.tasks.cache import TaskCache
from hetseq_hpc.tasks.cache import cache_key as key_of
from hetseq_hpc.tasks.packing import Packer, RowFile, write_token_rows
from hetseq_hpc.tasks.samples import IGNORE_INDEX as IGNORE_INDEX
from hetseq_hpc.tasks.samples import fixed_split, mask_tokens, sample_rng
from hetseq_hpc.tokenizing.pool import prepare_workers

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
#: bump when the packing format changes, so old caches are not reused
CACHE_FORMAT = 1
_SEP = np.asarray([SEP_ID], dtype=np.int32)


def cache_key(corpus: Corpus, vocab_size: int, seq_len: int) -> str:
    """Directory name for one (corpus, vocabulary size, sequence length) combination."""
    return key_of(CACHE_FORMAT, corpus.fingerprint, vocab_size, seq_len)


def token_cache(directory: Path) -> TaskCache:
    """The BERT token cache in ``directory``."""
    return TaskCache(directory, "token cache")


@dataclass(frozen=True)
class PackedText:
    """Packed rows plus the tokenizer's size.

    Attributes:
        tokens: ``(N, T)`` int32 array of token ids (memory-mapped).
        vocab_size: number of token ids the tokenizer produces.
        train_index / val_index: row numbers of each split, ``(N_train,)`` / ``(N_val,)``.
        directory: the cache directory holding ``tokens.npy``, ``tokenizer.json``, ``meta.json``.
    """

    tokens: np.ndarray
    vocab_size: int
    train_index: np.ndarray
    val_index: np.ndarray
    directory: Path

    @property
    def seq_len(self) -> int:
        """Tokens per row, T."""
        return int(self.tokens.shape[1])


#: characters of text per ``encode_batch`` call: bounds the encodings alive at once (tokenizers
#: encodes a batch on all cores)
ENCODE_BATCH_CHARS = 1 << 20
#: rows cut from the token stream and written at a time
ROWS_PER_WRITE = 4096


def _batches(segments: Iterable[Tuple[str, bool]], progress) -> Iterator[List[Tuple[str, bool]]]:
    """``(text, ends_document)`` pieces grouped into lists of about :data:`ENCODE_BATCH_CHARS`
    characters."""
    batch: List[Tuple[str, bool]] = []
    size = 0
    for segment in segments:
        batch.append(segment)
        size += len(segment[0])
        if size >= ENCODE_BATCH_CHARS:
            yield batch
            progress.update(size)
            batch, size = [], 0
    if batch:
        yield batch
        progress.update(size)


def _pack_plain(tokenizer, batches: Iterable[List[Tuple[str, bool]]], rows: Packer) -> None:
    """The plain path: every piece through ``encode_batch`` (all cores, in this process), a
    ``[SEP]`` after the last piece of every document that has tokens."""
    open_doc = False  # the current document has tokens (it ends with a [SEP])
    for batch in batches:
        texts = [text for text, _ in batch]
        for (_, end), enc in zip(batch, tokenizer.encode_batch(texts, add_special_tokens=False)):
            open_doc = open_doc or bool(enc.ids)
            rows.add(enc.ids)
            if end and open_doc:
                rows.add(_SEP)
            open_doc = open_doc and not end


def _progress(total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        disable=not show,
        dynamic_ncols=True,
        mininterval=1.0,
    )


def build_packed_text(
    corpus: Corpus,
    vocab_size: int,
    seq_len: int,
    directory: Path,
    show_progress: Optional[bool] = None,
) -> Path:
    """Tokenise ``corpus`` into ``directory`` (``tokenizer.json``, ``tokens.npy``, then
    ``meta.json``) unless ``meta.json`` is already there.

    Streaming: documents are read chunk by chunk, encoded in batches on all cores, and full
    rows are appended to the temporary ``tokens.npy`` whose header is written last; memory
    stays bounded whatever the corpus size. Encoding goes through the word cache of
    :mod:`hetseq_hpc.tokenizing` (:mod:`hetseq_hpc.tasks.bert.mlm_encode`: one spawned process
    per core, at most 8, for 8 MB or more, else this process; ``HETSEQ_PREPARE_WORKERS=N``
    sets the count), or with ``HETSEQ_PREPARE_FAST=0`` through ``encode_batch`` (the plain
    path); the rows are the same, byte for byte. Atomic: every file goes through
    :mod:`hetseq_hpc.files.atomic` and ``meta.json`` (the completion marker every reader
    checks) comes last, so an interrupted build leaves nothing a later run trusts; a lock file
    makes concurrent builders wait for the first one. ``show_progress``: progress bars
    (default: when stderr is a terminal).

    Raises:
        DataError: the corpus is too small for one training row, or a file is not UTF-8.
        ConfigError: ``HETSEQ_PREPARE_WORKERS`` is not a whole number >= 1 (before training).
        DataError: a prepare worker process died (killed, out of memory): one line, and
            nothing of the build is kept.
    """
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    return token_cache(directory).build_once(
        lambda: _build(corpus, vocab_size, seq_len, directory, show_progress)
    )


def _build(
    corpus: Corpus, vocab_size: int, seq_len: int, directory: Path, show_progress: bool
) -> None:
    started = time.monotonic()
    total = corpus.size_bytes
    log.info(
        "preparing %s (%.1f MB): training the tokenizer, then packing rows of %d tokens into %s",
        corpus.name,
        total / 1e6,
        seq_len,
        directory,
    )
    workers = prepare_workers(total)  # a bad HETSEQ_PREPARE_WORKERS fails before training
    tokenizer = train_tokenizer(
        corpus.documents(), vocab_size, directory / "tokenizer.json", show_progress=show_progress
    )
    trained = time.monotonic()
    mode = fast_encoding(tokenizer)

    def fill(out: RowFile) -> None:
        rows = Packer(out, [CLS_ID], [SEP_ID], rows_per_write=ROWS_PER_WRITE)
        with _progress(total, "packing", show_progress) as bar:
            if mode is not None:  # the word cache: the same ids, several times faster
                log.info("tokenising with the %s word cache on %d process(es)", mode, workers)
                with contextlib.closing(
                    packed_streams(
                        _batches(corpus.segments(), bar), tokenizer.to_str(), mode, workers, SEP_ID
                    )
                ) as streams:
                    for stream in streams:
                        rows.add(stream)
            else:
                _pack_plain(tokenizer, _batches(corpus.segments(), bar), rows)
        rows.flush()

    written = write_token_rows(
        directory / "tokens.npy",
        seq_len,
        fill,
        1,
        lambda _: (
            f"corpus {corpus.name} has fewer than {seq_len - 2} tokens, too few for one row "
            f"of task.model.max_seq_len={seq_len}: add text or shorten the sequences"
        ),
    )
    meta = {
        "corpus": corpus.name,
        "fingerprint": corpus.fingerprint,
        "rows": written,
        "seq_len": seq_len,
        "vocab_size": tokenizer.get_vocab_size(),
        "format": CACHE_FORMAT,
    }
    token_cache(directory).write_meta(meta)
    now = time.monotonic()
    log.info(
        "packed %s: %d rows x %d tokens, vocabulary %d, in %.0f s (tokenizer %.1f s, "
        "packing %.1f s) -> %s",
        corpus.name,
        written,
        seq_len,
        meta["vocab_size"],
        now - started,
        trained - started,
        now - trained,
        directory,
    )


def load_packed_text(directory: Path, val_fraction: float) -> PackedText:
    """Memory-map a cache written by :func:`build_packed_text` and split it.

    The split is a fixed permutation (seed 0, independent of ``trainer.seed``) so validation
    data never changes between runs; at least one row goes to each split.

    Raises:
        DataError: the cache is missing, damaged, or has fewer than 2 rows.
    """
    cache = token_cache(directory)
    meta, arrays = cache.open(["tokens"])
    try:
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except Exception as exc:
        raise cache.unreadable(exc) from None
    tokens = arrays["tokens"]
    n = int(tokens.shape[0])
    if n < 2 or meta.get("rows") != n:
        raise DataError(
            f"token cache {str(directory)!r} holds {n} rows (meta says {meta.get('rows')}): need "
            ">= 2 consistent rows; add text, or delete the directory to rebuild it"
        )
    train_index, val_index = fixed_split(n, val_fraction)
    return PackedText(tokens, tokenizer.get_vocab_size(), train_index, val_index, directory)


def mask_sample(
    row: np.ndarray,
    vocab_size: int,
    mask_prob: float,
    seed: int,
    epoch: int,
    split: str,
    index: int,
) -> tuple:
    """Mask one row; a pure function of its arguments.

    Args:
        row: ``(T,)`` token ids.
        vocab_size: ids ``>= len(SPECIAL_TOKENS)`` and ``< vocab_size`` are ordinary tokens.
        mask_prob: selection probability of an ordinary token.
        seed, epoch, split, index: the masking seed; ``index`` is the sample's row number.

    Returns:
        ``(input_ids, labels)``: two ``(T,)`` int64 arrays; labels are ``-100`` where no
        prediction is made. At least one token is always selected.
    """
    row = np.asarray(row, dtype=np.int64)
    ends = np.zeros(row.shape[0], dtype=bool)
    ends[1:-1] = True  # a row of special tokens only: pick between [CLS] and [SEP]
    return mask_tokens(
        sample_rng(seed, epoch, split, index),
        row,
        row >= len(SPECIAL_TOKENS),
        ends,
        mask_prob,
        MASK_ID,
        (len(SPECIAL_TOKENS), max(vocab_size, len(SPECIAL_TOKENS) + 1)),
    )


def random_batches(
    vocab_size: int, seq_len: int, mask_prob: float, rows: int = 32
) -> Callable[[int], Dict[str, torch.Tensor]]:
    """``n -> `` a masked batch (:func:`make_mlm_batch`, seed 0, epoch 0) of random token rows,
    for sizing and timing without the data: ``max(n, rows)`` rows of ids in
    ``[len(SPECIAL_TOKENS), vocab_size)`` from ``default_rng(0)``, drawn once and again only
    when more are asked for (the first rows are the same for every ``n``)."""
    drawn: List[PackedText] = []

    def make(n: int) -> Dict[str, torch.Tensor]:
        if not drawn or len(drawn[0].tokens) < n:
            tokens = np.random.default_rng(0).integers(
                len(SPECIAL_TOKENS), vocab_size, size=(max(n, rows), seq_len)
            )
            index = np.arange(len(tokens))
            drawn[:] = [
                PackedText(tokens.astype(np.int32), vocab_size, index, np.arange(0), Path("."))
            ]
        return make_mlm_batch(drawn[0], range(n), mask_prob, 0, 0, "train")

    return make


def make_mlm_batch(
    data: PackedText,
    rows: Sequence[int],
    mask_prob: float,
    seed: int,
    epoch: int,
    split: str,
    positions: bool = True,
) -> Dict[str, torch.Tensor]:
    """A masked batch of the given row numbers (``positions=False``: without
    ``masked_positions``, for a model whose forward takes ids and labels only).

    Returns:
        ``{"input_ids": (B, T) int64, "labels": (B, T) int64, "masked_positions": (B, P)
        int64}`` on the CPU: :func:`masked_positions` of the labels, so the model gathers the
        masked tokens with indices built here, never with a boolean mask on the device.
    """
    inputs, labels = [], []
    for index in rows:
        x, y = mask_sample(
            data.tokens[int(index)], data.vocab_size, mask_prob, seed, epoch, split, int(index)
        )
        inputs.append(x)
        labels.append(y)
    stacked = np.stack(labels)
    batch = {"input_ids": torch.from_numpy(np.stack(inputs)), "labels": torch.from_numpy(stacked)}
    if positions:
        batch["masked_positions"] = torch.from_numpy(masked_positions(stacked))
    return batch


def masked_positions(labels: np.ndarray) -> np.ndarray:
    """``(B, P)`` int64: row ``i`` holds the columns of ``labels[i]`` that are not
    :data:`IGNORE_INDEX`, ascending, then ``-1`` up to ``P`` = the most masked tokens of any
    row (at least 1). Built on the CPU with the batch: the shape the model's gather takes is
    known before the copy to the device (no data-dependent shape, no host synchronisation),
    and row ``i`` depends only on its own labels (a prefix of it in a wider batch)."""
    labels = np.asarray(labels)
    selected = labels != IGNORE_INDEX
    per_row = selected.sum(axis=1)
    width = max(1, int(per_row.max())) if len(labels) else 1
    out = np.full((len(labels), width), -1, dtype=np.int64)
    rows, cols = np.nonzero(selected)  # row-major: each row's columns ascending
    starts = np.concatenate(([0], np.cumsum(per_row)[:-1])) if len(labels) else per_row
    out[rows, np.arange(len(rows)) - starts[rows]] = cols
    return out
