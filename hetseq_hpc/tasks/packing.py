"""Token rows of one width streamed to ``tokens.npy``: the one packer of the ``task=bert`` and
``task=hf`` token caches. :func:`write_token_rows` writes the ``.npy`` header last, atomically;
:class:`Packer` cuts a token stream into rows ``prefix + content + suffix``, holding one chunk of
rows, never the corpus; :func:`pad_rows` pads one row per text (docs/design/data-preparation.md,
"The token cache").
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import BinaryIO, Callable, List, Sequence, Tuple

import numpy as np

from hetseq_hpc.errors import DataError
from hetseq_hpc.files.atomic import atomic_write

#: the ``.npy`` header is written last, into this many bytes reserved at the start (numpy pads
#: a version-1.0 header to a multiple of 64 bytes; any (rows, T) shape fits in 128)
NPY_HEADER_BYTES = 128
#: full rows a :class:`Packer` holds before it writes them
ROWS_PER_WRITE = 4096


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


class RowFile:
    """Appends int32 rows of width ``seq_len`` to ``fh``, counting them in :attr:`rows`."""

    def __init__(self, fh: BinaryIO, seq_len: int):
        self.fh, self.seq_len, self.rows = fh, seq_len, 0

    def write(self, rows: np.ndarray) -> None:
        """Append ``(n, seq_len)`` rows."""
        self.fh.write(np.ascontiguousarray(rows, dtype=np.int32).tobytes())
        self.rows += int(rows.shape[0])


class Packer:
    """Joins token ids into one stream and cuts it into rows ``prefix + content + suffix`` of
    ``out.seq_len`` tokens (``[CLS] ... [SEP]`` for BERT); a last part shorter than a row is
    dropped. ``separator``: the ids :meth:`add_texts` puts after every text; ``rows_per_write``:
    full rows held before they are written (:meth:`flush` writes them earlier)."""

    def __init__(
        self,
        out: RowFile,
        prefix: Sequence[int] = (),
        suffix: Sequence[int] = (),
        separator: Sequence[int] = (),
        rows_per_write: int = ROWS_PER_WRITE,
    ):
        self.out, self.prefix, self.suffix = out, list(prefix), list(suffix)
        self.sep = np.asarray(list(separator), dtype=np.int32)
        self.content = out.seq_len - len(self.prefix) - len(self.suffix)
        self.limit = self.content * rows_per_write
        self.pending: List[np.ndarray] = []
        self.pending_len = 0

    def add(self, ids: Sequence[int]) -> None:
        """Append ``ids`` to the stream as they are (no separator)."""
        if len(ids):
            self.pending.append(np.asarray(ids, dtype=np.int32))
            self.pending_len += len(ids)
        if self.pending_len >= self.limit:
            self.flush()

    def add_texts(self, flat: np.ndarray, ends: np.ndarray) -> int:
        """Append texts (their ids concatenated, ``ends`` where each ends), each followed by
        the separator; returns the tokens added, separators not counted."""
        total = int(flat.size)
        if self.sep.size:
            flat = np.insert(flat, np.repeat(ends, self.sep.size), np.tile(self.sep, len(ends)))
        self.add(flat)
        return total

    def add_lists(self, id_lists: List[List[int]]) -> int:
        """:meth:`add_texts` of one id list per text, in one C-level pass."""
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        total = int(lengths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=total)
        return self.add_texts(flat, np.cumsum(lengths))

    def flush(self) -> None:
        """Write every full row now pending."""
        if not self.pending:
            return
        stream = np.concatenate(self.pending)
        full = (stream.size // self.content) * self.content
        if full:
            body = stream[:full].reshape(-1, self.content)
            rows = np.empty((body.shape[0], self.out.seq_len), dtype=np.int32)
            rows[:, : len(self.prefix)] = self.prefix
            rows[:, len(self.prefix) : len(self.prefix) + self.content] = body
            if self.suffix:
                rows[:, -len(self.suffix) :] = self.suffix
            self.out.write(rows)
        self.pending = [stream[full:]]
        self.pending_len = int(stream.size - full)


def pad_rows(
    id_lists: Sequence[Sequence[int]], width: int, pad_id: int
) -> Tuple[np.ndarray, np.ndarray]:
    """One row per text: ``(rows (n, width) int32, lengths (n,) int32)``, each text's ids cut
    to ``width`` and padded with ``pad_id``."""
    block = np.full((len(id_lists), width), pad_id, dtype=np.int32)
    size = np.empty(len(id_lists), dtype=np.int32)
    for i, ids in enumerate(id_lists):
        ids = ids[:width]
        block[i, : len(ids)] = ids
        size[i] = len(ids)
    return block, size


def write_token_rows(
    path: Path,
    seq_len: int,
    fill: Callable[[RowFile], None],
    min_rows: int,
    too_few: Callable[[int], str],
) -> int:
    """Write ``path``, a ``(rows, seq_len)`` int32 ``.npy`` file of the rows ``fill`` appends,
    atomically and durably, its header last; returns the rows.

    Raises:
        DataError: fewer than ``min_rows`` rows (the message is ``too_few(rows)``); and whatever
            ``fill`` raises (nothing of ``path`` is left then).
    """
    written = [0]

    def write(fh: BinaryIO) -> None:
        fh.write(b"\0" * NPY_HEADER_BYTES)
        out = RowFile(fh, seq_len)
        fill(out)
        if out.rows < min_rows:
            raise DataError(too_few(out.rows))
        header = npy_header(out.rows, seq_len)
        if len(header) != NPY_HEADER_BYTES:  # pragma: no cover - numpy's padding rule
            raise DataError(
                f"numpy wrote a {len(header)}-byte .npy header: delete {path.parent} and "
                "report this numpy version"
            )
        fh.seek(0)
        fh.write(header)
        written[0] = out.rows

    atomic_write(path, write, durable=True)
    return written[0]
