"""Packed token sequences and deterministic BERT masking.

The corpus is tokenised once, documents are joined with ``[SEP]``, and the stream is cut
into rows ``[CLS] t_1 ... t_{T-2} [SEP]`` of exactly ``T = max_seq_len`` tokens (no padding).
The rows live in one ``int32`` array on disk (``tokens.npy``), memory-mapped by every rank.

Masking follows BERT (Devlin et al., 2019, section 3.1): each non-special token is selected
with probability ``mask_prob``; a selected token becomes ``[MASK]`` 80% of the time, a random
token 10%, and stays 10%. It is a pure function of ``(seed, epoch, split, sample index)``, so a
sample is masked the same way whichever rank, world size or allocation processes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import torch

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.bert.corpus import Corpus
from hetseq_hpc.tasks.bert.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
IGNORE_INDEX = -100
#: split codes mixed into the masking seed
SPLIT_CODES = {"train": 0, "val": 1}
#: bump when the packing format changes, so old caches are not reused
CACHE_FORMAT = 1


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


def build_packed_text(corpus: Corpus, vocab_size: int, seq_len: int, directory: Path) -> Path:
    """Tokenise ``corpus`` and write ``tokens.npy``/``tokenizer.json``/``meta.json`` into
    ``directory`` if they are not there yet. Files appear atomically (written under a temporary
    name, then renamed), so concurrent builders cannot leave a half-written cache.

    Raises:
        DataError: the corpus is too small for one training row.
    """
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = train_tokenizer(corpus.documents(), vocab_size, tokenizer_path)
    content = seq_len - 2
    chunks, pending = [], []
    pending_len = 0
    batch = []

    def flush(docs):
        nonlocal pending_len
        for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int32)
            if ids.size == 0:
                continue
            pending.append(ids)
            pending.append(np.asarray([SEP_ID], dtype=np.int32))
            pending_len += ids.size + 1

    for doc in corpus.documents():
        batch.append(doc)
        if len(batch) >= 256:
            flush(batch)
            batch = []
            if pending_len >= content * 4096:  # cut full rows, keep the tail
                stream = np.concatenate(pending)
                full = (stream.size // content) * content
                chunks.append(stream[:full].reshape(-1, content))
                pending[:] = [stream[full:]]
                pending_len = int(stream.size - full)
    if batch:
        flush(batch)
    stream = np.concatenate(pending) if pending else np.zeros(0, dtype=np.int32)
    full = (stream.size // content) * content
    if full:
        chunks.append(stream[:full].reshape(-1, content))
    if not chunks:
        raise DataError(
            f"corpus {corpus.name} has fewer than {content} tokens, too few for one row of "
            f"task.model.max_seq_len={seq_len}: add text or shorten the sequences"
        )
    body = np.concatenate(chunks)
    rows = np.empty((body.shape[0], seq_len), dtype=np.int32)
    rows[:, 0] = CLS_ID
    rows[:, 1:-1] = body
    rows[:, -1] = SEP_ID
    tmp = directory / f".tokens.{os.getpid()}.npy"
    np.save(tmp, rows)
    os.replace(tmp, directory / "tokens.npy")
    meta = {
        "corpus": corpus.name,
        "fingerprint": corpus.fingerprint,
        "rows": int(rows.shape[0]),
        "seq_len": seq_len,
        "vocab_size": tokenizer.get_vocab_size(),
        "format": CACHE_FORMAT,
    }
    tmp_meta = directory / f".meta.{os.getpid()}.json"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)
    log.info(
        "packed %s: %d rows x %d tokens, vocabulary %d -> %s",
        corpus.name, rows.shape[0], seq_len, meta["vocab_size"], directory,
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
    row: np.ndarray, vocab_size: int, mask_prob: float, seed: int, epoch: int, split: str, index: int
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
    random_tokens = rng.integers(len(SPECIAL_TOKENS), max(vocab_size, len(SPECIAL_TOKENS) + 1),
                                 size=row.shape[0])
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
        x, y = mask_sample(data.tokens[int(index)], data.vocab_size, mask_prob, seed, epoch, split,
                           int(index))
        inputs.append(x)
        labels.append(y)
    return {
        "input_ids": torch.from_numpy(np.stack(inputs)),
        "labels": torch.from_numpy(np.stack(labels)),
    }
