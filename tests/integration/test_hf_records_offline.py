"""task=hf's record reader in a fresh process: offline, nothing written under HOME (moved from
tests/unit/test_hf_records.py: it starts a process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("datasets")


def write(path: Path, content, encoding="utf-8") -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        with open(path, "w", encoding=encoding, newline="") as fh:
            fh.write(content)
    return path


@pytest.mark.parametrize("datasets_first", [False, True])
def test_reader_stays_offline_and_writes_nothing_under_home(tmp_path, datasets_first):
    """In a fresh process with an empty HOME: no connection is tried (not even the Hub's
    download count, which datasets asks for when it was imported before the offline variables
    were set), nothing lands under HOME (no ~/.cache, Arrow cache or lock file), and the
    temporary folder of the builder is gone."""
    home = tmp_path / "home"
    home.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    write(data / "t.txt", "one\n\ntwo\n")
    write(data / "t.jsonl", '{"text": "one", "label": 1}\n{"text": "two", "label": 0}\n')
    write(data / "t.csv", "text,label\none,1\ntwo,0\n")
    write(data / "t.tsv", "text\tlabel\none\t1\ntwo\t0\n")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pytest.importorskip("pyarrow").table({"text": ["one", "two"], "label": [1, 0]}),
        data / "t.parquet",
    )
    script = textwrap.dedent(f"""
        import socket, sys
        tried = []
        def refuse(*args, **kwargs):
            tried.append(args[:2])
            raise OSError("no network in this test")
        socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse
        if {datasets_first!r}:
            import datasets  # before the offline variables: its config reads them now
        from hetseq_hpc.tasks.hf.records import records
        assert ("datasets" in sys.modules) == {datasets_first!r}  # imported lazily
        for name in ("t.txt", "t.jsonl", "t.csv", "t.tsv", "t.parquet"):
            label = None if name.endswith(".txt") else "label"
            got = [t for t, _ in records({str(data)!r} + "/" + name, "text", label)]
            assert got == ["one", "two"], (name, got)
        assert "datasets" in sys.modules and not tried, tried
        print("ok")
        """)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "XDG_", "HUGGINGFACE")) and k != "TMPDIR"
    }
    env.update(HOME=str(home), TMPDIR=str(tmp_path))
    if not datasets_first:
        env.update(HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert list(home.rglob("*")) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hetseq-datasets-")]
