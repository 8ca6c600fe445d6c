"""Raw text for masked-language modelling: the embedded corpus or the user's files.

The embedded corpus is CPython's ``pydoc_data.topics`` (the help texts behind ``help()``,
~465 k characters, PSF licence), which every CPython installation carries: nothing is
downloaded. ``task.data.files`` points at the user's own UTF-8 text instead.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence

from hetseq_hpc.config.validate import expand_data_files
from hetseq_hpc.errors import DataError


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
        of each file (files are read lazily, one at a time).

        Raises:
            DataError: a file vanished or is not UTF-8 text.
        """
        if not self.files:
            yield from _embedded_documents()
            return
        for path in self.files:
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"data file {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                    "convert it (iconv -t utf-8) or drop it from task.data.files"
                ) from None
            except OSError as exc:
                raise DataError(f"data file {path!r} cannot be read ({exc.strerror}): check it") from None
            for block in text.split("\n\n"):
                block = block.strip()
                if block:
                    yield block


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
