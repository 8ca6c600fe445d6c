"""Tiny Hugging Face models and data made in the test (nothing downloaded): a byte-level BPE
tokenizer + GPT-2 and Llama (causal LM), a WordPiece tokenizer + BERT (masked LM, sequence
classification), a WordPiece tokenizer ending each text with ``</s>`` + T5 (seq2seq), saved
with ``save_pretrained`` (safetensors), and text / JSON-lines files of CPython's help texts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List


def help_texts(n: int = 600) -> List[str]:
    """``n`` short paragraphs of CPython's ``pydoc_data.topics`` (one line each)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            line = " ".join(para.split())
            if 20 <= len(line) <= 300:
                out.append(line)
    return out[:n]


def _bpe_tokenizer(texts: List[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _wordpiece_tokenizer(texts: List[str]):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials, show_progress=False),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _t5_tokenizer(texts: List[str]):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials, show_progress=False),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def make_t5(directory: Path, seed: int = 0) -> Path:
    """A 2+2-layer, 32-wide T5 (seq2seq) with a 300-token WordPiece vocabulary whose texts end
    with ``</s>`` (as T5's own tokenizer does), saved to ``directory``."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    tok = _t5_tokenizer(help_texts())
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tok),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    T5ForConditionalGeneration(config).save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def make_gpt2(directory: Path, seed: int = 0, dtype=None) -> Path:
    """A 2-layer, 32-wide GPT-2 with a 300-token byte-level BPE, saved to ``directory`` (in
    ``dtype``, e.g. ``torch.bfloat16``; default fp32)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = _bpe_tokenizer(help_texts())
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = GPT2LMHeadModel(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def make_llama(directory: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide Llama (causal LM: rotary positions, RMSNorm, grouped-query attention
    with 1 key/value head, an untied ``lm_head``) with a 300-token byte-level BPE, saved to
    ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _bpe_tokenizer(help_texts())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def make_bert(directory: Path, kind: str = "masked_lm", seed: int = 0) -> Path:
    """A 2-layer, 32-wide BERT (``masked_lm`` or ``classification``, 2 labels) with a
    400-token WordPiece vocabulary, saved to ``directory``."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    tok = _wordpiece_tokenizer(help_texts())
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        num_labels=2,
    )
    cls = BertForMaskedLM if kind == "masked_lm" else BertForSequenceClassification
    cls(config).save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def write_text_files(root: Path) -> dict:
    """``lines.txt`` (one paragraph per line), ``labelled.jsonl`` (``{"text", "label"}``,
    label 1 when the paragraph mentions a keyword-ish word) and ``pairs.jsonl``
    (``{"source", "target"}``: a paragraph and its first 8 words reversed)."""
    texts = help_texts()
    (root / "lines.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    with open(root / "pairs.jsonl", "w", encoding="utf-8") as fh:
        for text in texts[:400]:
            target = " ".join(reversed(text.split()[:8]))
            fh.write(json.dumps({"source": text, "target": target}) + "\n")
    with open(root / "labelled.jsonl", "w", encoding="utf-8") as fh:
        for text in texts[:400]:
            fh.write(
                json.dumps({"text": text, "label": int("return" in text or "def" in text)}) + "\n"
            )
    return {
        "txt": root / "lines.txt",
        "jsonl": root / "labelled.jsonl",
        "pairs": root / "pairs.jsonl",
    }


def jsonl_to_parquet(source: Path, out: Path, row_group_size: int = 64) -> Path:
    """Write the JSON-lines file ``source`` as the Parquet file ``out`` (same records, same
    order, columns in the first record's key order) in row groups of ``row_group_size`` rows;
    returns ``out``. Needs pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    pq.write_table(pa.Table.from_pylist(rows), out, row_group_size=row_group_size)
    return out
