"""Reading a user's UTF-8 file in bounded pieces: the one decoder behind every text corpus.

The BERT corpus (:mod:`hetseq_hpc.tasks.bert.text_corpus`) splits the chunks into documents, the
translation corpus (:mod:`hetseq_hpc.tasks.translation.parallel_corpus`) into lines; both read
through :func:`utf8_chunks`, so a file is never held whole and a bad byte is named the same way.
"""

from __future__ import annotations

import codecs
import io
from typing import Iterator, Tuple

from hetseq_hpc.errors import DataError


def utf8_chunks(
    path: str, chunk_bytes: int, *, translate_newlines: bool = False
) -> Iterator[Tuple[str, bool]]:
    """The text of the UTF-8 file ``path`` as ``(text, last)``, decoded ``chunk_bytes`` bytes at
    a time (a character split between two reads is completed in the next piece); the final
    piece, possibly empty, has ``last=True``.

    Args:
        path: the file.
        chunk_bytes: bytes read per piece (the text held at once stays near this size).
        translate_newlines: turn ``"\\r\\n"`` and ``"\\r"`` into ``"\\n"`` (universal newlines,
            also across a chunk boundary).

    Raises:
        DataError: the file is not UTF-8 (the byte offset is named) or cannot be read.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    if translate_newlines:
        decoder = io.IncrementalNewlineDecoder(decoder, translate=True)
    offset = 0
    try:
        with open(path, "rb") as fh:
            while True:
                raw = fh.read(chunk_bytes)
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"data file {str(path)!r} is not UTF-8 text ({exc.reason} near byte "
                        f"{offset + max(exc.start, 0)}): convert it (iconv -t utf-8) or drop it "
                        "from task.data.files"
                    ) from None
                offset += len(raw)
                yield text, not raw
                if not raw:
                    return
    except OSError as exc:
        raise DataError(
            f"data file {str(path)!r} cannot be read ({exc.strerror}): check it"
        ) from None
