"""Benchmark the JSON-lines reader of ``task=hf`` (not a test): records per second of
:func:`hetseq_hpc.tasks.hf.records.records` (``datasets``' ``text`` builder, each line
decoded by ``json.loads``) against the standard-library reader it must equal
(``_stdlib_records``), on a corpus of real text built offline.

The corpus: JSON lines ``{"text": ..., "label": 0..4}`` whose texts are 20-300 words drawn
(seeded) from CPython's own ``pydoc_data.topics``, until the file reaches ``--corpus-mb``.
The two readers run ``--repeats`` times each, interleaved, after one untimed warm-up of each
(``datasets``' import and first builder), and the script prints every time, the median MB/s of
each and their ratio (a ratio inside one run holds across machines where an absolute figure
does not), with the machine. The last line is JSON::

    {"corpus_mb": ..., "records": ..., "datasets_mb_per_s": ..., "stdlib_mb_per_s": ...,
     "ratio": ..., "cpu": ...}

Usage: ``python scripts/bench_json_reader.py [--corpus-mb 100] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prepare import cpu_name  # the scripts folder is not a package

from hetseq_hpc.tasks.hf import records as hf_records


def build_corpus(path: Path, target_mb: float) -> None:
    """Write JSON lines of real words until ``path`` holds ``target_mb`` MB."""
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fh:
        while fh.tell() < target_mb * 1e6:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))
            fh.write(json.dumps({"text": text, "label": rng.randint(0, 4)}) + "\n")


def timed(reader, path: str) -> tuple:
    """(seconds, records) of one full read."""
    start = time.perf_counter()
    count = sum(1 for _ in reader(path, "text", "label"))
    return time.perf_counter() - start, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    readers = {"datasets": hf_records.records, "stdlib": hf_records._stdlib_records}
    with tempfile.TemporaryDirectory(prefix="bench-json-") as tmp:
        path = Path(tmp) / "corpus.jsonl"
        build_corpus(path, args.corpus_mb)
        mb = path.stat().st_size / 1e6
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores; corpus {mb:.1f} MB")
        counts = {name: timed(reader, str(path))[1] for name, reader in readers.items()}
        if len(set(counts.values())) != 1:
            print(f"the readers disagree on the record count: {counts}", file=sys.stderr)
            return 1
        rates = {name: [] for name in readers}
        for rep in range(args.repeats):
            for name, reader in readers.items():
                seconds, _ = timed(reader, str(path))
                rates[name].append(mb / seconds)
                print(
                    f"  {rep + 1}  {name:8s} {seconds:6.2f} s  {mb / seconds:7.1f} MB/s", flush=True
                )
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["datasets"] / median["stdlib"]
    print(
        f"median: datasets {median['datasets']:.1f} MB/s, stdlib {median['stdlib']:.1f} MB/s, "
        f"ratio {ratio:.2f}"
    )
    print(
        json.dumps(
            {
                "corpus_mb": round(mb, 1),
                "records": counts["datasets"],
                "datasets_mb_per_s": round(median["datasets"], 1),
                "stdlib_mb_per_s": round(median["stdlib"], 1),
                "ratio": round(ratio, 3),
                "cpu": cpu_name(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
