"""The data-preparation path in-process (issue 26): the wait for rank 0's heartbeat on a fake
clock (a silent heartbeat fails after the timeout, a live one is waited for past it), long
blocks and lines cut in bounded memory with the tokens of the whole, OS errors of a prepare as
one line. (Real runs and `hetseq-hpc prepare`: tests/integration/test_prepare_safety_runs.py.)
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from hetseq_hpc.errors import DataError
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import prepare_wait
from hetseq_hpc.tasks.bert import mlm_data as data_mod
from hetseq_hpc.tasks.bert import text_corpus as corpus_mod
from hetseq_hpc.tasks.bert.mlm_data import SEP_ID, build_packed_text, load_packed_text
from hetseq_hpc.tasks.bert.text_corpus import load_corpus
from hetseq_hpc.tasks.bert.tokenizer import load_tokenizer
from hetseq_hpc.tasks.prepare_errors import prepare_task
from tests.helpers.clock import FakeClock

# ----------------------------------------------------------------------- heartbeat, in-process


def test_a_silent_heartbeat_fails_the_wait_after_the_timeout(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    beat = RunDir(tmp_path).prepare_heartbeat("t")
    beat.write_text("1\n")
    clock = FakeClock()
    with pytest.raises(DataError) as info:
        prepare_wait.wait_for_rank0(
            RunDir(tmp_path), "t", 30, poll_s=0.5, clock=clock, sleep=clock.sleep
        )
    message = str(info.value)
    assert "rank 0 sent no heartbeat for 30 s while preparing the data" in message
    assert "rank0.log" in message and "hetseq-hpc prepare" in message and "\n" not in message
    assert 30 < clock.now - 1000.0 <= 31  # gave up one poll after the timeout, not later


def test_a_live_heartbeat_is_waited_for_past_the_timeout(tmp_path):
    (tmp_path / "logs").mkdir()
    marker, beat = RunDir(tmp_path).prepared_marker("t"), RunDir(tmp_path).prepare_heartbeat("t")
    heart = prepare_wait.Heartbeat(beat, 1.0)
    heart.path.parent.mkdir(exist_ok=True)
    clock = FakeClock()

    def sleep(seconds: float) -> None:  # rank 0 beats every 5 fake seconds, done after 100
        clock.sleep(seconds)
        if clock.now % 5 == 0:
            heart.beat()
        if clock.now - 1000.0 >= 100:
            marker.write_text(json.dumps({"ok": True}))

    prepare_wait.wait_for_rank0(RunDir(tmp_path), "t", 10, poll_s=0.5, clock=clock, sleep=sleep)
    assert clock.now - 1000.0 >= 100


def test_a_quick_rank_0_is_seen_within_a_fraction_of_a_poll(tmp_path):
    """Rank 0 done after 0.1 s (a prepared cache): the others see its marker after 0.125 s,
    not a whole 0.5 s poll; the ramp of looks adds up to one poll, then whole polls."""
    (tmp_path / "logs").mkdir()
    marker = RunDir(tmp_path).prepared_marker("t")
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now - 1000.0 >= 0.1:
            marker.write_text(json.dumps({"ok": True}))

    prepare_wait.wait_for_rank0(RunDir(tmp_path), "t", 10, poll_s=0.5, clock=clock, sleep=sleep)
    assert clock.slept == [0.0625, 0.0625]
    marker.unlink()
    slow = FakeClock()
    with pytest.raises(DataError):  # no heartbeat at all: the looks after the ramp are whole
        prepare_wait.wait_for_rank0(
            RunDir(tmp_path), "t", 2, poll_s=0.5, clock=slow, sleep=slow.sleep
        )
    assert slow.slept[:6] == [0.0625, 0.0625, 0.125, 0.25, 0.5, 0.5]


def test_the_heartbeat_thread_beats_until_the_block_ends(tmp_path):
    path = tmp_path / "logs" / "hb"
    seen, three = [], threading.Event()

    class Counting(prepare_wait.Heartbeat):
        def beat(self) -> None:  # the thread's own beats, each read back as it lands
            super().beat()
            seen.append(self.path.read_text())
            if self.beats >= 3:
                three.set()

    with Counting(path, 0.02) as heart:
        assert three.wait(60), "the heartbeat thread stopped beating"  # a guard against hangs
        assert len(set(seen)) >= 3 and heart.beats >= 3
    assert not path.exists()
    assert prepare_wait.beat_interval(300) == 5.0 and prepare_wait.beat_interval(10) == 2.5


# ----------------------------------------------------------------------- memory and tokens


def test_long_blocks_are_cut_at_whitespace_with_the_tokens_of_the_whole(tmp_path, monkeypatch):
    """Pieces of at most MAX_PIECE_CHARS characters, cut at whitespace, packed with one [SEP]
    per document: the rows are exactly those of encoding every whole block."""
    monkeypatch.setattr(corpus_mod, "READ_CHUNK_BYTES", 257)
    monkeypatch.setattr(corpus_mod, "MAX_PIECE_CHARS", 100)
    monkeypatch.setattr(data_mod, "ROWS_PER_WRITE", 3)
    monkeypatch.setattr(data_mod, "ENCODE_BATCH_CHARS", 300)
    from pydoc_data import topics

    words = [w for w in " ".join(sorted(topics.topics.values())).split() if len(w) < 40][:6000]
    text = (
        " ".join(words[:3000])
        + "\n\n"
        + "\t".join(words[3000:3400])
        + "\n \n\n"
        + "\n".join(words[3400:6000])
        + "  \n\n\n\n end of the file "
    )
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus([str(path)])
    segments = list(corpus.segments())
    assert max(len(t) for t, _ in segments) <= 100 and len(segments) > 300
    assert sum(end for _, end in segments) == 4  # one end per non-empty block
    directory = build_packed_text(corpus, 2000, 16, tmp_path / "cache")
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    stream = []
    for block in text.split("\n\n"):
        ids = tokenizer.encode(block.strip(), add_special_tokens=False).ids
        if ids:
            stream += [*ids, SEP_ID]
    body = np.asarray(stream[: len(stream) // 14 * 14], dtype=np.int32).reshape(-1, 14)
    assert np.array_equal(np.asarray(load_packed_text(directory, 0.1).tokens[:, 1:-1]), body)


def test_a_block_without_whitespace_is_cut_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "READ_CHUNK_BYTES", 64)
    monkeypatch.setattr(corpus_mod, "MAX_PIECE_CHARS", 100)
    path = tmp_path / "word.txt"
    path.write_text("x" * 250 + "\n\nshort", encoding="utf-8")
    assert [(len(t), end) for t, end in load_corpus([str(path)]).segments()] == [
        (100, False),
        (100, False),
        (50, True),
        (5, True),
    ]


def test_translation_lines_are_those_of_splitlines_whatever_the_chunks(tmp_path, monkeypatch):
    from hetseq_hpc.tasks.translation import parallel_corpus as tcorpus

    text = "a\tb\r\n\r\nc\rd\x0be\u2028ü\tx" + "long" * 10 + "\r\n\nend\r"
    path = tmp_path / "pairs.tsv"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(tcorpus, "MAX_LINE_CHARS", 30)
    want = [line if len(line) <= 30 else "" for line in text.splitlines()]
    for chunk in (1, 2, 3, 7, 1 << 20):
        monkeypatch.setattr(tcorpus, "READ_CHUNK_BYTES", chunk)
        assert tcorpus._read_lines(path) == want, chunk


def test_translation_reads_a_file_without_newline_in_bounded_memory(tmp_path, monkeypatch):
    """An 8 MB line is skipped while it is read (the old reader held it three times over)."""
    import tracemalloc

    from hetseq_hpc.tasks.translation import parallel_corpus as tcorpus

    monkeypatch.setattr(tcorpus, "READ_CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(tcorpus, "MAX_LINE_CHARS", 1 << 16)
    path = tmp_path / "one-line.tsv"
    with open(path, "wb") as fh:
        fh.write(b"Hallo Welt.\tHello world.\r\n")
        for _ in range(128):
            fh.write(b"wort\tword " * 6000)
        fh.write(b"\r\nGuten Tag.\tGood day.")
    tracemalloc.start()
    try:
        lines = tcorpus._read_lines(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines == ["Hallo Welt.\tHello world.", "", "Guten Tag.\tGood day."]
    assert peak < 2_000_000, peak
    assert tcorpus.read_tsv(path) == [("Hallo Welt.", "Hello world."), ("Guten Tag.", "Good day.")]


def test_prepare_task_turns_os_errors_into_one_line(tmp_path):
    class Task:
        directory = tmp_path / "cache"

        def prepare(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(
        DataError,
        match=r"^no space left on /\S* while preparing the data "
        r"\(writing '.*cache'",
    ):
        prepare_task(Task())
