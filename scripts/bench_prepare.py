"""Benchmark ``hetseq-hpc prepare`` on a corpus of real text built offline (not a test).

Builds a corpus from CPython's ``pydoc_data.topics`` (shuffled copies) of ``--corpus-mb`` MB,
runs ``hetseq-hpc prepare`` on it in a child process with a fresh cache, and reports wall time,
MB/s, cores used and peak RSS; the last line is JSON. ``--task hf --tokenizer wordpiece|bpe``
measures ``task=hf``; ``--plain`` the path without the word cache. The corpus, the JSON keys and
each mode: docs/benchmarks.md, "How the scripts measure".

Usage: ``python scripts/bench_prepare.py --corpus-mb 1024 [--keep DIR] [--plain]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_corpus(path: Path, target_mb: float) -> int:
    """Write the shuffled-copies corpus to ``path``; returns its size in bytes."""
    from pydoc_data import topics

    paragraphs = [
        p.strip() for text in topics.topics.values() for p in text.split("\n\n") if p.strip()
    ]
    target = int(target_mb * 1e6)
    written = 0
    copy = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            order = list(paragraphs)
            random.Random(copy).shuffle(order)
            for paragraph in order:
                block = f"[{copy}] {paragraph}\n\n"
                fh.write(block)
                written += len(block.encode("utf-8"))
                if written >= target:
                    break
            copy += 1
    return path.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus-mb",
        type=float,
        default=1024.0,
        help="corpus size in MB (10^6 bytes); default 1024",
    )
    parser.add_argument("--seq-len", type=int, default=128, help="task.model.max_seq_len")
    parser.add_argument("--keep", help="build in this folder and keep it (default: a temp dir)")
    parser.add_argument(
        "--task",
        choices=["bert", "hf"],
        default="bert",
        help="bert (trains its own tokenizer) or hf (a given tokenizer)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=["wordpiece", "bpe"],
        default="wordpiece",
        help="--task hf: BERT WordPiece or byte-level BPE",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="the plain tokenizer path (HETSEQ_PREPARE_FAST=0), not the word "
        "cache; to compare the two on the same machine",
    )
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-prepare-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return run(root, args.corpus_mb, args.seq_len, args.task, args.tokenizer, args.plain)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (the machine the figures belong to)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def hf_model_dir(root: Path, corpus: Path, kind: str) -> Path:
    """A 30k-token tokenizer trained on the first 20 MB of ``corpus`` plus a config (no
    weights), saved for ``task.model.config``/``task.model.tokenizer``."""
    from itertools import islice

    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import BertConfig, GPT2Config, PreTrainedTokenizerFast

    with open(corpus, encoding="utf-8") as fh:
        sample = list(islice(fh, 200_000))
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(
            sample,
            trainers.WordPieceTrainer(
                vocab_size=30000,
                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                show_progress=False,
            ),
        )
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="[PAD]",
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
        config = BertConfig(vocab_size=len(fast), architectures=["BertForMaskedLM"])
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(
            sample,
            trainers.BpeTrainer(
                vocab_size=30000,
                special_tokens=["<|endoftext|>"],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            ),
        )
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        config = GPT2Config(vocab_size=len(fast), architectures=["GPT2LMHeadModel"])
    model = root / f"model-{kind}"
    fast.save_pretrained(model)
    config.save_pretrained(model)
    return model


def run(
    root: Path,
    corpus_mb: float,
    seq_len: int,
    task: str = "bert",
    tokenizer: str = "wordpiece",
    plain: bool = False,
) -> int:
    """Build the corpus in ``root`` (reused from an earlier ``--keep`` run of the same size),
    prepare it with a fresh cache, print the figures."""
    corpus = root / f"corpus-{corpus_mb:g}.txt"
    started = time.monotonic()
    size = corpus.stat().st_size if corpus.is_file() else build_corpus(corpus, corpus_mb)
    print(
        f"corpus: {corpus} {size / 1e6:.1f} MB (built in {time.monotonic() - started:.0f} s)",
        flush=True,
    )
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, HETSEQ_CACHE=str(cache))
    if plain:
        env["HETSEQ_PREPARE_FAST"] = "0"
    cmd = [
        sys.executable,
        "-m",
        "hetseq_hpc",
        "prepare",
        "task=bert",
        f"task.data.files=[{corpus}]",
        f"task.model.max_seq_len={seq_len}",
    ]
    if task == "hf":
        model = root / f"model-{tokenizer}"
        if not (model / "config.json").is_file():
            model = hf_model_dir(root, corpus, tokenizer)
        cmd[4] = "task=hf"
        cmd += [f"task.model.config={model}", f"task.model.tokenizer={model}"]
    load = round(os.getloadavg()[0], 2)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(f"prepare failed with exit code {proc.returncode}", file=sys.stderr)
        return 1
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    metas = list(cache.glob("*/meta.json"))
    meta = json.loads(metas[0].read_text()) if metas else {}
    result = {
        "corpus_mb": round(size / 1e6, 1),
        "seconds": round(wall, 1),
        "mb_per_s": round(size / 1e6 / wall, 2),
        "cores": round(cpu / wall, 2),
        "cores_available": len(os.sched_getaffinity(0)),
        # ru_maxrss is in KiB on Linux: the peak of the largest child (and self below)
        "peak_rss_mb": round(
            max(after.ru_maxrss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024, 1
        ),
        "rows": meta.get("rows"),
        "vocab_size": meta.get("vocab_size"),
        "task": task,
        "cpu": cpu_name(),
        "path": "plain" if plain else "word cache",
        "load": load,
    }
    if task == "hf":
        result.update(
            tokenizer=tokenizer,
            tokens=meta.get("tokens"),
            tokens_per_s=round(meta.get("tokens", 0) / wall),
            tokens_per_s_per_core=round(meta.get("tokens", 0) / max(cpu, 1e-9)),
            mb_per_s_per_core=round(size / 1e6 / max(cpu, 1e-9), 2),
        )
    print(
        f"prepared {result['corpus_mb']} MB in {wall:.0f} s: {result['mb_per_s']} MB/s on "
        f"{result['cores']} of {result['cores_available']} cores, peak RSS "
        f"{result['peak_rss_mb']} MB ({result['cpu']})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
