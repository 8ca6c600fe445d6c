#!/usr/bin/env python3
"""What HetSeq's BERT data path costs per sample on a CPU (docs/planner-accuracy.md, HetSeq).

Writes one HDF5 shard in NVIDIA's layout per ``--samples-per-shard`` size and times, per
sample, HetSeq's access pattern (the file opened for every sample) against the same reads with
the file kept open. Needs ``h5py`` and ``numpy`` in the venv; nothing is downloaded; about
1.5 minutes. Why HetSeq's path is slow and what is printed:
docs/design/hetseq-comparison.md, "What HetSeq's data path costs per sample".

    .venv/bin/python scripts/bench_hetseq_data_path.py --samples-per-shard 20000 100000 400000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prepare import cpu_name  # the scripts folder is not a package

KEYS = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
SEQ_LEN, MAX_PRED, VOCAB = 128, 20, 30522
#: samples/s per TITAN Xp: HetSeq's 1-node step (128 per GPU in 2.60 s) and the spec model's
RATES = {"hetseq_published": 128 / 2.60, "spec_model": 77.0}


def write_shard(path: Path, samples: int, seed: int = 0) -> dict:
    """One shard in NVIDIA's phase-1 layout (six gzip datasets, h5py's automatic chunks);
    returns ``{dataset: chunk shape}``."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(samples, SEQ_LEN)), VOCAB - 1).astype("i4")
    mask = np.ones((samples, SEQ_LEN), "i1")
    seg = np.zeros((samples, SEQ_LEN), "i1")
    seg[:, SEQ_LEN // 2 :] = 1
    for i in np.nonzero(rng.random(samples) < 0.1)[0]:  # short sequences, zero-padded
        cut = int(rng.integers(10, SEQ_LEN))
        ids[i, cut:], mask[i, cut:], seg[i, cut:] = 0, 0, 0
    pos = np.sort(rng.integers(1, SEQ_LEN - 1, size=(samples, MAX_PRED)), axis=1).astype("i4")
    data = {
        "input_ids": (ids, "i4"),
        "input_mask": (mask, "i1"),
        "segment_ids": (seg, "i1"),
        "masked_lm_positions": (pos, "i4"),
        "masked_lm_ids": (rng.integers(0, VOCAB, size=(samples, MAX_PRED)), "i4"),
        "next_sentence_labels": (rng.integers(0, 2, size=samples), "i1"),
    }
    with h5py.File(path, "w") as f:
        for key in KEYS:
            values, dtype = data[key]
            f.create_dataset(key, data=values, dtype=dtype, compression="gzip")
        return {key: f[key].chunks for key in KEYS}


def hetseq_getitem(path: Path, index: int):
    """HetSeq's ``BertH5pyData.__getitem__`` access pattern: open, six row reads, labels."""
    import h5py
    import numpy as np
    import torch

    with h5py.File(path, "r", libver="latest", swmr=True) as data_file:
        rows = [
            torch.from_numpy(np.asarray(data_file[key][index]).astype(np.int64)) for key in KEYS
        ]
    labels = torch.full(rows[0].shape, -1, dtype=torch.long)
    padded = (rows[3] == 0).nonzero()
    n = int(padded[0].item()) if len(padded) else MAX_PRED
    labels[rows[3][:n]] = rows[4][:n]
    return [*rows[:3], labels, rows[5]]


def time_hetseq(path: Path, indices) -> float:
    """Seconds per sample of :func:`hetseq_getitem` over ``indices``."""
    start = time.perf_counter()
    for i in indices:
        hetseq_getitem(path, int(i))
    return (time.perf_counter() - start) / len(indices)


def time_kept_open(path: Path, indices) -> float:
    """Seconds per sample of the same six row reads with the file open throughout."""
    import h5py

    start = time.perf_counter()
    with h5py.File(path, "r") as f:
        datasets = [f[key] for key in KEYS]
        for i in indices:
            for d in datasets:
                d[int(i)]
    return (time.perf_counter() - start) / len(indices)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples-per-shard", type=int, nargs="+", default=[20_000, 100_000, 400_000]
    )
    parser.add_argument("--reads", type=int, default=300, help="random samples per timing")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    try:
        import h5py
        import numpy as np
    except ImportError as exc:
        print(
            f"bench_hetseq_data_path: {exc.name} is missing: pip install h5py (it is not a "
            "dependency of hetseq_hpc)",
            file=sys.stderr,
        )
        return 2
    print(f"machine: {cpu_name()}, {platform.python_version()}, h5py {h5py.__version__}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="hetseq-h5-") as tmp:
        rng = np.random.default_rng(1)
        for samples in args.samples_per_shard:
            path = Path(tmp) / f"shard_{samples}.hdf5"
            chunks = write_shard(path, samples)
            print(
                f"shard of {samples} samples: {path.stat().st_size / 1e6:.1f} MB, chunks "
                + ", ".join(f"{k} {c}" for k, c in chunks.items())
            )
            hetseq, kept = [], []
            warm = rng.integers(0, samples, size=5)  # imports, first open: not timed
            time_hetseq(path, warm), time_kept_open(path, warm)
            for _ in range(args.reps):  # interleaved: a drifting machine moves both alike
                indices = rng.integers(0, samples, size=args.reads)
                hetseq.append(time_hetseq(path, indices))
                kept.append(time_kept_open(path, indices))
            ms = statistics.median(hetseq) * 1e3
            results[samples] = {
                "hetseq_ms_per_sample": round(ms, 2),
                "kept_open_ms_per_sample": round(statistics.median(kept) * 1e3, 2),
                "reps_hetseq_ms": [round(t * 1e3, 2) for t in hetseq],
                "cores_per_gpu": {name: round(rate * ms / 1e3, 2) for name, rate in RATES.items()},
            }
            r = results[samples]
            print(
                f"  HetSeq's pattern {ms:.2f} ms/sample (reps {r['reps_hetseq_ms']}), file kept "
                f"open {r['kept_open_ms_per_sample']:.2f} ms; CPU cores per GPU kept busy by "
                f"the data path: {r['cores_per_gpu']['hetseq_published']:.2f} at HetSeq's 49 "
                f"samples/s, {r['cores_per_gpu']['spec_model']:.2f} at the spec model's 77"
            )
    print(json.dumps({"machine": cpu_name(), "shards": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
