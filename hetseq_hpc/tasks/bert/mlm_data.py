"""Packed token sequences and deterministic BERT masking.

The corpus is tokenised once, documents are joined with ``[SEP]``, and the stream is cut
into rows ``[CLS] t_1 ... t_{T-2} [SEP]`` of exactly ``T = max_seq_len`` tokens (no padding).
The rows live in one ``int32`` array on disk (``tokens.npy``), memory-mapped by every rank.
Building it streams (:func:`build_packed_text`): bounded memory, all cores (the word cache of
:mod:`hetseq_hpc.tokenizing` in spawned workers, :mod:`.mlm_encode`), atomic.

Masking follows BERT (Devlin et al., 2019, section 3.1): each non-special token is selected
with probability ``mask_prob``; a selected token becomes ``[MASK]`` 80% of the time, a random
token 10%, and stays 10%. It is a pure function of ``(seed, epoch, split, sample index)``, so a
sample is masked the same way whichever rank, world size or allocation processes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write, atomic_write_text, remove_stale_temps
from hetseq_hpc.tasks.bert.mlm_encode import fast_encoding, packed_streams
from hetseq_hpc.tasks.bert.text_corpus import Corpus
from hetseq_hpc.tasks.bert.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from hetseq_hpc.tokenizing.pool import prepare_workers

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
IGNORE_INDEX = -100
#: split codes mixed into the masking seed
SPLIT_CODES = {"train": 0, "val": 1}
#: bump when the packing format changes, so old caches are not reused
CACHE_FORMAT = 1
_SEP = np.asarray([SEP_ID], dtype=np.int32)


def cache_root(cache_dir: str | None) -> Path:
    """The cache directory: ``task.data.cache_dir``, else ``$HETSEQ_CACHE``, else
    ``~/.cache/hetseq_hpc``."""
    if cache_dir:
        return Path(os.path.expanduser(cache_dir))
    env = os.environ.get("HETSEQ_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "hetseq_hpc"


def cache_key(corpus: Corpus, vocab_size: int, seq_len: int) -> str:
    """Directory name for one (corpus, vocabulary size, sequence length) combination."""
    text = f"{CACHE_FORMAT}|{corpus.fingerprint}|{vocab_size}|{seq_len}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


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
#: the ``.npy`` header is written last, into this many bytes reserved at the start (numpy pads
#: a version-1.0 header to a multiple of 64 bytes; any (rows, T) shape fits in 128)
NPY_HEADER_BYTES = 128


def npy_header(rows: int, seq_len: int) -> bytes:
    """The ``.npy`` version-1.0 header of a C-ordered ``(rows, seq_len)`` int32 array."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.int32)),
            "fortran_order": False,
            "shape": (int(rows), int(seq_len)),
        },
    )
    return buf.getvalue()


class RowWriter:
    """Cuts a token stream into rows ``[CLS] t_1 .. t_{T-2} [SEP]`` and appends every
    :data:`ROWS_PER_WRITE` full rows to ``fh`` (the tail shorter than a row is dropped at the
    end): memory holds one chunk of rows, never the corpus.

    Args:
        fh: binary file positioned after the reserved header.
        seq_len: T, tokens per row.
    """

    def __init__(self, fh: BinaryIO, seq_len: int):
        self.fh = fh
        self.seq_len = seq_len
        self.content = seq_len - 2
        self.pending: List[np.ndarray] = []
        self.pending_len = 0
        self.rows = 0

    def add(self, ids: Sequence[int], end: bool = True) -> None:
        """Append token ids of a document, and a ``[SEP]`` when ``end`` (the document's last
        piece; an empty last piece adds only the ``[SEP]``)."""
        if len(ids):
            self.pending.append(np.asarray(ids, dtype=np.int32))
        if end:
            self.pending.append(_SEP)
        self.pending_len += len(ids) + int(end)
        if self.pending_len >= self.content * ROWS_PER_WRITE:
            self.flush()

    def flush(self) -> None:
        """Write every full row now pending."""
        if not self.pending:
            return
        stream = np.concatenate(self.pending)
        full = (stream.size // self.content) * self.content
        if full:
            body = stream[:full].reshape(-1, self.content)
            rows = np.empty((body.shape[0], self.seq_len), dtype=np.int32)
            rows[:, 0] = CLS_ID
            rows[:, 1:-1] = body
            rows[:, -1] = SEP_ID
            self.fh.write(rows.tobytes())
            self.rows += int(rows.shape[0])
        self.pending = [stream[full:]]
        self.pending_len = int(stream.size - full)


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


def _pack_plain(tokenizer, batches: Iterable[List[Tuple[str, bool]]], rows: RowWriter) -> None:
    """The plain path: every piece through ``encode_batch`` (all cores, in this process)."""
    open_doc = False  # the current document has tokens (it ends with a [SEP])
    for batch in batches:
        texts = [text for text, _ in batch]
        for (_, end), enc in zip(batch, tokenizer.encode_batch(texts, add_special_tokens=False)):
            open_doc = open_doc or bool(enc.ids)
            if enc.ids or (end and open_doc):
                rows.add(enc.ids, end=end and open_doc)
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
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first
        if meta_path.is_file():
            return directory
        remove_stale_temps([directory])
        if show_progress is None:
            show_progress = sys.stderr.isatty()
        return _build(corpus, vocab_size, seq_len, directory, show_progress)


def _build(
    corpus: Corpus, vocab_size: int, seq_len: int, directory: Path, show_progress: bool
) -> Path:
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
    writer_rows = [0]

    def write(fh: BinaryIO) -> None:
        fh.write(b"\0" * NPY_HEADER_BYTES)
        rows = RowWriter(fh, seq_len)
        with _progress(total, "packing", show_progress) as bar:
            if mode is not None:  # the word cache: the same ids, several times faster
                log.info("tokenising with the %s word cache on %d process(es)", mode, workers)
                with contextlib.closing(
                    packed_streams(
                        _batches(corpus.segments(), bar), tokenizer.to_str(), mode, workers, SEP_ID
                    )
                ) as streams:
                    for stream in streams:
                        rows.add(stream, end=False)
            else:
                _pack_plain(tokenizer, _batches(corpus.segments(), bar), rows)
        rows.flush()
        if rows.rows == 0:
            raise DataError(
                f"corpus {corpus.name} has fewer than {seq_len - 2} tokens, too few for one row "
                f"of task.model.max_seq_len={seq_len}: add text or shorten the sequences"
            )
        header = npy_header(rows.rows, seq_len)
        if len(header) != NPY_HEADER_BYTES:  # pragma: no cover - numpy's padding rule
            raise DataError(
                f"numpy wrote a {len(header)}-byte .npy header: delete "
                f"{directory} and report this numpy version"
            )
        fh.seek(0)
        fh.write(header)
        writer_rows[0] = rows.rows

    atomic_write(directory / "tokens.npy", write, durable=True)
    meta = {
        "corpus": corpus.name,
        "fingerprint": corpus.fingerprint,
        "rows": writer_rows[0],
        "seq_len": seq_len,
        "vocab_size": tokenizer.get_vocab_size(),
        "format": CACHE_FORMAT,
    }
    atomic_write_text(directory / "meta.json", json.dumps(meta, indent=1), durable=True)
    now = time.monotonic()
    log.info(
        "packed %s: %d rows x %d tokens, vocabulary %d, in %.0f s (tokenizer %.1f s, "
        "packing %.1f s) -> %s",
        corpus.name,
        writer_rows[0],
        seq_len,
        meta["vocab_size"],
        now - started,
        trained - started,
        now - trained,
        directory,
    )
    return directory


def load_packed_text(directory: Path, val_fraction: float) -> PackedText:
    """Memory-map a cache written by :func:`build_packed_text` and split it.

    The split is a fixed permutation (seed 0, independent of ``trainer.seed``) so validation
    data never changes between runs; at least one row goes to each split.

    Raises:
        DataError: the cache is missing, damaged, or has fewer than 2 rows.
    """
    try:
        meta = json.loads((directory / "meta.json").read_text())
        tokens = np.load(directory / "tokens.npy", mmap_mode="r")
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except Exception as exc:
        raise DataError(
            f"token cache {str(directory)!r} is unreadable ({type(exc).__name__}): delete that "
            "directory to rebuild it"
        ) from None
    n = int(tokens.shape[0])
    if n < 2 or meta.get("rows") != n:
        raise DataError(
            f"token cache {str(directory)!r} holds {n} rows (meta says {meta.get('rows')}): need "
            ">= 2 consistent rows; add text, or delete the directory to rebuild it"
        )
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    order = np.random.default_rng(0).permutation(n)
    return PackedText(
        tokens=tokens,
        vocab_size=tokenizer.get_vocab_size(),
        train_index=np.sort(order[n_val:]),
        val_index=np.sort(order[:n_val]),
        directory=directory,
    )


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
    rng = np.random.default_rng([seed, epoch, SPLIT_CODES[split], int(index)])
    row = np.asarray(row, dtype=np.int64)
    maskable = row >= len(SPECIAL_TOKENS)
    selected = (rng.random(row.shape[0]) < mask_prob) & maskable
    if not selected.any():
        candidates = np.flatnonzero(maskable)
        if candidates.size == 0:
            candidates = np.arange(1, row.shape[0] - 1)
        selected[candidates[rng.integers(candidates.size)]] = True
    action = rng.random(row.shape[0])
    random_tokens = rng.integers(
        len(SPECIAL_TOKENS), max(vocab_size, len(SPECIAL_TOKENS) + 1), size=row.shape[0]
    )
    inputs = row.copy()
    inputs[selected & (action < 0.8)] = MASK_ID
    swap = selected & (action >= 0.8) & (action < 0.9)
    inputs[swap] = random_tokens[swap]
    labels = np.where(selected, row, IGNORE_INDEX)
    return inputs, labels


def make_mlm_batch(
    data: PackedText, rows: Sequence[int], mask_prob: float, seed: int, epoch: int, split: str
) -> Dict[str, torch.Tensor]:
    """A masked batch of the given row numbers.

    Returns:
        ``{"input_ids": (B, T) int64, "labels": (B, T) int64}`` on the CPU.
    """
    inputs, labels = [], []
    for index in rows:
        x, y = mask_sample(
            data.tokens[int(index)], data.vocab_size, mask_prob, seed, epoch, split, int(index)
        )
        inputs.append(x)
        labels.append(y)
    return {
        "input_ids": torch.from_numpy(np.stack(inputs)),
        "labels": torch.from_numpy(np.stack(labels)),
    }
