"""task=translation on tiny real files: a 10-line German<TAB>English TSV (and .de/.en pairs).

Checks the task contract: fixed-width batches that depend only on the position (identical
across calls and across any cut of the positions), the target-token count known before the
forward pass, a loss that is a 0-dim SUM over target tokens (a batch's loss equals the sum over
its halves), learning, greedy decoding, BLEU statistics that add up across batches, the readers
of the built-in formats, and the errors for bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.config.tasks import (
    TranslationDataConfig,
    TranslationModelConfig,
    TranslationTaskConfig,
)
from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.translation.parallel_corpus import (
    SYSTEM_LOCALE,
    read_ding,
    read_mo,
    resolve_sources,
)
from hetseq_hpc.tasks.translation.parallel_data import EOS_ID, PAD_ID
from hetseq_hpc.tasks.translation.seq2seq_task import TranslationTask, bleu_from_stats, bleu_stats
from tests.helpers.task_contract import (
    assert_model_contract,
    assert_split_invariant,
    fit,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [
    ("Das Haus ist groß.", "The house is big."),
    ("Der Hund schläft im Garten.", "The dog sleeps in the garden."),
    ("Ich trinke gern Kaffee.", "I like to drink coffee."),
    ("Die Katze ist klein.", "The cat is small."),
    ("Wir gehen heute nach Hause.", "We are going home today."),
    ("Das Wetter ist schön.", "The weather is nice."),
    ("Er liest ein Buch.", "He is reading a book."),
    ("Sie wohnt in Berlin.", "She lives in Berlin."),
    ("Der Garten ist groß.", "The garden is big."),
    ("Die Datei wurde gespeichert.", "The file was saved."),
]


def write_tsv(path):
    path.write_text("".join(f"{de}\t{en}\n" for de, en in PAIRS), encoding="utf-8")
    return path


def make_task(tmp_path, files, **data):
    cfg = TranslationTaskConfig(
        model=TranslationModelConfig(
            d_model=32,
            num_encoder_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            ff_size=64,
            dropout=0.0,
            max_len=24,
        ),
        data=TranslationDataConfig(
            files=[str(f) for f in files],
            vocab_size=200,
            val_fraction=0.2,
            cache_dir=str(tmp_path / "cache"),
            **data,
        ),
    )
    task = TranslationTask(cfg, seed=3)
    task.prepare()
    task.load()
    return task


@pytest.fixture
def task(tmp_path):
    return make_task(tmp_path, [write_tsv(tmp_path / "pairs.tsv")])


def test_tsv_source_counts_and_summary(task):
    assert (task.num_train, task.num_val) == (8, 2)
    summary = task.data_summary
    assert summary["pairs_read"] == 10 and summary["pairs_per_source"] == {"tsv": 10}
    assert set(task.data.val_pairs) <= set(PAIRS)
    assert task.units_per_sample == task.tokens_per_sample > 2.0


def test_batch_shapes_and_count_before_forward(task):
    batch = task.make_batch([0, 4, 7], epoch=0, split="train")
    assert set(batch) == {"src", "tgt_in", "tgt_out"}
    for value in batch.values():
        assert value.shape == (3, 24) and value.dtype == torch.int64
    assert torch.equal(batch["tgt_in"][:, 1:], batch["tgt_out"][:, :-1])  # teacher forcing
    assert ((batch["src"] == EOS_ID).sum(dim=1) == 1).all()
    expected = int((batch["tgt_out"] != PAD_ID).sum())
    assert task.count(batch) == expected > 3  # no model involved


def test_batches_depend_only_on_position(task):
    assert_split_invariant(task, [6, 1, 3, 0, 7], epoch=0, cut=2)
    assert torch.equal(
        task.make_batch([2, 5], 0, "train")["src"], task.make_batch([2, 5], 4, "train")["src"]
    )  # nothing random


def test_loss_is_a_zero_dim_sum_over_target_tokens(task):
    assert_model_contract(task, 8)


def test_a_few_steps_reduce_the_loss_and_greedy_decodes(task):
    torch.manual_seed(0)
    model = task.build_model()
    losses = fit(task, model, range(8), steps=20, lr=3e-3)
    assert losses[-1] < 0.7 * losses[0]
    model.eval()
    hyps = task.translate(model, task.make_batch([0, 1], 0, "train")["src"])
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
    examples = task.examples(model, n=2)
    assert [e[:2] for e in examples] == task.data.val_pairs[:2]


def test_validation_metrics_add_up_with_bleu(task):
    pytest.importorskip("sacrebleu")
    torch.manual_seed(0)
    model = task.build_model().eval()
    sums = {}
    task.cfg.data.bleu_samples = 1
    keys = []
    for part in ([0], [1]):  # position 1 is past bleu_samples: same keys, zero BLEU counts
        part_sums = task.evaluate_batch(model, task.make_batch(part, 0, "val"), part)
        keys.append(set(part_sums))
        for key, value in part_sums.items():
            sums[key] = sums.get(key, 0.0) + value
    assert keys[0] == keys[1] and sums["bleu_sentences"] == 1.0
    metrics = task.finalize_metrics(sums)
    assert set(metrics) == {"val_loss", "val_ppl", "val_bleu"} and 0.0 <= metrics["val_bleu"] <= 100
    with torch.no_grad():
        full = model(**task.make_batch([0, 1], 0, "val"))
    assert metrics["val_loss"] == pytest.approx(float(full) / sums["tokens"], rel=1e-5)


def test_bleu_statistics_are_additive():
    sacrebleu = pytest.importorskip("sacrebleu")
    hyps = ["the house is big .", "a dog sleeps in garden", "I like coffee", "she lives there"]
    refs = [en for _, en in PAIRS[:4]]
    split = [bleu_stats(hyps[:1], refs[:1]), bleu_stats([], []), bleu_stats(hyps[1:], refs[1:])]
    assert set(split[0]) == set(split[1]) == set(split[2])
    summed = {k: sum(part[k] for part in split) for k in split[0]}
    assert bleu_from_stats(summed) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)


def test_parallel_files_and_their_errors(tmp_path):
    (tmp_path / "a.de").write_text("\n".join(de for de, _ in PAIRS) + "\n", encoding="utf-8")
    (tmp_path / "a.en").write_text("\n".join(en for _, en in PAIRS) + "\n", encoding="utf-8")
    task = make_task(tmp_path, [tmp_path / "a.*"])
    assert task.data_summary["pairs_per_source"] == {"parallel": 10}
    # naming either file of a pair selects the pair once
    assert resolve_sources([str(tmp_path / "a.en")]).parts == (
        ("parallel", str(tmp_path / "a.de")),
    )
    (tmp_path / "b.de").write_text("Hallo\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"b\.de' has no partner"):
        resolve_sources([str(tmp_path / "b.de")])
    (tmp_path / "bad.tsv").write_text("kein Tab hier\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 1 has no tab"):
        make_task(tmp_path, [tmp_path / "bad.tsv"])
    with pytest.raises(ConfigError, match="matches no file"):
        resolve_sources([str(tmp_path / "missing-*.tsv")])


def test_ding_format_keeps_aligned_sentences(tmp_path):
    path = tmp_path / "de-en"
    path.write_text(
        "# comment line\n"
        "Haus {n}; Gebäude {n} :: house; building\n"
        "Das ist gut. | Das ist sehr gut! :: That is good. | That is very good!\n"
        "Nur eine Seite. | Zwei :: Only one side.\n"
        "Wie geht es dir? [ugs.] :: How are you doing? [coll.]\n",
        encoding="utf-8",
    )
    assert read_ding(path) == [
        ("Das ist gut.", "That is good."),
        ("Das ist sehr gut!", "That is very good!"),
        ("Wie geht es dir?", "How are you doing?"),
    ]


@pytest.mark.skipif(not (SYSTEM_LOCALE / "bash.mo").is_file(), reason="no German bash catalog")
def test_gettext_catalog_reads_german_english_pairs():
    pairs = read_mo(SYSTEM_LOCALE / "bash.mo")
    assert len(pairs) > 100
    assert all("\x04" not in en and "\n" not in de for de, en in pairs)


def test_config_checks_name_the_field():
    with pytest.raises(
        ConfigError, match=r"^task.model.num_heads=3 does not divide task.model.d_model=128"
    ):
        TranslationModelConfig(num_heads=3)
    with pytest.raises(ConfigError, match=r"^task.model.label_smoothing=1.0 is invalid"):
        TranslationModelConfig(label_smoothing=1.0)
    with pytest.raises(ConfigError, match=r"^task.data.vocab_size=10 is too small"):
        TranslationDataConfig(vocab_size=10)


def test_fresh_machine_falls_back_to_pip_installed_catalogs(tmp_path, monkeypatch):
    """Without Debian's trans-de-en and /usr/share/locale/de (a fresh machine) the default
    text is the German catalogs of pip-installed packages: Django's, a dependency of
    hetseq_hpc (757 distinct pairs with Django 5.2); the source names the package. With none
    at all, one line says what to do."""
    from hetseq_hpc.tasks.translation import parallel_corpus as corpus

    monkeypatch.setattr(corpus, "DING_PATH", tmp_path / "no-ding")
    monkeypatch.setattr(corpus, "SYSTEM_LOCALE", tmp_path / "no-locale")
    source = resolve_sources([])
    assert {kind for kind, _ in source.parts} == {"site-packages"}
    assert "django" in source.description
    pairs, per_kind = corpus.read_pairs(source, 200)
    assert len(pairs) >= 500 and per_kind["site-packages"] >= len(pairs)
    assert ("Datei", "File") in pairs or any(en == "File" for _, en in pairs)
    monkeypatch.setattr(corpus, "site_package_catalogs", lambda: [])
    with pytest.raises(DataError, match=r"set task.data.files to a german<TAB>english .tsv"):
        resolve_sources([])
