"""The BERT corpus's token stream through the word cache of :mod:`hetseq_hpc.tokenizing`.

:func:`hetseq_hpc.tasks.bert.mlm_data.build_packed_text` encodes the corpus's pieces
``(text, ends_document)`` and joins them into one stream: each piece's ids
(``add_special_tokens=False``), then a ``[SEP]`` after the last piece of every document that
has tokens. The WordPiece tokenizer trained there (``BertNormalizer`` + ``BertPreTokenizer``)
never lets a token cross whitespace, so :func:`fast_encoding` finds the ``"words"`` mode and the
pieces are encoded word by word through a bounded cache (each distinct word once by the Rust
tokenizer), in one spawned process per core for inputs of 8 MB or more, in this process below
that (:func:`hetseq_hpc.tokenizing.pool.prepare_workers`; ``HETSEQ_PREPARE_WORKERS=N``
overrides it, ``HETSEQ_PREPARE_FAST=0`` turns the word cache off), exactly as ``task=hf``
prepare does. The stream is the plain path's, token for token:
``tests/unit/test_prepare_fast.py`` compares the two caches byte for byte.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from hetseq_hpc.tokenizing.pool import encode_stream
from hetseq_hpc.tokenizing.word_cache import fast_mode


def fast_encoding(tokenizer: Any) -> Optional[str]:
    """The word cache's mode for a ``tokenizers.Tokenizer`` (``"words"`` for the WordPiece
    tokenizer that prepare trains), or ``None``: use the plain ``encode_batch`` path
    (``HETSEQ_PREPARE_FAST=0``, truncation or padding set, a pipeline whose tokens may cross
    whitespace)."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    return fast_mode(tokenizer.to_str())


def with_separators(
    flat: np.ndarray, ends: np.ndarray, doc_ends: np.ndarray, open_doc: bool, sep_id: int
) -> Tuple[np.ndarray, bool]:
    """One batch's part of the packed stream: the pieces' ids with ``sep_id`` after the last
    piece of every document that has tokens (in this batch, or before it when ``open_doc``).

    Args:
        flat: ``(M,)`` int32, the pieces' ids concatenated.
        ends: ``(P,)`` int64, where each piece's ids end in ``flat`` (cumulative).
        doc_ends: ``(P,)`` bool, whether the piece is the last of its document.
        open_doc: the document running into this batch already has tokens.
        sep_id: the separator's id.

    Returns:
        ``(stream, open_doc)``: ``(M + documents ended with tokens,)`` int32, and whether the
        document running out of this batch (its last piece still to come) has tokens.

    Raises:
        ValueError: ``ends`` and ``doc_ends`` differ in length.
    """
    if len(ends) != len(doc_ends):
        raise ValueError(
            f"{len(ends)} piece ends but {len(doc_ends)} document flags: pass "
            "one flag per piece of the batch"
        )
    stop = np.asarray(ends, dtype=np.int64)[np.flatnonzero(doc_ends)]  # where documents end
    start = np.concatenate([np.zeros(1, dtype=np.int64), stop[:-1]])[: stop.size]
    has_tokens = stop > start
    if stop.size:
        has_tokens[0] |= open_doc
        open_doc = False
    tail = int(stop[-1]) if stop.size else 0
    stream = np.insert(flat, stop[has_tokens], np.int32(sep_id))
    return stream, bool(open_doc or flat.size > tail)


def packed_streams(
    batches: Iterable[List[Tuple[str, bool]]],
    tokenizer_json: str,
    mode: str,
    workers: int,
    sep_id: int,
) -> Iterator[np.ndarray]:
    """The packed stream of every batch of ``(text, ends_document)`` pieces, in order: int32
    arrays as :func:`with_separators` (a document may run across batches). ``workers``: as
    :func:`hetseq_hpc.tokenizing.pool.encode_stream` (1: in this process); at most
    ``2 * workers`` batches are in flight.

    Raises:
        DataError: a worker process died (killed, out of memory): one line, no hang.
    """
    flags: Deque[np.ndarray] = collections.deque()

    def texts() -> Iterator[List[str]]:
        for batch in batches:
            flags.append(np.fromiter((end for _, end in batch), dtype=bool, count=len(batch)))
            yield [text for text, _ in batch]

    open_doc = False
    stream = encode_stream(texts(), tokenizer_json, mode, workers)
    try:
        for _count, flat, ends, _size in stream:
            piece, open_doc = with_separators(flat, ends, flags.popleft(), open_doc, sep_id)
            yield piece
    finally:
        stream.close()  # stops the workers now, also when the caller stops early
