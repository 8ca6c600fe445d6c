"""Raw text for masked-language modelling: the embedded corpus or the user's files.

The embedded corpus is CPython's ``pydoc_data.topics`` (the help texts behind ``help()``,
~465 k characters, PSF licence), which every CPython installation carries: nothing is
downloaded. ``task.data.files`` points at the user's own UTF-8 text instead.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence

from hetseq_hpc.config.validate import expand_data_files
from hetseq_hpc.errors import DataError

#: bytes read from a data file at a time (memory stays bounded whatever the file's size)
READ_CHUNK_BYTES = 1 << 22


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

    def documents(self) -> Iterator[str]:
        """Yield documents: one per help topic, or one per blank-line-separated paragraph block
        of each file. Files are read in chunks of :data:`READ_CHUNK_BYTES`, so memory stays
        bounded whatever their size; the blocks are exactly those of ``text.split("\\n\\n")``
        on the whole file (universal newlines, as text mode reads it).

        Raises:
            DataError: a file vanished or is not UTF-8 text (the byte offset is named).
        """
        if not self.files:
            yield from _embedded_documents()
            return
        for path in self.files:
            for block in _file_blocks(path):
                block = block.strip()
                if block:
                    yield block

    @property
    def size_bytes(self) -> int:
        """Bytes of text (the files' sizes, or the embedded corpus's UTF-8 length)."""
        if not self.files:
            return sum(len(d.encode("utf-8")) + 2 for d in _embedded_documents())
        return sum(os.path.getsize(p) for p in self.files if os.path.exists(p))


def _file_blocks(path: str) -> Iterator[str]:
    """The ``"\\n\\n"``-separated blocks of a UTF-8 file, read chunk by chunk."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0
    rest = ""
    try:
        with open(path, "rb") as fh:
            while True:
                raw = fh.read(READ_CHUNK_BYTES)
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"data file {path!r} is not UTF-8 text ({exc.reason} near byte "
                        f"{offset + max(exc.start, 0)}): convert it (iconv -t utf-8) or drop it "
                        "from task.data.files"
                    ) from None
                offset += len(raw)
                parts = (rest + text).split("\n\n")
                rest = parts.pop()
                yield from parts
                if not raw:
                    break
    except OSError as exc:
        raise DataError(f"data file {path!r} cannot be read ({exc.strerror}): check it") from None
    yield rest


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
    h = hashlib.sha256()
    for path in expanded:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode())
    return Corpus(
        name=f"{len(expanded)} file(s) from task.data.files",
        files=tuple(expanded),
        fingerprint=h.hexdigest()[:16],
    )
