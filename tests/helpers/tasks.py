"""The image, translation and example custom tasks (examples/char_lm.py, examples/hetseq_bert.py)
with tiny models and tiny real data, as the exactness and Slurm task tests run them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: the metric each task logs at validation
METRIC = {
    "image": "val_accuracy",
    "translation": "val_bleu",
    "custom": "val_bits_per_char",
    "hetseq_bert": "val_ppl",
}
#: the name summary.json gives each task: a custom task's own ``name`` class attribute
SUMMARY_NAME = {
    "image": "image",
    "translation": "translation",
    "custom": "char_lm",
    "hetseq_bert": "hetseq_bert",
}


def write_task_data(root: Path) -> dict:
    """Tiny real data sets: scikit-learn's digits as an .npz, and 400 German-English pairs of
    the Django catalogs (a dependency of hetseq_hpc) as a TSV."""
    from sklearn.datasets import load_digits

    from hetseq_hpc.tasks.translation.parallel_corpus import read_mo, site_package_catalogs

    digits = load_digits()
    np.savez(
        root / "digits.npz",
        images=(digits.images * 16).clip(0, 255).astype(np.uint8),
        labels=digits.target,
    )
    pairs = sorted(
        {
            p
            for f in site_package_catalogs()
            if "django" in str(f)
            for p in read_mo(f)
            if 0 < len(p[0]) <= 60 and 0 < len(p[1]) <= 60 and p[0] != p[1]
        }
    )[:400]
    assert len(pairs) == 400, "Django's German catalogs should give 400 short pairs"
    (root / "pairs.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in pairs), encoding="utf-8")
    return {"npz": root / "digits.npz", "tsv": root / "pairs.tsv"}


def task_overrides(name: str, files: dict) -> list:
    """Tiny models of each task (seconds per run on 2 cores)."""
    if name == "image":
        return [
            "task=image",
            f"task.data.path={files['npz']}",
            "task.model.width=8",
            "task.model.num_stages=2",
            "task.model.groups=4",
            "task.data.max_val_samples=64",
        ]
    if name == "translation":
        return [
            "task=translation",
            f"task.data.files=[{files['tsv']}]",
            "task.model.d_model=32",
            "task.model.num_encoder_layers=1",
            "task.model.num_decoder_layers=1",
            "task.model.num_heads=2",
            "task.model.ff_size=64",
            "task.model.max_len=24",
            "task.data.vocab_size=400",
            "task.data.max_val_samples=32",
            "task.data.bleu_samples=8",
        ]
    if name == "hetseq_bert":  # HetSeq's own BERT code (Python LayerNorm, head on every token)
        return [
            "task=custom",
            "task.target=examples.hetseq_bert.HetSeqBertTask",
            "+task.args.hidden_size=32",
            "+task.args.num_layers=1",
            "+task.args.num_heads=2",
            "+task.args.intermediate_size=64",
            "+task.args.max_seq_len=32",
            "+task.args.vocab_size=1000",
            "+task.args.data_vocab_size=1000",
        ]
    return [
        "task=custom",
        "task.target=examples.char_lm.CharLMTask",
        "+task.args.seq_len=32",
        "+task.args.hidden=32",
    ]
