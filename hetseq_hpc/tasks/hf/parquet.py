"""The user's ``.parquet`` files through ``pyarrow`` (in the ``hf`` extra with ``datasets``, or
alone: ``pip install 'hetseq-hpc[parquet]'``): the footer checks and the reference reader.

:func:`hetseq_hpc.tasks.hf.records.records` reads the rows through ``datasets`` (its
``parquet`` builder, :data:`BATCH_ROWS` rows at a time); this module reads the footer before
that (:func:`parquet_columns`: the columns, 0 rows, not Parquet: one line each), and its
:func:`parquet_rows` is the reader where ``datasets`` refuses a file or a row is bad (it names
the record). Only the wanted columns are read, one record batch (within one row group) at a
time: a large file is never loaded whole. ``pyarrow`` is imported on first use, so the other
formats' checks work without it.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

from hetseq_hpc.errors import DataError

#: rows per record batch read from a Parquet file (by ``datasets`` and by :func:`parquet_rows`)
BATCH_ROWS = 1024

#: the fix printed when pyarrow is missing
INSTALL_HINT = (
    "pip install 'hetseq-hpc[parquet]' (or convert it to JSON lines: one "
    '{"text": ...} object per line)'
)


def _parquet_file(path: str):
    """``pyarrow.parquet.ParquetFile(path)`` (its footer read, no data).

    Raises:
        DataError: pyarrow is not installed, or ``path`` is not a readable Parquet file.
    """
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"data file {path!r} is Parquet, which needs pyarrow: {INSTALL_HINT}"
        ) from None
    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"data file {path!r} is not a readable Parquet file ({reason}): "
            "check it, or write it again (e.g. pandas.DataFrame.to_parquet)"
        ) from None


def parquet_columns(path: str) -> List[str]:
    """The top-level column names of the Parquet file ``path`` (from its schema).

    Raises:
        DataError: pyarrow is missing, the file is not Parquet, or it holds no rows.
    """
    pf = _parquet_file(path)
    if pf.metadata.num_rows == 0:
        raise DataError(
            f"data file {path!r} holds no records (a Parquet file of 0 rows): give a file with data"
        )
    return list(pf.schema_arrow.names)


def parquet_rows(path: str, fields: Sequence[str]) -> Iterator[Tuple[int, Dict[str, object]]]:
    """``(record number, {field: value})`` for every row of ``path`` in file order, reading
    only ``fields``, :data:`BATCH_ROWS` rows at a time. Numbers start at 1; values are Python
    objects (``str``, ``int``, ``float``, ``bool``, ``None`` for a null).

    Raises:
        DataError: pyarrow is missing, the file is not Parquet, holds no rows, lacks one of
            ``fields`` (the line names the columns it has), or cannot be decoded.
    """
    found = parquet_columns(path)
    wanted = list(dict.fromkeys(fields))
    for name in wanted:
        if name not in found:
            raise DataError(
                f"data file {path!r} has no column {name!r}; its columns are "
                f"{', '.join(map(repr, found))}: set the task.data.*_field that "
                "names it to one of them"
            )
    import pyarrow

    pf = _parquet_file(path)
    number = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
            names = batch.schema.names
            values = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for row in zip(*values):
                number += 1
                yield number, dict(zip(names, row))
    except (pyarrow.ArrowException, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"data file {path!r} cannot be read after record {number} "
            f"({reason}): check it, or write it again"
        ) from None
