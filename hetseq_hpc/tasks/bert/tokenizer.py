"""A WordPiece tokenizer trained offline on the training corpus with Hugging Face ``tokenizers``
(``BertWordPieceTokenizer``, the scheme of BERT, Devlin et al. 2019), cached on disk."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer

from hetseq_hpc.files.atomic import atomic_write_text

log = logging.getLogger(__name__)

#: special tokens; their ids are 0..4 in this order.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_tokenizer(
    documents: Iterable[str], vocab_size: int, path: Path, show_progress: bool = False
) -> Tokenizer:
    """Train a lower-casing WordPiece tokenizer and save it atomically to ``path`` (JSON).

    ``tokenizers`` streams ``documents`` in batches and counts words on all cores; memory grows
    with the number of distinct words, not with the corpus.

    Args:
        documents: the training text, one string per document (an iterator is fine).
        vocab_size: the vocabulary size asked for; a small corpus yields fewer tokens.
        path: where the tokenizer JSON goes.
        show_progress: ``tokenizers``' own progress bar.
    """
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(
        documents,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        show_progress=show_progress,
    )
    atomic_write_text(path, wordpiece._tokenizer.to_str(pretty=True), durable=True)
    log.info("trained WordPiece tokenizer: %d tokens -> %s", wordpiece.get_vocab_size(), path)
    return Tokenizer.from_file(str(path))


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a tokenizer saved by :func:`train_tokenizer`."""
    return Tokenizer.from_file(str(path))
