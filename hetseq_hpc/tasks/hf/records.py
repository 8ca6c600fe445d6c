"""The user's local files as records, read through Hugging Face ``datasets`` (the ``hf`` extra,
``pip install 'hetseq-hpc[hf]'``), streaming and offline.

:func:`records` streams ``.txt``, JSON lines, CSV/TSV and Parquet in batches of
:data:`BATCH_RECORDS`; JSON lines are decoded by :func:`json.loads`; :func:`columns` checks the
header before anything starts. The standard library is the reference these records must equal,
and reads a file whenever ``datasets`` would read it differently; bad input is one
:class:`DataError` line. The formats and every fallback: docs/design/data-preparation.md,
"The user's files as records".
"""

from __future__ import annotations

import csv
import glob
import itertools
import json
import logging
import os
import shutil
import tempfile
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.hf import parquet
from hetseq_hpc.tasks.hf.parquet import parquet_columns, parquet_rows

log = logging.getLogger(__name__)

#: suffix -> format
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
}

#: records taken from ``datasets`` at a time (Parquet: :data:`parquet.BATCH_ROWS`)
BATCH_RECORDS = 10_000

#: bytes of a text file the ``text`` builder reads at a time (its default, 10 MB, is slower
#: here and holds 200 MB more)
TEXT_CHUNK_BYTES = 256 << 10

#: the fix printed when ``datasets`` is missing
INSTALL_HINT = "pip install 'hetseq-hpc[hf]'"

#: first bytes that ``datasets`` takes for a compressed file (it would unpack it, where the
#: standard library reads the bytes as they are): such files go to the standard library
_COMPRESSED = (
    b"PK\x03\x04",
    b"PK\x05\x06",
    b"PK\x07\x08",
    b"BZh",
    b"\x1f\x8b",
    b"\xfd7zXZ\x00",
    b"\x04\x22\x4d\x18",
    b"\x28\xb5\x2f\xfd",
    b"Rar!",
)


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


def _delimiter(fmt: str) -> str:
    """The field separator of a ``csv`` or ``tsv`` file."""
    return "\t" if fmt == "tsv" else ","


def columns(path: str) -> List[str]:
    """The column names of ``path`` (a text file has the one column ``"text"``): the CSV
    header, the keys of the first JSON object, or the Parquet schema's names. Read with the
    standard library (pyarrow's footer for Parquet): the first line only.

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
            names = csv.DictReader(fh, delimiter=_delimiter(fmt)).fieldnames
            if not names:
                raise DataError(
                    f"data file {path!r} has no header row: put the column names "
                    "(e.g. text,label) on the first line"
                )
            return list(names)
        for number, line in enumerate(fh, 1):
            if line.strip():
                return list(_json_object(line, path, number))
    raise DataError(f"data file {path!r} holds no records: give a file with data")


def _json_object(line: str, path: str, number: int) -> Dict[str, object]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"data file {path!r} line {number} is not JSON ({exc.msg}): write one "
            "JSON object per line (JSON lines)"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"data file {path!r} line {number} is a {type(obj).__name__}, not a "
            'JSON object: write one {"text": ...} object per line'
        )
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
                    raise DataError(
                        f"data file {path!r} is plain text (one column, the text): "
                        f"{key}={name!r} needs JSON lines, CSV or Parquet with that column"
                    )
                raise DataError(
                    f"data file {path!r} has no column {name!r} ({key}); its "
                    f"columns are {', '.join(map(repr, found))}: set {key}=<one of "
                    "them>"
                )


def records(path: str, text_field: str, label_field: Optional[str]) -> Iterator[Tuple[str, object]]:
    """``(text, label)`` of every record of ``path`` in file order (label None without
    ``label_field``); empty lines of text and JSON-lines files are skipped. Texts are ``str``;
    labels as stored (JSON: ``int``/``str``/``bool``/...; CSV: ``str``; Parquet: its type).

    Read through ``datasets`` (streaming, :data:`BATCH_RECORDS` records at a time); what it
    would read differently, or refuses, is read by the standard library (module docstring),
    so the records are those the standard library reads.

    Raises:
        DataError: ``datasets`` is not installed (the line says ``pip install
            'hetseq-hpc[hf]'``); a record lacks the column, a label is blank (empty or all
            spaces), a text is not a string, a JSON line is not an object, or the file is not UTF-8 / not readable (one line naming
            the file and line); a Parquet file lacks the column (the line names the columns
            it has), holds no rows, or pyarrow is not installed.
    """
    fmt = file_format(path)
    fields = [text_field] + ([label_field] if label_field else [])
    if not _datasets_reads(path, fmt, fields):
        yield from _stdlib_records(path, text_field, label_field)
        return
    done = 0
    try:
        for batch in _datasets_batches(path, fmt, fields):
            yield from batch
            done += len(batch)
    except DataError:
        raise
    except Exception as exc:  # whatever it is, the standard library decides
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        log.info(
            "data file %s: datasets stopped after %d records (%s: %s); the standard "
            "library reads on",
            path,
            done,
            type(exc).__name__,
            reason,
        )
        yield from itertools.islice(_stdlib_records(path, text_field, label_field), done, None)
        return


def _datasets_reads(path: str, fmt: str, fields: Sequence[str]) -> bool:
    """Whether ``datasets`` reads ``path`` as the standard library does (cheap checks of the
    first bytes, the CSV header, the first JSON line, the Parquet footer).

    Raises:
        DataError: the Parquet footer cannot be read or it holds no rows (as before).
    """
    if fmt == "parquet":
        return all(name in parquet_columns(path) for name in fields)
    try:
        with open(path, "rb") as fh:
            if fh.read(8).startswith(_COMPRESSED):
                return False
        # the header / first JSON object, as the standard library reads it
        found = columns(path) if fmt != "text" else []
    except (DataError, OSError, UnicodeDecodeError, ValueError, csv.Error):
        return False  # the standard library raises its one-line error
    if fmt in ("text", "json"):  # a JSON record without a field goes to the standard library
        return True
    return len(set(found)) == len(found) and all(name in found for name in fields)


def _import_datasets():
    """``datasets``, offline, its progress bars and logging off.

    Offline: ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` unless set, before its import;
    and, as it reads them when imported (perhaps before this), its ``config`` is set offline
    too: else ``load_dataset`` of a packaged builder on local files still asks the Hub
    (its download count, a HEAD request, 3 s timeout per call without a network).

    Raises:
        DataError: it is not installed (one line: ``pip install 'hetseq-hpc[hf]'``).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
        import datasets.config
    except ImportError as exc:
        raise DataError(
            f"task=hf reads its data files with Hugging Face datasets, which is not "
            f"installed ({exc}): {INSTALL_HINT}"
        ) from None
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    datasets.disable_progress_bars()
    # its errors are ours to report (one line, after the standard library's look)
    datasets.logging.set_verbosity(logging.CRITICAL)
    return datasets


def _datasets_batches(
    path: str, fmt: str, fields: Sequence[str]
) -> Iterator[List[Tuple[str, object]]]:
    """Lists of ``(text, label)`` read by ``datasets``, a batch at a time; raises (anything)
    where a record is not what the standard library would give, after the list of the
    records before it, for :func:`records` to hand over to the standard library."""
    datasets = _import_datasets()
    wanted = list(dict.fromkeys(fields))
    options: Dict[str, object] = {}
    batch = BATCH_RECORDS
    if fmt in ("csv", "tsv"):
        # every value the string the csv module reads; "" (an empty or a missing cell: the
        # csv module tells them apart, pandas does not) and blank lines come as None
        options = dict(
            sep=_delimiter(fmt),
            usecols=wanted,
            features=datasets.Features({n: datasets.Value("string") for n in wanted}),
            keep_default_na=False,
            na_values=[""],
            skip_blank_lines=False,
            index_col=False,
        )
    elif fmt == "parquet":
        batch = parquet.BATCH_ROWS
        options = dict(columns=wanted, batch_size=batch)
    elif fmt in ("text", "json"):
        options = dict(chunksize=TEXT_CHUNK_BYTES)
    builder = {"tsv": "csv", "json": "text"}.get(fmt, fmt)
    cache = tempfile.mkdtemp(prefix="hetseq-datasets-")
    try:
        ds = datasets.load_dataset(
            builder,
            data_files=[glob.escape(os.path.abspath(path))],
            split="train",
            streaming=True,
            cache_dir=cache,
            **options,
        )
        for table in ds.with_format("arrow").iter(batch_size=batch):
            if fmt == "text":
                yield [(line, None) for line in table.column("text").to_pylist() if line.strip()]
                continue
            if fmt == "json":
                yield from _json_lines_batch(table.column("text").to_pylist(), fields)
                continue
            texts = table.column(fields[0]).to_pylist()
            labels = table.column(fields[1]).to_pylist() if len(fields) > 1 else [None] * len(texts)
            yield from _good_records(zip(texts, labels), len(fields) > 1)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _json_lines_batch(
    lines: List[str], fields: Sequence[str]
) -> Iterator[List[Tuple[str, object]]]:
    """``(text, label)`` of the non-empty ``lines`` (one JSON object each), decoded by
    :func:`json.loads` as the standard library reader decodes them (:func:`_good_records`)."""

    def decoded(line: str) -> Tuple[object, object]:
        try:
            obj = json.loads(line)
        except ValueError:
            return None, None
        if not isinstance(obj, dict):
            return None, None
        return obj.get(fields[0]), obj.get(fields[1]) if len(fields) > 1 else None

    yield from _good_records((decoded(line) for line in lines if line.strip()), len(fields) > 1)


def _good_records(
    records: Iterable[Tuple[object, object]], labelled: bool
) -> Iterator[List[Tuple[str, object]]]:
    """One list of the ``(text, label)`` records before the first one the standard library
    would refuse (a text that is not a string, a missing or blank label), then ValueError for
    :func:`records` to hand that one to the standard library."""
    good: List[Tuple[str, object]] = []
    for text, label in records:
        if not isinstance(text, str) or (labelled and _missing(label)):
            yield good
            raise ValueError(f"record {len(good) + 1} of a batch has no text or label")
        good.append((text, label))
    yield good


def _stdlib_records(
    path: str, text_field: str, label_field: Optional[str]
) -> Iterator[Tuple[str, object]]:
    """:func:`records` read by the standard library (Parquet: pyarrow): the reference, the
    diagnosis of bad input, and the reader of what ``datasets`` would read differently.

    Raises:
        DataError: as :func:`records`.
    """
    fmt = file_format(path)
    if fmt == "parquet":
        fields = [text_field] + ([label_field] if label_field else [])
        for number, row in parquet_rows(path, fields):
            yield (
                _field(row, text_field, path, number),
                (_field(row, label_field, path, number, text=False) if label_field else None),
            )
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
                reader = csv.DictReader(fh, delimiter=_delimiter(fmt))
                rows = ((n, row) for n, row in enumerate(reader, 2))
            else:
                rows = (
                    (n, _json_object(line, path, n)) for n, line in enumerate(fh, 1) if line.strip()
                )
            for number, row in rows:
                yield (
                    _field(row, text_field, path, number),
                    (_field(row, label_field, path, number, text=False) if label_field else None),
                )
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path!r} is not UTF-8 text ({exc.reason}): convert it (iconv -t utf-8)"
        ) from None
    except OSError as exc:
        raise DataError(f"data file {path!r} cannot be read ({exc.strerror}): check it") from None


def _missing(label: object) -> bool:
    """A label that is absent (None) or blank (a string of nothing but spaces)."""
    return label is None or (isinstance(label, str) and not label.strip())


def _field(row: Dict[str, object], name: str, path: str, number: int, text: bool = True):
    value = row.get(name)
    if value is None:
        raise DataError(
            f"data file {path!r} record {number} has no {name!r} value (columns "
            f"{', '.join(map(repr, row))}): fill it in or drop the record"
        )
    if not text and _missing(value):  # a blank label would become a class of its own
        raise DataError(
            f"data file {path!r} record {number} has a blank {name!r} value ({value!r}): "
            "give every record its label, or drop the record"
        )
    if text and not isinstance(value, str):
        raise DataError(
            f"data file {path!r} record {number}: {name!r} is a "
            f"{type(value).__name__}, not text: store the text as a string"
        )
    return value
