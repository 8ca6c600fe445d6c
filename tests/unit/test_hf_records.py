"""``task=hf`` data files read through Hugging Face ``datasets`` give exactly the records the
standard-library reader gave before (the reference below is a copy of it), so the prepared
cache is byte-identical: text, JSON lines (int and string labels), CSV and TSV with tricky
values, every error in the same one line; a seeded fuzz of CSV/TSV/JSON lines; the reader
stays offline and writes nothing under ``~/.cache``; ``datasets`` is imported lazily and its
absence is one line saying how to install it."""

from __future__ import annotations

import csv
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest

from hetseq_hpc.errors import DataError
from hetseq_hpc.tasks.hf import records as hf_records
from hetseq_hpc.tasks.hf.records import records

#: transformers and datasets are imported by the module's first test, on the one worker this
#: group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("hf")


@pytest.fixture(scope="module", autouse=True)
def _needs_datasets():
    """Skips the test where datasets is not installed."""
    pytest.importorskip("datasets")


# --- the reference: the standard-library reader before datasets (text, JSON lines, CSV) ------


def old_records(path, text_field, label_field):
    fmt = {
        ".txt": "text",
        ".text": "text",
        ".jsonl": "json",
        ".json": "json",
        ".csv": "csv",
        ".tsv": "tsv",
    }[os.path.splitext(path)[1].lower()]
    try:
        with open(path, encoding="utf-8", newline="" if fmt in ("csv", "tsv") else None) as fh:
            if fmt == "text":
                for line in fh:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield line, None
                return
            if fmt in ("csv", "tsv"):
                reader = csv.DictReader(fh, delimiter="\t" if fmt == "tsv" else ",")
                rows = ((n, row) for n, row in enumerate(reader, 2))
            else:
                rows = (
                    (n, old_json_object(line, path, n))
                    for n, line in enumerate(fh, 1)
                    if line.strip()
                )
            for number, row in rows:
                yield (
                    old_field(row, text_field, path, number),
                    (
                        old_field(row, label_field, path, number, text=False)
                        if label_field
                        else None
                    ),
                )
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path!r} is not UTF-8 text ({exc.reason}): convert it (iconv -t utf-8)"
        ) from None


def old_json_object(line, path, number):
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


def old_field(row, name, path, number, text=True):
    value = row.get(name)
    if value is None:
        raise DataError(
            f"data file {path!r} record {number} has no {name!r} value (columns "
            f"{', '.join(map(repr, row))}): fill it in or drop the record"
        )
    # issue 40: a blank label (which became a class "") is refused as a missing one is
    if not text and isinstance(value, str) and not value.strip():
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


def outcome(reader, path, text_field="text", label_field="label"):
    """The records, or the one-line DataError (with the type of every label kept)."""
    try:
        return [
            (text, label, type(label).__name__)
            for text, label in reader(str(path), text_field, label_field)
        ]
    except DataError as exc:
        assert "\n" not in str(exc) and "Traceback" not in str(exc)
        return f"DataError: {exc}"


def write(path: Path, content, encoding="utf-8") -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        with open(path, "w", encoding=encoding, newline="") as fh:
            fh.write(content)
    return path


@pytest.fixture
def only_datasets(monkeypatch):
    """Fail if the standard library reads a record (the file must go through datasets)."""

    def refuse(*args):
        raise AssertionError(f"the standard library read {args[0]}")

    monkeypatch.setattr(hf_records, "_stdlib_records", refuse)


# --- clean files: read by datasets alone, exactly as before ---------------------------------

TEXT = (
    "\ufefffirst line  \r\nsecond\tline\r\n\n   \n\t\nthird \u00e9\u4e2d\u2028mid\rfourth\n"
    "\n  indented  \nlast without newline"
)
JSONL_INT = (
    '{"text": "a, b", "label": 1}\n\n   \n{"label": 0, "text": "line\\nbreak \\u00e9"}\r\n'
    '{"text": "  spaced  ", "label": -3, "extra": {"x": [1]}}\n{"text": "NA", "label": 2}'
)
JSONL_STR = (
    '{"text": "001", "label": "pos"}\n{"text": "1.50", "label": "1"}\n'
    '{"text": "\\ud83d\\ude00 \\"q\\"", "label": " neg "}\n{"text": "", "label": "x"}\n'
)
JSONL_BOOL = '{"text": "yes", "label": true}\n{"text": "no", "label": false}\n'
CSV = (
    'text,label\n"a, quoted comma",1\n"embedded\nnewline",NA\n"crlf\r\ninside",nan\n'
    '001,1.50\n1e5,-1\n" spaced ",None\n"say ""hi""",x\nNULL,"0"\n#hash,N/A\nlast,2'
)
TSV = (
    'id\ttext\tlabel\n1\t"tab\tinside"\t"quoted"\n2\ta, comma\tNA\n3\t"multi\nline"\t7\r\n'
    '4\t"quote""d"\t\u00e9\n'
)


@pytest.mark.parametrize(
    "name,content,label",
    [
        ("t.txt", TEXT, None),
        ("t.text", TEXT, None),
        ("int.jsonl", JSONL_INT, "label"),
        ("str.json", JSONL_STR, "label"),
        ("bool.jsonl", JSONL_BOOL, "label"),
        ("int.jsonl", JSONL_INT, None),
        ("t.csv", CSV, "label"),
        ("t.csv", CSV, None),
        ("t.tsv", TSV, "label"),
        ("t.tsv", TSV, None),
    ],
)
def test_clean_files_are_read_by_datasets_exactly_as_before(
    tmp_path, only_datasets, name, content, label
):
    path = write(tmp_path / name, content)
    expected = outcome(old_records, path, label_field=label)
    assert isinstance(expected, list) and len(expected) >= 2
    assert outcome(records, path, label_field=label) == expected


def test_text_chunk_boundaries_change_nothing(tmp_path, monkeypatch, only_datasets):
    # chunks of a few bytes: lines, "\r\n" and "\r" cut at every place
    monkeypatch.setattr(hf_records, "TEXT_CHUNK_BYTES", 3)
    for i, content in enumerate([TEXT, "a\r\nb\r\n\r\nc\rd\r\re\n", "x" * 50 + "\r\n" + "y\r" * 9]):
        path = write(tmp_path / f"c{i}.txt", content)
        assert outcome(records, path, label_field=None) == outcome(
            old_records, path, label_field=None
        )


def test_json_chunk_boundaries_change_nothing(tmp_path, monkeypatch, only_datasets):
    # JSON lines come through the text builder: chunks of a few bytes cut every line
    monkeypatch.setattr(hf_records, "TEXT_CHUNK_BYTES", 3)
    for i, content in enumerate([JSONL_INT, JSONL_STR, JSONL_BOOL]):
        path = write(tmp_path / f"c{i}.jsonl", content)
        assert outcome(records, path) == outcome(old_records, path)


def test_values_of_another_json_type_after_the_first_10_mb_keep_their_type(tmp_path, only_datasets):
    """Regression: ``datasets``' ``json`` builder took a column's type from the first 10 MB
    chunk and CONVERTED later values to it: a label "1" or true after integer labels read as
    1, a silently wrong record. Each line is now decoded by json.loads: every label keeps its
    JSON type, and the file is still read by datasets alone (no fallback)."""
    head = "".join(
        json.dumps({"text": "x" * 120 + str(i), "label": i % 3}) + "\n" for i in range(100_000)
    )
    assert len(head) > 12 * 10**6  # past the json builder's 10 MB chunk
    tail = [
        '{"text": "late string", "label": "1"}',
        '{"text": "late bool", "label": true}',
        '{"text": "late float", "label": 1.0}',
        '{"text": "late list", "label": [1]}',
        '{"text": "late int", "label": 2}',
    ]
    path = write(tmp_path / "late.jsonl", head + "\n".join(tail) + "\n")
    got = list(records(str(path), "text", "label"))
    assert len(got) == 100_005
    assert got[-5:] == [
        ("late string", "1"),
        ("late bool", True),
        ("late float", 1.0),
        ("late list", [1]),
        ("late int", 2),
    ]
    assert [type(label) for _, label in got[-5:]] == [str, bool, float, list, int]
    assert got == [(t, lab) for t, lab in old_records(str(path), "text", "label")]


def test_a_number_as_the_text_after_the_first_10_mb_is_refused_as_before(tmp_path):
    head = "".join(json.dumps({"text": "y" * 120, "label": "a"}) + "\n" for _ in range(90_000))
    path = write(tmp_path / "num.jsonl", head + '{"text": 12345, "label": "a"}\n')
    expected = outcome(old_records, path)
    assert expected.startswith("DataError: ") and "record 90001: 'text' is a int" in expected
    assert outcome(records, path) == expected


def test_a_reader_left_early_removes_its_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = write(tmp_path / "t.txt", "one\ntwo\n")
    reader = records(str(path), "text", None)
    assert next(reader) == ("one", None)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hetseq-datasets-")]
    reader.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hetseq-datasets-")]


def test_fixed_expectations_of_the_tricky_values(tmp_path):
    assert list(records(str(write(tmp_path / "t.txt", TEXT)), "text", None)) == [
        ("\ufefffirst line  ", None),
        ("second\tline", None),
        ("third \u00e9\u4e2d\u2028mid", None),
        ("fourth", None),
        ("  indented  ", None),
        ("last without newline", None),
    ]
    assert list(records(str(write(tmp_path / "t.csv", CSV)), "text", "label")) == [
        ("a, quoted comma", "1"),
        ("embedded\nnewline", "NA"),
        ("crlf\r\ninside", "nan"),
        ("001", "1.50"),
        ("1e5", "-1"),
        (" spaced ", "None"),
        ('say "hi"', "x"),
        ("NULL", "0"),
        ("#hash", "N/A"),
        ("last", "2"),
    ]
    assert [
        label for _, label in records(str(write(tmp_path / "i.jsonl", JSONL_INT)), "text", "label")
    ] == [1, 0, -3, 2]
    mixed = write(
        tmp_path / "mixed.jsonl", '{"text": "a", "label": 1}\n\n{"text": "b", "label": "pos"}\n'
    )
    assert list(records(str(mixed), "text", "label")) == [("a", 1), ("b", "pos")]


def test_an_empty_label_cell_is_refused_and_a_short_row_behaves_as_before(tmp_path):
    # issue 40: an empty cell (the empty string to the csv module) became the class "": it is
    # refused now, naming the record; a row without the cell is refused, naming the record
    empty = write(tmp_path / "e.csv", "text,label\na,1\nb,\nc,2\n")
    msg = outcome(records, empty)
    assert msg == outcome(old_records, empty) and "record 3 has a blank 'label' value" in msg
    short = write(tmp_path / "s.csv", "text,label\na,1\nb\nc,2\n")
    msg = outcome(records, short)
    assert msg == outcome(old_records, short) and "record 3 has no 'label' value" in msg


BLANK_LABELS = [
    ("empty.csv", "text,label\na,1\nb,\nc,2\n", 3),
    ("spaces.csv", 'text,label\na,1\nb,"   "\nc,2\n', 3),
    ("empty.tsv", "text\tlabel\na\t1\nb\t\nc\t2\n", 3),
    ("empty.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": ""}\n', 2),
    ("spaces.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": " \\t "}\n', 2),
    ("empty.parquet", None, 2),
]


@pytest.mark.parametrize("name,content,record", BLANK_LABELS, ids=[b[0] for b in BLANK_LABELS])
def test_a_blank_label_is_refused_in_one_line_by_both_readers(tmp_path, name, content, record):
    """Issue 40: a blank label (empty, or only spaces) became the class "" where the standard
    library read the file (datasets stopped at it): both readers refuse it, naming the
    record, in every format."""
    if content is None:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / name
        pq.write_table(pa.table({"text": ["a", "b"], "label": ["x", ""]}), path)
    else:
        path = write(tmp_path / name, content)
    for reader in (records, hf_records._stdlib_records):
        msg = outcome(reader, path)
        assert isinstance(msg, str), (reader, msg)
        assert f"record {record} has a blank 'label' value" in msg and str(path) in msg


# --- bad input: the same one-line errors -----------------------------------------------------

BAD = [
    ("notjson.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": 2,}\n', "not JSON"),
    ("list.jsonl", '{"text": "a", "label": 1}\n[1, 2]\n', "is a list, not a JSON object"),
    ("array.json", '[{"text": "a", "label": 1}]\n', "is a list"),
    ("bom.jsonl", '\ufeff{"text": "a", "label": 1}\n', "line 1 is not JSON"),
    (
        "two.jsonl",
        '{"text": "a", "label": 1}\n{"text": "b", "label": 1} {"text": "c", "label": 0}\n',
        "line 2 is not JSON (Extra data)",
    ),
    ("int.jsonl", '{"text": "a", "label": 1}\n{"text": 5, "label": 2}\n', "'text' is a int"),
    ("null.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": null}\n', "no 'label'"),
    ("nokey.jsonl", '{"text": "a", "label": 1}\n{"text": "b"}\n', "record 2 has no 'label'"),
    ("ctrl.jsonl", '{"text": "a\tb", "label": 1}\n', "Invalid control character"),
    ("latin1.txt", "caf\u00e9\n".encode("latin-1"), "not UTF-8"),
    ("latin1.jsonl", '{"text": "caf\u00e9", "label": 1}\n'.encode("latin-1"), "not UTF-8"),
    ("latin1.csv", "text,label\ncaf\u00e9,1\n".encode("latin-1"), "not UTF-8"),
    ("late.txt", b"ok\n" * 50 + b"\xff\n", "not UTF-8"),
    ("bomh.csv", "\ufefftext,label\na,1\n", "has no 'text' value"),
    ("dup.csv", "text,label,text\na,1,b\n", None),
    ("quote.csv", 'text,label\n"unterminated,1\nb,2\n', "no 'label' value"),
    ("blank.csv", "label,text\n1,a\n \n2,b\n", "record 3 has no 'text' value"),
    ("gz.txt", b"\x1f\x8b\x08\x00rest", "not UTF-8"),
]


@pytest.mark.parametrize("name,content,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_the_same_one_line_error(tmp_path, name, content, expect):
    path = write(tmp_path / name, content)
    label = None if name.endswith(".txt") else "label"
    new, old = (
        outcome(records, path, label_field=label),
        outcome(old_records, path, label_field=label),
    )
    assert new == old
    if expect is not None:
        assert isinstance(new, str) and expect in new, new


# --- a seeded fuzz: whatever datasets does with odd input, the records are the old ones ------

PIECES = [
    "a",
    "b",
    " ",
    ",",
    '"',
    "\n",
    "\r",
    "\r\n",
    "\t",
    "NA",
    "nan",
    "None",
    "1",
    "-1",
    "1.50",
    "001",
    "#",
    "\u00e9",
    "\x00",
    ";",
    "'",
    "\\",
    "\u2028",
    "\x85",
    "",
    "\n\n",
]


def test_fuzzed_csv_and_tsv_read_as_the_csv_module_reads_them(tmp_path):
    rng = random.Random(1234)
    for case in range(40):
        sep = rng.choice([",", "\t"])
        names = rng.sample(["text", "label", "id", "x"], rng.randint(2, 4))
        if "text" not in names:
            names[0] = "text"
        rows = [names] + [
            ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 4))) for _ in names]
            for _ in range(rng.randint(1, 6))
        ]
        path = tmp_path / f"f{case}.{'tsv' if sep == chr(9) else 'csv'}"
        with open(path, "w", encoding="utf-8", newline="") as fh:
            csv.writer(
                fh,
                delimiter=sep,
                lineterminator=rng.choice(["\n", "\r\n"]),
                quoting=rng.choice([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]),
            ).writerows(rows)
        if rng.random() < 0.3:  # damage it
            text = path.read_text(encoding="utf-8")
            cut = rng.randrange(len(text))
            write(path, text[:cut] + rng.choice(PIECES) + text[cut:])
        label = "label" if "label" in names and rng.random() < 0.7 else None
        assert outcome(records, path, label_field=label) == outcome(
            old_records, path, label_field=label
        ), path.read_bytes()


def test_fuzzed_json_lines_read_as_json_loads_reads_them(tmp_path):
    rng = random.Random(99)
    values = [1, 0, -2, 7, "pos", "1", " x ", "", True, None, 2.5, [1], {"a": 1}]
    for case in range(40):
        lines = []
        for _ in range(rng.randint(1, 6)):
            obj = {"text": rng.choice(["t", "t\u00e9\n", " ", "001"] + [5] * (rng.random() < 0.1))}
            if rng.random() < 0.9:
                obj["label"] = rng.choice(values[:4] if case % 2 else values[4:8])
                if rng.random() < 0.1:
                    obj["label"] = rng.choice(values)
            lines.append(json.dumps(obj, ensure_ascii=rng.random() < 0.5))
            lines += [""] * (rng.random() < 0.2)
        text = rng.choice(["\n", "\r\n"]).join(lines)
        if rng.random() < 0.2:
            cut = rng.randrange(len(text))
            text = text[:cut] + rng.choice(["}", "{", ",", " ", "\n", '"']) + text[cut:]
        path = write(tmp_path / f"f{case}.jsonl", text)
        assert outcome(records, path) == outcome(old_records, path), text


# --- offline, nothing cached, imported lazily, one line when missing --------------------------


def test_without_datasets_one_line_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    path = write(tmp_path / "t.txt", "one\ntwo\n")
    with pytest.raises(DataError) as info:
        list(records(str(path), "text", None))
    msg = str(info.value)
    assert "\n" not in msg and "pip install 'hetseq-hpc[hf]'" in msg and "datasets" in msg
