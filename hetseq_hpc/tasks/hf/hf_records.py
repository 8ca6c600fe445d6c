"""The user's local files as records, read with the standard library (no ``datasets``), and
Parquet with ``pyarrow`` when it is installed (:mod:`hetseq_hpc.tasks.hf.hf_parquet`).

Formats, by suffix: ``.txt``/``.text`` (one sample per non-empty line, the text column only),
``.jsonl``/``.json`` (JSON lines: one object per line), ``.csv`` and ``.tsv`` (a header row
names the columns), ``.parquet`` (the named columns). Each file is streamed: memory holds one
record at a time (one record batch of :data:`~hetseq_hpc.tasks.hf.hf_parquet.BATCH_ROWS` rows
for Parquet).
"""

from __future__ import annotations

import csv
import json
import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.hf.hf_parquet import parquet_columns, parquet_rows

#: suffix -> format
FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".csv": "csv",
           ".tsv": "tsv", ".parquet": "parquet"}


def file_format(path: str) -> str:
    """``"text"``, ``"json"``, ``"csv"``, ``"tsv"`` or ``"parquet"`` from the suffix of
    ``path``.

    Raises:
        DataError: an unknown suffix (one line naming the accepted ones).
    """
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise DataError(f"data file {path!r}: unknown format; use one of {', '.join(FORMATS)}")
    return fmt


def _csv_reader(fh, fmt: str):
    return csv.DictReader(fh, delimiter="\t" if fmt == "tsv" else ",")


def columns(path: str) -> List[str]:
    """The column names of ``path`` (a text file has the one column ``"text"``): the CSV
    header, the keys of the first JSON object, or the Parquet schema's names.

    Raises:
        DataError: the file is empty or its first record is not a JSON object / CSV header;
            a Parquet file without pyarrow installed, unreadable, or of 0 rows.
    """
    fmt = file_format(path)
    if fmt == "text":
        return ["text"]
    if fmt == "parquet":
        return parquet_columns(path)
    with open(path, encoding="utf-8", newline="") as fh:
        if fmt in ("csv", "tsv"):
            names = _csv_reader(fh, fmt).fieldnames
            if not names:
                raise DataError(f"data file {path!r} has no header row: put the column names "
                                "(e.g. text,label) on the first line")
            return list(names)
        for number, line in enumerate(fh, 1):
            if line.strip():
                return list(_json_object(line, path, number))
    raise DataError(f"data file {path!r} holds no records: give a file with data")


def _json_object(line: str, path: str, number: int) -> Dict[str, object]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"data file {path!r} line {number} is not JSON ({exc.msg}): write one "
                        "JSON object per line (JSON lines)") from None
    if not isinstance(obj, dict):
        raise DataError(f"data file {path!r} line {number} is a {type(obj).__name__}, not a "
                        "JSON object: write one {\"text\": ...} object per line")
    return obj


def check_columns(paths: Sequence[str], wanted: Sequence[Tuple[str, str]]) -> None:
    """Every file has every wanted column.

    Args:
        paths: the data files.
        wanted: ``[(column, its config key)]``, e.g. ``[("text", "task.data.text_field")]``.

    Raises:
        DataError: a column is missing: one line naming the file, the columns found and the key.
    """
    for path in paths:
        found = columns(path)
        for name, key in wanted:
            if name not in found:
                if file_format(path) == "text":
                    raise DataError(f"data file {path!r} is plain text (one column, the text): "
                                    f"{key}={name!r} needs JSON lines, CSV or Parquet with that column")
                raise DataError(f"data file {path!r} has no column {name!r} ({key}); its "
                                f"columns are {', '.join(map(repr, found))}: set {key}=<one of "
                                "them>")


def records(path: str, text_field: str, label_field: Optional[str]
            ) -> Iterator[Tuple[str, object]]:
    """``(text, label)`` of every record of ``path`` in file order (label None without
    ``label_field``); empty lines of text and JSON-lines files are skipped.

    Raises:
        DataError: a record lacks the column, a text is not a string, or the file is not
            UTF-8 / not readable (one line naming the file and line); a Parquet file lacks
            the column (the line names the columns it has), holds no rows, or pyarrow is
            not installed.
    """
    fmt = file_format(path)
    if fmt == "parquet":
        fields = [text_field] + ([label_field] if label_field else [])
        for number, row in parquet_rows(path, fields):
            yield _field(row, text_field, path, number), (
                _field(row, label_field, path, number, text=False) if label_field else None)
        return
    try:
        with open(path, encoding="utf-8", newline="" if fmt in ("csv", "tsv") else None) as fh:
            if fmt == "text":
                for line in fh:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield line, None
                return
            if fmt in ("csv", "tsv"):
                rows = ((n, row) for n, row in enumerate(_csv_reader(fh, fmt), 2))
            else:
                rows = ((n, _json_object(line, path, n)) for n, line in enumerate(fh, 1)
                        if line.strip())
            for number, row in rows:
                yield _field(row, text_field, path, number), (
                    _field(row, label_field, path, number, text=False) if label_field else None)
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path!r} is not UTF-8 text ({exc.reason}): convert it "
                        "(iconv -t utf-8)") from None
    except OSError as exc:
        raise DataError(f"data file {path!r} cannot be read ({exc.strerror}): check it") from None


def _field(row: Dict[str, object], name: str, path: str, number: int, text: bool = True):
    value = row.get(name)
    if value is None:
        raise DataError(f"data file {path!r} record {number} has no {name!r} value (columns "
                        f"{', '.join(map(repr, row))}): fill it in or drop the record")
    if text and not isinstance(value, str):
        raise DataError(f"data file {path!r} record {number}: {name!r} is a "
                        f"{type(value).__name__}, not text: store the text as a string")
    return value
