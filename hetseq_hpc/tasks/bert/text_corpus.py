"""Raw text for masked-language modelling: the embedded corpus or the user's files.

The embedded corpus is CPython's ``pydoc_data.topics`` (the help texts behind ``help()``,
~465 k characters, PSF licence), which every CPython installation carries: nothing is
downloaded. ``task.data.files`` points at the user's own UTF-8 text instead.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

from hetseq_hpc.config.validate import expand_data_files
from hetseq_hpc.tasks.cache import files_fingerprint
from hetseq_hpc.tasks.text_chunks import utf8_chunks

#: bytes read from a data file at a time (memory stays bounded whatever the file's size)
READ_CHUNK_BYTES = 1 << 22
#: characters of one piece at most: a paragraph block longer than this (a file without blank
#: lines, or without any newline) is cut at whitespace into pieces of the same document, so no
#: string the tokenizer sees grows with the file
MAX_PIECE_CHARS = 1 << 18
#: where a long block may be cut: whitespace splits words for every tokenizer here, so the
#: pieces give exactly the tokens of the whole block
_CUT_CHARS = (" ", "\n", "\t")


@dataclass(frozen=True)
class Corpus:
    """A list of documents plus a fingerprint that changes when the text changes.

    Attributes:
        name: ``"pydoc_data.topics"`` or a description of the user's files.
        files: the expanded file list (empty for the embedded corpus).
        fingerprint: hex digest of the content (embedded) or of paths, sizes and mtimes (files).
    """

    name: str
    files: tuple
    fingerprint: str

    def segments(self) -> Iterator[Tuple[str, bool]]:
        """Yield ``(text, ends_document)``: the documents (one per help topic, or one per
        blank-line-separated paragraph block of each file, stripped), each cut into pieces of
        at most :data:`MAX_PIECE_CHARS` characters at whitespace (a block with no whitespace
        for that long is cut anyway). Only the last piece of a document has ``ends_document``
        true (it may be ``""`` when the block ended in whitespace). Files are read in chunks of
        :data:`READ_CHUNK_BYTES`, so memory stays bounded whatever their size and line
        structure; the blocks are exactly those of ``text.split("\\n\\n")`` on the whole file
        (universal newlines, as text mode reads it).

        Raises:
            DataError: a file vanished or is not UTF-8 text (the byte offset is named).
        """
        if not self.files:
            for doc in _embedded_documents():
                yield from _pieces(doc, True)
            return
        for path in self.files:
            open_piece = False  # a piece of the current block was yielded
            for piece, end in _file_pieces(path):
                piece = piece.strip()
                if piece:
                    yield piece, end
                    open_piece = not end
                elif end and open_piece:
                    yield "", True
                    open_piece = False

    def documents(self) -> Iterator[str]:
        """The non-empty texts of :meth:`segments`: whole documents, a document longer than
        :data:`MAX_PIECE_CHARS` as several pieces (tokenizer training counts words, which the
        pieces keep whole).

        Raises:
            DataError: as :meth:`segments`.
        """
        return (text for text, _ in self.segments() if text)

    @property
    def size_bytes(self) -> int:
        """Bytes of text (the files' sizes, or the embedded corpus's UTF-8 length)."""
        if not self.files:
            return sum(len(d.encode("utf-8")) + 2 for d in _embedded_documents())
        return sum(os.path.getsize(p) for p in self.files if os.path.exists(p))


def _cut(text: str, start: int) -> int:
    """Where to end the piece of ``text`` starting at ``start`` (``len(text) - start >
    MAX_PIECE_CHARS``): before the last whitespace within the limit, else at the limit."""
    limit = start + MAX_PIECE_CHARS
    cut = max(text.rfind(c, start + 1, limit + 1) for c in _CUT_CHARS)
    return cut if cut > start else limit


def _pieces(block: str, end: bool) -> Iterator[Tuple[str, bool]]:
    """``block`` as pieces of at most :data:`MAX_PIECE_CHARS` characters; the last one carries
    ``end``."""
    start = 0
    while len(block) - start > MAX_PIECE_CHARS:
        cut = _cut(block, start)
        yield block[start:cut], False
        start = cut
    yield (block[start:] if start else block), end


def _file_pieces(path: str) -> Iterator[Tuple[str, bool]]:
    """The ``"\\n\\n"``-separated blocks of a UTF-8 file as ``(piece, ends_block)``, read
    chunk by chunk; a block longer than :data:`MAX_PIECE_CHARS` comes in several pieces, so the
    text held at once stays bounded even in a file without any newline."""
    rest = ""
    for text, _last in utf8_chunks(path, READ_CHUNK_BYTES, translate_newlines=True):
        parts = (rest + text).split("\n\n")
        rest = parts.pop()
        for part in parts:
            yield from _pieces(part, True)
        start = 0  # the unfinished block: keep only its last piece (ends in its tail)
        while len(rest) - start > MAX_PIECE_CHARS:
            cut = _cut(rest, start)
            yield rest[start:cut], False
            start = cut
        rest = rest[start:]
    yield rest, True


def _embedded_documents() -> List[str]:
    from pydoc_data import topics

    return [text for _, text in sorted(topics.topics.items()) if text.strip()]


def load_corpus(files: Sequence[str]) -> Corpus:
    """Resolve ``task.data.files`` (paths or globs) into a :class:`Corpus`.

    Raises:
        ConfigError: a pattern matches no file.
    """
    if not files:
        digest = hashlib.sha256("\x00".join(_embedded_documents()).encode()).hexdigest()
        return Corpus(name="pydoc_data.topics", files=(), fingerprint=digest[:16])
    expanded = expand_data_files(list(files))
    return Corpus(
        name=f"{len(expanded)} file(s) from task.data.files",
        files=tuple(expanded),
        fingerprint=files_fingerprint((os.path.abspath(p), p) for p in expanded),
    )
