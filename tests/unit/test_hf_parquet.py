"""``task=hf`` on Parquet files (read through ``datasets``; pyarrow for the footer checks):
records streamed by record batches over several row groups in file order, only the wanted
columns read, the one-line refusals (missing column, 0 rows, not Parquet, null / non-text
values, pyarrow not installed), the cache key following the file, and the same token cache as
the same records given as JSON lines."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hetseq_hpc.cli.preflight import check_task_code
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config.hf_tasks import check_data_file
from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.hf import parquet as hf_parquet
from hetseq_hpc.tasks.hf.records import check_columns, columns, records
from hetseq_hpc.tasks.hf.token_cache import hf_cache_key
from tests.helpers.hf_models import jsonl_to_parquet, make_bert, write_text_files


def write(path, row_group_size=None, **cols):
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return str(path)


def one_line(exc_type, fn, *args) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_records_stream_by_batches_over_row_groups_in_file_order(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    texts = [f"text number {i}" for i in range(50)]
    labels = [i % 3 for i in range(50)]
    path = write(
        tmp_path / "d.parquet",
        row_group_size=7,
        label=labels,
        text=texts,
        other=[float(i) for i in range(50)],
    )
    assert pq.ParquetFile(path).metadata.num_row_groups == 8
    assert columns(path) == ["label", "text", "other"]
    seen, asked = [], []
    load, iterate = datasets.load_dataset, datasets.IterableDataset.iter

    def load_spy(*args, **kwargs):
        asked.append(
            (args[0], kwargs.get("columns"), kwargs.get("batch_size"), kwargs.get("streaming"))
        )
        return load(*args, **kwargs)

    def iter_spy(self, *args, **kwargs):
        for table in iterate(self, *args, **kwargs):
            seen.append((table.num_rows, set(table.column_names)))
            yield table

    monkeypatch.setattr(datasets, "load_dataset", load_spy)
    monkeypatch.setattr(datasets.IterableDataset, "iter", iter_spy)
    monkeypatch.setattr(hf_parquet, "BATCH_ROWS", 3)
    assert list(records(path, "text", "label")) == list(zip(texts, labels))
    # read by datasets (streaming), only the wanted columns, 3 rows at a time
    assert asked == [("parquet", ["text", "label"], 3, True)]
    assert len(seen) >= 17 and all(rows <= 3 for rows, _ in seen)
    assert all(names == {"text", "label"} for _, names in seen)  # "other" is never read
    assert list(records(path, "text", None)) == [(t, None) for t in texts]


def test_missing_column_names_the_column_the_file_and_the_columns_found(tmp_path):
    path = write(tmp_path / "d.parquet", sentence=["a", "b"], label=[0, 1])
    msg = one_line(DataError, check_columns, [path], [("text", "task.data.text_field")])
    assert "no column 'text'" in msg and path in msg and "'sentence', 'label'" in msg
    assert "task.data.text_field" in msg
    msg = one_line(DataError, lambda: list(records(path, "sentence", "stars")))
    assert "no column 'stars'" in msg and path in msg and "'sentence', 'label'" in msg


def test_empty_and_broken_files_are_one_line(tmp_path):
    empty = write(tmp_path / "empty.parquet", text=pa.array([], pa.string()))
    assert os.path.getsize(empty) > 0 and check_data_file(empty) == empty
    msg = one_line(DataError, check_columns, [empty], [("text", "task.data.text_field")])
    assert "holds no records" in msg and empty in msg
    assert "holds no records" in one_line(DataError, lambda: list(records(empty, "text", None)))
    broken = tmp_path / "broken.parquet"
    broken.write_text("text,label\nhello,1\n")
    msg = one_line(DataError, columns, str(broken))
    assert "not a readable Parquet file" in msg and str(broken) in msg


def test_null_and_non_text_values_name_the_record(tmp_path):
    path = write(tmp_path / "n.parquet", text=["a", None, "c"], label=[0, 1, 0])
    msg = one_line(DataError, lambda: list(records(path, "text", "label")))
    assert "record 2 has no 'text' value" in msg
    path = write(tmp_path / "i.parquet", text=[1, 2], label=[0, 1])
    assert "'text' is a int, not text" in one_line(
        DataError, lambda: list(records(path, "text", None))
    )


def test_without_pyarrow_one_line_says_how_to_install_it(tmp_path, monkeypatch):
    path = write(tmp_path / "d.parquet", text=["a", "b"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a)
    )
    msg = one_line(ConfigError, check_data_file, path)
    assert "needs pyarrow" in msg and "pip install 'hetseq-hpc[parquet]'" in msg
    assert "JSON lines" in msg
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    msg = one_line(DataError, columns, path)
    assert "needs pyarrow" in msg and "pip install 'hetseq-hpc[parquet]'" in msg


def test_cache_key_changes_when_the_parquet_file_changes(tmp_path):
    path = write(tmp_path / "d.parquet", text=["one", "two"], label=[0, 1])
    cfg = SimpleNamespace(files=[path], pack=False, text_field="text", label_field="label")
    before = hf_cache_key(cfg, "{}", "classification", 16)
    assert hf_cache_key(cfg, "{}", "classification", 16) == before
    write(tmp_path / "d.parquet", text=["one", "two", "three"], label=[0, 1, 1])
    assert hf_cache_key(cfg, "{}", "classification", 16) != before


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfpq")
    files = write_text_files(root)
    parquet = jsonl_to_parquet(files["jsonl"], root / "labelled.parquet", row_group_size=64)
    return {
        "root": root,
        "jsonl": files["jsonl"],
        "parquet": parquet,
        "cls": make_bert(root / "cls", "classification"),
    }


def classification_task(made, data: str, *extra: str):
    run = compose_run_config(
        [
            "task=hf",
            f"task.model.path={made['cls']}",
            f"task.data.files=[{made[data]}]",
            "task.model.max_seq_len=32",
            f"task.data.cache_dir={made['root'] / 'cache'}",
            *extra,
        ]
    )
    check_task_code(run)
    return run


def test_preflight_refuses_a_missing_parquet_column_in_one_line(made):
    with pytest.raises(DataError) as info:
        classification_task(made, "parquet", "task.data.label_field=stars")
    msg = str(info.value)
    assert "\n" not in msg and "'stars'" in msg and "'text', 'label'" in msg
    assert str(made["parquet"]) in msg


def test_parquet_gives_the_same_token_cache_as_json_lines(made):
    tasks = {}
    for data in ("jsonl", "parquet"):
        task = build_task(classification_task(made, data).task, 0)
        task.prepare()
        task.load()
        tasks[data] = task
    a, b = tasks["jsonl"], tasks["parquet"]
    assert a.meta["label_names"] == b.meta["label_names"] == ["0", "1"]
    assert a.meta["rows"] == b.meta["rows"] == 400
    for name in ("tokens", "lengths", "labels"):
        assert np.array_equal(a._arrays[name], b._arrays[name]), name
